"""The local-kernel contract and the registry that chooses a kernel, never silently.

A kernel computes attention on ONE rank for one block: ``forward(q, k, v, mask, scale) -> AttnOutput`` and
``backward(do, q, k, v, out, lse, mask, scale) -> (dq, dk, dv)``, where ``out`` and ``lse`` are the FINAL
results of the whole row (ALGORITHMS.md §1.4): with the final lse every block's gradient is exact on its
own, so distributed backward passes only route sums.

Shapes: q, do, out ``(B, Sq, H, D)``; k, v ``(B, Sk, Hkv, D)`` with ``H % Hkv == 0`` (query head h uses KV
head ``h // (H // Hkv)``; KV heads are never replicated); lse ``(B, H, Sq)`` fp32, natural log (fp64 for fp64
inputs). Inputs may be row-slices (strided views); the last dim is contiguous. Block outputs may come back
in fp32 (reference) or the input dtype (GPU kernels); gradients in either; callers accumulate in fp32.

Each kernel declares what it serves in ``not_supported_reasons(call)``; ``select`` walks the candidates and
either returns one or raises ``UnsupportedInputError`` with every kernel's reasons.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UnsupportedInputError, rank_suffix
from ..masks import Band, Mask, Varlen
from ..types import AttnOutput

__all__ = ["KERNELS", "Kernel", "KernelCall", "available_kernels", "register", "select"]

log = logging.getLogger("seqpar.kernels")


@dataclass(frozen=True)
class KernelCall:
    """What a kernel must serve (hashable: selection is cached on it)."""

    device: str
    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    mask: str          # "full" | "causal" (Band with lo unbounded) | "band" | "varlen"
    deterministic: bool = False
    needs_delta: bool = False   # the caller sends Delta = rowsum(dO * O) instead of O (pass-Q backward)
    single: bool = False        # a 1 x 1 block (one query, one key)

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, mask: Mask, deterministic: bool = False,
           needs_delta: bool = False) -> KernelCall:
        return KernelCall(q.device.type, q.dtype, q.shape[-1], q.shape[2], k.shape[2], mask_kind(mask),
                          deterministic, needs_delta, q.shape[1] == 1 and k.shape[1] == 1)


def mask_kind(mask: Mask) -> str:
    if isinstance(mask, Varlen):
        return "varlen"
    if mask.is_full:
        return "full"
    return "causal" if mask.lo is None else "band"


class Kernel(ABC):
    """One local attention implementation. Subclasses are stateless singletons."""

    name: ClassVar[str]
    #: preference when ``kernel="auto"`` (higher first) per device type; absent = never chosen by auto
    auto_rank: ClassVar[dict[str, int]] = {}

    @abstractmethod
    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        """Why this kernel cannot serve ``call`` (empty when it can). Must not touch the device."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                scale: float) -> AttnOutput:
        """Block forward: ``out (B, Sq, H, D)``, ``lse (B, H, Sq)`` fp32; rows seeing no key: 0 and -inf."""

    @abstractmethod
    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None, lse: torch.Tensor, mask: Mask, scale: float, *,
                 delta: torch.Tensor | None = None, deterministic: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block backward from the FINAL ``out`` and ``lse`` of these rows (or ``delta (B, H, Sq)``)."""


KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    KERNELS[kernel.name] = kernel
    return kernel


#: names that stand for a family: "sdpa" = the best of PyTorch's built-in fused kernels
FAMILIES = {"sdpa": ("cudnn", "flash", "efficient")}


def available_kernels() -> list[str]:
    """Every name ``kernel=`` accepts."""
    return ["auto", *sorted(FAMILIES), *sorted(KERNELS)]


def _candidates(name: str, device: str) -> list[Kernel]:
    if name == "auto":
        ranked = [k for k in KERNELS.values() if device in k.auto_rank]
        return sorted(ranked, key=lambda k: -k.auto_rank[device])
    if name in FAMILIES:
        return [KERNELS[n] for n in FAMILIES[name]]
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {available_kernels()}, got {name!r}{rank_suffix()}")
    return [KERNELS[name]]


@functools.lru_cache(maxsize=512)
def select(name: str, call: KernelCall) -> Kernel:
    """The kernel that serves ``call``: the named one, or with "auto"/"sdpa" the best that can.

    Raises ``UnsupportedInputError`` listing every candidate's reasons; never substitutes silently.
    The choice is logged (logger ``seqpar.kernels``, INFO) the first time each signature is seen.
    """
    reasons: dict[str, list[str]] = {}
    for kernel in _candidates(name, call.device):
        why = kernel.not_supported_reasons(call)
        if not why:
            log.info("kernel=%s -> %s for %s", name, kernel.name, call)
            return kernel
        reasons[kernel.name] = why
    if not reasons:
        reasons[name] = [f"no kernel is ranked for device {call.device!r}"]
    raise UnsupportedInputError(f"kernel={name!r} cannot serve {call}{rank_suffix()}:", reasons)


def band_of(mask: Mask) -> Band:
    """The Band of a non-varlen mask (kernels that only take bands call this after checking the kind)."""
    assert isinstance(mask, Band)
    return mask
