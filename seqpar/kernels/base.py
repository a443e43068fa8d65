"""The local-kernel contract and the registry that chooses a kernel, never silently.

A kernel computes attention on ONE rank for one block: ``forward(q, k, v, mask, scale, softcap=) ->
AttnOutput`` and ``backward(do, q, k, v, out, lse, mask, scale, delta=, softcap=) -> (dq, dk, dv)``, where
``out`` and ``lse`` are the FINAL results of the whole row (ALGORITHMS.md §1.4): with the final lse every
block's gradient is exact on its own, so distributed backward passes only route sums.

Shapes: q ``(B, Sq, H, D)``; k ``(B, Sk, Hkv, D)``; v ``(B, Sk, Hkv, Dv)`` (Dv may differ from D: MLA);
do, out ``(B, Sq, H, Dv)``; ``H % Hkv == 0`` (query head h uses KV head ``h // (H // Hkv)``; KV heads are
never replicated); lse ``(B, H, Sq)`` fp32, natural log (fp64 for fp64 inputs). Inputs may be row-slices
(strided views); the last dim is contiguous. Block outputs may come back in fp32 (reference) or the input
dtype (GPU kernels); gradients in either; callers accumulate in fp32.

The lse gradient: a kernel with ``takes_delta`` uses ``delta = rowsum(dO O) - dlse`` when given one; the
others recompute Delta from ``out``, and callers hand them ``seqpar.numerics.GradRows.folded`` (Note
[Folding the lse gradient]) - so every kernel serves a gradient through lse at its own speed.

Note [Direct calls]
    When a whole call is one block on one rank (W = 1, or a window that needs no other rank) and nothing but
    ``out`` is wanted (no lse, no sinks), a kernel whose aten op PyTorch already differentiates (cuDNN, FA2,
    the CPU flash op) is called as it is, so its backward runs as PyTorch's own C++ autograd node: the host
    cost of ``F.scaled_dot_product_attention``, nothing of seqpar's Python per backward.

Each kernel declares what it serves in ``not_supported_reasons(call)`` and how much ``auto`` wants it for a call
(``rank(call)``: ``auto_rank`` by device unless the kernel knows better, Note [Bands on flex]); ``select`` walks
the candidates and either returns one or raises ``UnsupportedInputError`` with every kernel's reasons.
``kernel="auto"`` never picks ``reference`` on CUDA, and logs a one-time warning when it picks a kernel other
than the fastest one for the device and dtype (with that kernel's reasons). Selection is a pure function of
the ``KernelCall`` (the device's compute capability is one of its fields), so it is tested without a GPU.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UnsupportedInputError, rank_suffix
from ..masks.forms import Band, Joined, Mask, Modded, Stacked, Varlen
from ..types import AttnOutput

__all__ = ["KERNELS", "Kernel", "KernelCall", "available_kernels", "device_arch", "register", "select"]

log = logging.getLogger("seqpar.kernels")


@dataclass(frozen=True)
class KernelCall:
    """What a kernel must serve (hashable: selection is cached on it)."""

    device: str
    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    mask: str          # "full" | "causal" (Band with lo unbounded) | "band" | "open" (a band with hi unbounded) |
    #                    "varlen" | "mod" (Modded) | "joined"
    deterministic: bool = False
    single: bool = False        # a 1 x 1 block (one query, one key)
    value_dim: int = 0          # Dv; 0 means equal to head_dim
    softcap: bool = False       # tanh score capping (Gemma 2)
    shapes_vary: bool = False   # the block's shape changes batch to batch (documents): Note [Plans per shape]
    arch: int = 0               # the CUDA device's compute capability, 10 * major + minor (0: not CUDA, not known)
    training: bool = False      # a block of a planned call a backward follows (``TaskRunner``): a training step,
    #                             whose signature - and, without ``shapes_vary``, block shapes - recur step after step
    wide: bool = False          # the block has at least ``executor.WIDE_ROWS`` query rows (``TaskRunner``): large
    #                             enough that per-cell speed, not a call's fixed cost, decides (Note [Bands on flex]);
    #                             ``JOIN_ROWS`` in a short step, whose blocks it joins (Note [Short steps join])
    backward: bool = False      # the block's backward: a kernel may be preferred for one direction only (Note
    #                             [Band backward on few KV heads] in ``seqpar.kernels.executor``)

    @property
    def dv(self) -> int:
        return self.value_dim or self.head_dim

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, mask: Mask, deterministic: bool = False, *, value_dim: int = 0,
           softcap: bool = False) -> KernelCall:
        dv = 0 if value_dim == q.shape[-1] else value_dim
        return KernelCall(q.device.type, q.dtype, q.shape[-1], q.shape[2], k.shape[2], mask_kind(mask),
                          deterministic, q.shape[1] == 1 and k.shape[1] == 1, dv, softcap, arch=device_arch(q.device))


@functools.lru_cache(maxsize=16)
def device_arch(device: torch.device) -> int:
    """``10 * major + minor`` of a CUDA device's compute capability (90 on Hopper); 0 for other devices."""
    if device.type != "cuda":
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def mask_kind(mask: Mask) -> str:
    if isinstance(mask, Varlen):
        return "varlen"
    if isinstance(mask, Modded):
        return "mod"
    if isinstance(mask, Joined):
        return "joined"
    if isinstance(mask, Stacked):                       # one call of its band's kernel, the blocks as its batch
        return mask_kind(mask.band)
    if mask.is_full:
        return "full"
    if mask.lo is None:
        return "causal"
    return "open" if mask.hi is None else "band"        # open: Note [Open bands backwards] in seqpar.kernels.sdpa


