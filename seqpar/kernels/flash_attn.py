"""The flash-attn package (Dao-AILab), when importable: lazily imported, never required.

Uses flash-attn's private forward/backward entry points of versions >= 2.7 (the split window arguments),
which take the final out and lse in backward. The version is compared numerically, never as a string.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..masks import Mask, Varlen, bottom_right_window
from ..types import AttnOutput
from .base import Kernel, KernelCall, band_of, register

__all__ = ["FlashAttnKernel"]

_MIN_VERSION = (2, 7)


@functools.lru_cache(maxsize=1)
def _module():
    """``(flash_attn_interface module, None)`` or ``(None, reason)``."""
    try:
        fa = importlib.import_module("flash_attn")
        iface = importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as e:     # ImportError, or a broken CUDA extension raising at import
        return None, f"flash_attn is not importable ({type(e).__name__}: {e})"
    parts = []
    for p in str(getattr(fa, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < _MIN_VERSION:
        return None, f"flash_attn {fa.__version__} is older than {'.'.join(map(str, _MIN_VERSION))}"
    return iface, None


class FlashAttnKernel(Kernel):
    """flash-attn 2 (``_flash_attn_forward`` / ``_flash_attn_backward``): bands with windows, GQA native."""

    name = "flash_attn"
    auto_rank = {"cuda": 80}

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        r = []
        if call.device != "cuda":
            r.append(f"runs on CUDA only, got device {call.device!r}")
        if call.dtype not in (torch.float16, torch.bfloat16):
            r.append(f"dtype must be fp16 or bf16, got {call.dtype}")
        if call.head_dim > 256 or call.head_dim % 8:
            r.append(f"head_dim must be a multiple of 8 up to 256, got {call.head_dim}")
        if call.mask == "varlen":
            r.append("varlen runs through the 'flash' kernel (PyTorch's FA2 varlen entry)")
        if call.needs_delta:
            r.append("backward recomputes Delta from out; it cannot take a precomputed Delta")
        if not r:
            _, why = _module()
            if why:
                r.append(why)
        return r

    @staticmethod
    def _window(mask: Mask, m: int, n: int) -> tuple[bool, int, int]:
        assert not isinstance(mask, Varlen)
        left, right = bottom_right_window(band_of(mask), m, n)
        return (left, right) == (-1, 0), left, right

    def forward(self, q, k, v, mask: Mask, scale: float) -> AttnOutput:
        iface, _ = _module()
        causal, left, right = self._window(mask, q.shape[1], k.shape[1])
        res = iface._flash_attn_forward(q, k, v, 0.0, scale, causal, window_size_left=left, window_size_right=right)
        return AttnOutput(res[0], res[1])

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, deterministic=False):
        iface, _ = _module()
        causal, left, right = self._window(mask, q.shape[1], k.shape[1])
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        iface._flash_attn_backward(do.contiguous(), q, k, v, out, lse.contiguous(), dq, dk, dv, 0.0, scale, causal,
                                   left, right, 0.0, None, deterministic, None)
        return dq, dk, dv


register(FlashAttnKernel())
