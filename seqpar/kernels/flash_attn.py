"""The flash-attn packages (Dao-AILab), when importable: lazily imported, never required.

``flash_attn`` is FlashAttention-2 (``flash_attn.flash_attn_interface``, versions >= 2.7: the split window
arguments and ``softcap``); ``flash_attn3`` is FlashAttention-3 for Hopper (the ``flash_attn_interface``
module of its ``hopper/`` build). Both take the final out and lse in backward through their private entry
points, which is what a distributed schedule needs (their public autograd functions recompute their own).
Versions are compared numerically, never as strings. Neither serves a value head dim that differs from the
key head dim here: the smaller is zero-padded (zeros change no score and no output).

``flash_attn3`` is not ranked for ``kernel="auto"``: the GPU image we measure on does not ship it, so there
is no measurement showing it beats cuDNN on Hopper; name it to use it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect

import torch

from ..masks import Mask, Varlen, bottom_right_window
from ..types import AttnOutput
from .base import Kernel, KernelCall, band_of, register
from .sdpa import fa2_pieces, pad_dim, pieces_backward, pieces_forward

__all__ = ["FlashAttn3Kernel", "FlashAttnKernel"]

_MIN_VERSION = (2, 7)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in str(text).split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.lru_cache(maxsize=1)
def _fa2():
    """``(flash_attn.flash_attn_interface, None)`` or ``(None, reason)``."""
    try:
        fa = importlib.import_module("flash_attn")
        iface = importlib.import_module("flash_attn.flash_attn_interface")
    except Exception as e:     # ImportError, or a broken CUDA extension raising at import
        return None, f"flash_attn is not importable ({type(e).__name__}: {e})"
    if _version(getattr(fa, "__version__", "0")) < _MIN_VERSION:
        return None, f"flash_attn {fa.__version__} is older than {'.'.join(map(str, _MIN_VERSION))}"
    if importlib.util.find_spec("flash_attn_2_cuda") is None:
        return None, ("flash_attn has no compiled extension flash_attn_2_cuda: a Python stand-in (such as the "
                      "peers' shim routing to PyTorch's FA2) is not flash-attn; use kernel='flash'")
    return iface, None


@functools.lru_cache(maxsize=1)
def _fa3():
    """``(flash_attn_interface module, None)`` or ``(None, reason)``: FlashAttention-3's Hopper build."""
    try:
        iface = importlib.import_module("flash_attn_interface")
    except Exception as e:
        return None, f"flash_attn_interface (FlashAttention-3) is not importable ({type(e).__name__}: {e})"
    need = {"_flash_attn_forward": ("softcap", "window_size_left"), "_flash_attn_backward": ("softcap", "dq")}
    for fn, args in need.items():
        f = getattr(iface, fn, None)
        try:
            params = inspect.signature(f).parameters if f is not None else {}
        except (TypeError, ValueError):
            params = {}
        missing = [a for a in args if a not in params]
        if f is None or missing:
            return None, (f"flash_attn_interface.{fn} lacks the arguments {missing or list(args)} this adapter "
                          f"passes (a FlashAttention-3 build from 2025 or later is needed)")
    return iface, None


def _padded(*xs: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    n = max(x.shape[-1] for x in xs)
    return n, [pad_dim(x, n) for x in xs]


def _reasons(call: KernelCall, module_reason) -> list[str]:
    r = []
    if call.device != "cuda":
        r.append(f"runs on CUDA only, got device {call.device!r}")
    if call.dtype not in (torch.float16, torch.bfloat16):
        r.append(f"dtype must be fp16 or bf16, got {call.dtype}")
    for what, d in (("head_dim", call.head_dim), ("value head_dim", call.dv)):
        if d > 256 or d % 8:
            r.append(f"{what} must be a multiple of 8 up to 256, got {d}")
    if call.mask == "varlen":
        r.append("varlen runs through the 'flash' kernel (PyTorch's FA2 varlen entry)")
    if call.mask in ("mod", "joined"):
        r.append(f"a {call.mask} block runs on flex (GPU) or the reference kernel")
    if not r:
        _, why = module_reason()
        if why:
            r.append(why)
    return r


def _window(mask: Mask, m: int, n: int) -> tuple[bool, int, int]:
    assert not isinstance(mask, Varlen)
    left, right = bottom_right_window(band_of(mask), m, n)
    return (left, right) == (-1, 0), left, right


class FlashAttnKernel(Kernel):
    """flash-attn 2 (``_flash_attn_forward`` / ``_flash_attn_backward``): bands with windows, softcap, GQA."""

    name = "flash_attn"
    auto_rank = {"cuda": 80}

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        return _reasons(call, _fa2)

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        if (pieces := fa2_pieces(band_of(mask), q.shape[1], k.shape[1])) is not None:     # FA2's clamped windows
            return pieces_forward(lambda *a: self.forward(*a, scale, softcap=softcap), q, k, v, pieces)
        iface, _ = _fa2()
        causal, left, right = _window(mask, q.shape[1], k.shape[1])
        dv = v.shape[-1]
        _, (q, k, v) = _padded(q, k, v)
        res = iface._flash_attn_forward(q, k, v, 0.0, scale, causal, left, right, float(softcap), None, False)
        return AttnOutput(res[0][..., :dv], res[1])

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        if (pieces := fa2_pieces(band_of(mask), q.shape[1], k.shape[1])) is not None:
            return pieces_backward(lambda *a: self.backward(*a, scale, softcap=softcap, deterministic=deterministic),
                                   do, q, k, v, out, lse, pieces)
        iface, _ = _fa2()
        causal, left, right = _window(mask, q.shape[1], k.shape[1])
        d, dv_ = q.shape[-1], v.shape[-1]
        _, (q, k, v, do, out) = _padded(q, k, v, do, out)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        iface._flash_attn_backward(do.contiguous(), q, k, v, out, lse.contiguous(), dq, dk, dv, 0.0, scale, causal,
                                   left, right, float(softcap), None, deterministic, None)
        return dq[..., :d], dk[..., :d], dv[..., :dv_]


class FlashAttn3Kernel(Kernel):
    """FlashAttention-3 (Hopper): bands with windows, softcap, GQA; named explicitly (not ranked for auto)."""

    name = "flash_attn3"

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        r = _reasons(call, _fa3)
        if call.device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
            r.append("FlashAttention-3 runs on Hopper (compute capability 9.x) only")
        return r

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        iface, _ = _fa3()
        causal, left, right = _window(mask, q.shape[1], k.shape[1])
        dv = v.shape[-1]
        _, (q, k, v) = _padded(q, k, v)
        res = iface._flash_attn_forward(q, k, v, softmax_scale=scale, causal=causal, window_size_left=left,
                                        window_size_right=right, softcap=float(softcap))
        return AttnOutput(res[0][..., :dv], res[1])

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        iface, _ = _fa3()
        causal, left, right = _window(mask, q.shape[1], k.shape[1])
        d, dv_ = q.shape[-1], v.shape[-1]
        _, (q, k, v, do, out) = _padded(q, k, v, do, out)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        iface._flash_attn_backward(do.contiguous(), q, k, v, out, lse.contiguous(), dq=dq, dk=dk, dv=dv,
                                   softmax_scale=scale, is_causal=causal, window_size_left=left,
                                   window_size_right=right, softcap=float(softcap), deterministic=deterministic)
        return dq[..., :d], dk[..., :d], dv[..., :dv_]


register(FlashAttnKernel())
register(FlashAttn3Kernel())