class Kernel(ABC):
    """One local attention implementation. Subclasses are stateless singletons (``for_call`` may hand out a
    configured variant of one)."""

    name: ClassVar[str]
    #: preference when ``kernel="auto"`` (higher first) per device type; absent = never chosen by auto
    auto_rank: ClassVar[dict[str, int]] = {}
    #: backward uses a precomputed ``delta`` (else it recomputes Delta from ``out``: callers fold dlse in)
    takes_delta: ClassVar[bool] = False
    #: ``autograd_forward`` takes ``softcap`` (a direct call may then cap scores)
    direct_softcap: ClassVar[bool] = False
    #: builds and keeps an execution plan per block shape (Note [Plans per shape]): auto skips it for shapes
    #: that vary batch to batch
    plans_per_shape: ClassVar[bool] = False
    #: a step's blocks it serves are worth one call over their bounding box (a ``Joined`` mask): Note [Bands on
    #: flex] in ``seqpar.kernels.executor``
    joins: ClassVar[bool] = False
    #: serves a band of full keys and a top-left causal rest (``lo`` None, ``hi`` > 0) as two calls
    #: (``sdpa.causal_parts``): the runner hands it the two blocks as tasks of their own (Note [Split bands as
    #: tasks] in ``seqpar.kernels.executor``)
    splits_bands: ClassVar[bool] = False
    #: ``backward`` returns dq, dk, dv in the inputs' dtype (False: wider, the accumulation dtype), so a partial
    #: sent in that dtype loses nothing (Note [Partials home] in ``seqpar.methods._passkv``)
    grads_in_input_dtype: ClassVar[bool] = True

    def rank(self, call: KernelCall) -> int | None:
        """``auto``'s preference for ``call`` (higher first; None: never chosen by auto). ``auto_rank`` for the
        call's device; a kernel measured faster for some calls says so here (Note [Bands on flex])."""
        return self.auto_rank.get(call.device)

    def for_call(self, call: KernelCall, *, named: bool = False) -> Kernel:
        """The instance that runs ``call``: this one, or a variant of it configured by the call (flex compiled for
        every shape where shapes recur or vary: Note [Flex recompiles] in ``seqpar.kernels.flex``; FA2's long
        documents beside it on cuDNN: Note [Long documents in few heads] in ``seqpar.kernels.long_docs``).
        ``named``: the caller asked for this kernel by its name (no other kernel may serve any of the call)."""
        return self

    @abstractmethod
    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        """Why this kernel cannot serve ``call`` (empty when it can). Must not touch the device."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float, *,
                softcap: float = 0.0) -> AttnOutput:
        """Block forward: ``out (B, Sq, H, Dv)``, ``lse (B, H, Sq)`` fp32; rows seeing no key: 0 and -inf."""

    def direct(self, mask: Mask) -> bool:
        """Whether ``autograd_forward`` serves a whole call with this mask (Note [Direct calls])."""
        return False

    def trains_on_engine(self, mask: Mask, rows: int, arch: int, softcap: float) -> bool:
        """Whether a training call of ``rows`` query rows with this mask runs faster as the engine's forward and
        backward than through ``autograd_forward`` (then it takes no direct path)."""
        return False

    def autograd_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                         scale: float, softcap: float = 0.0) -> torch.Tensor:
        """``out (B, S, H, Dv)`` through an aten op that PyTorch's autograd differentiates (Note [Direct calls])."""
        raise NotImplementedError(f"kernel {self.name!r} has no differentiable whole-call op")

    @abstractmethod
    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None, lse: torch.Tensor, mask: Mask, scale: float, *,
                 delta: torch.Tensor | None = None, softcap: float = 0.0, deterministic: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block backward from the FINAL ``out`` and ``lse`` of these rows; kernels with ``takes_delta`` use
        ``delta (B, H, Sq)`` when given (``out`` may then be None)."""


KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    KERNELS[kernel.name] = kernel
    return kernel


#: names that stand for a family: "sdpa" = the best of PyTorch's built-in fused kernels
FAMILIES = {"sdpa": ("cudnn", "flash", "efficient")}


def available_kernels() -> list[str]:
    """Every name ``kernel=`` accepts."""
    return ["auto", *sorted(FAMILIES), *sorted(KERNELS)]


def _candidates(name: str, call: KernelCall) -> list[Kernel]:
    if name == "auto":
        ranked = [(r, k) for k in KERNELS.values() if (r := k.rank(call)) is not None]
        return [k for _, k in sorted(ranked, key=lambda rk: -rk[0])]
    if name in FAMILIES:
        return [KERNELS[n] for n in FAMILIES[name]]
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {available_kernels()}, got {name!r}{rank_suffix()}")
    return [KERNELS[name]]


# Note [Plans per shape]
#     PyTorch's cuDNN attention builds a cuDNN graph (execution plan) for every new shape - batch, heads, q and
#     kv lengths, strides - and keeps it in a per-thread map that is never evicted (``MHAGraphCache`` in
#     aten/src/ATen/native/cudnn/MHA.cpp). For fixed shapes that is free after the first call. Packed documents
#     make new block shapes every batch: on one H100, 1M-token packed batches whose large documents ran on cuDNN
#     grew host memory by 90-130 MiB and spent 3-5 s per batch, without end (after: +10 MiB over 180 batches,
#     0.2 s each; ``benchmarks/results/2026-11-25-h100-hardening``). So a block whose shape comes from the
#     batch - two or more documents, or a valid length - is a ``KernelCall`` with ``shapes_vary``, and
#     ``kernel="auto"`` passes over kernels that declare ``plans_per_shape`` for it (FA2 serves it, varlen
#     packed); a kernel named explicitly is still used. Prompts of new lengths in serving meet the same cache.


@functools.lru_cache(maxsize=512)
def select(name: str, call: KernelCall) -> Kernel:
    """The kernel that serves ``call``: the named one, or with "auto"/"sdpa" the best that can.

    Raises ``UnsupportedInputError`` listing every candidate's reasons; never substitutes silently.
    The choice is logged (logger ``seqpar.kernels``, INFO) the first time each signature is seen.
    """
    reasons: dict[str, list[str]] = {}
    for kernel in _candidates(name, call):
        if name == "auto" and call.shapes_vary and kernel.plans_per_shape:
            continue                    # Note [Plans per shape]: not a refusal, a choice (no warning)
        why = kernel.not_supported_reasons(call)
        if not why:
            log.info("kernel=%s -> %s for %s", name, kernel.name, call)
            if name == "auto" and reasons and call.device != "cpu":     # CPU runs are for correctness
                _warn_slower(kernel, call, reasons)
            return kernel.for_call(call, named=name == kernel.name)
        reasons[kernel.name] = why
    if not reasons:
        reasons[name] = [f"no kernel is ranked for device {call.device!r}"]
    if name == "auto" and call.device != "cpu":
        reasons["reference"] = ["kernel='auto' never picks the reference kernel on a GPU (it materialises the "
                                "scores and can exhaust memory); pass kernel='reference' to ask for it"]
    raise UnsupportedInputError(f"kernel={name!r} cannot serve {call}{rank_suffix()}:", reasons)


def _warn_slower(chosen: Kernel, call: KernelCall, refused: dict[str, list[str]]) -> None:
    """One warning per signature when auto settles for a kernel below the fastest one for this device/dtype."""
    best = _fastest(call.device, call.dtype, call.head_dim, call.dv)
    if best is None or best == chosen.name or best not in refused:
        return
    log.warning("kernel='auto' chose %s, slower than %s for %s on %s: %s refused because %s", chosen.name, best,
                call.dtype, call.device, best, "; ".join(refused[best]))


@functools.lru_cache(maxsize=64)
def _fastest(device: str, dtype: torch.dtype, head_dim: int, value_dim: int) -> str | None:
    """The highest-ranked kernel serving a plain (full-mask) call of this device, dtype and head dims."""
    plain = KernelCall(device, dtype, head_dim, 1, 1, "full", value_dim=0 if value_dim == head_dim else value_dim)
    for kernel in _candidates("auto", plain):
        if not kernel.not_supported_reasons(plain):
            return kernel.name
    return None


def band_of(mask: Mask) -> Band:
    """The Band of a non-varlen mask (kernels that only take bands call this after checking the kind)."""
    assert isinstance(mask, Band)
    return mask
