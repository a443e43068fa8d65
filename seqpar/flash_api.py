"""flash-attn / ring-flash-attn style entry points, so ring-flash-attn users switch by an import.

Same names and argument order as ring-flash-attn 0.1.8 (``group=`` is the process group; inputs are local
shards ``(b, s_local, h, d)`` in that function's layout). ``return_attn_probs=True`` returns
``(out, lse, None)`` like flash-attn. Unlike ring-flash-attn: dq has q's dtype, windows are applied in
global positions, every layout supports ``causal=False``, and dropout / alibi / softcap raise instead of
being accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import torch

from .api import attention

__all__ = [
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
]


def _run(layout: str, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
         return_attn_probs, group, **extra: Any):
    res = attention(q, k, v, mesh=group, method="ring", layout=layout, causal=causal, softmax_scale=softmax_scale,
                    window_size=tuple(window_size), dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                    deterministic=deterministic, return_lse=True, **extra)
    return (res.out, res.lse, None) if return_attn_probs else res.out


def _family(layout: str):
    def func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
             softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), alibi_slopes=None,
             deterministic: bool = False, return_attn_probs: bool = False, group=None, **extra: Any):
        return _run(layout, q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                    return_attn_probs, group, **extra)

    def kvpacked(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                 causal: bool = False, window_size=(-1, -1), alibi_slopes=None, deterministic: bool = False,
                 return_attn_probs: bool = False, group=None, **extra: Any):
        """``kv (b, s_local, 2, h_kv, d)``."""
        return _run(layout, q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                    alibi_slopes, deterministic, return_attn_probs, group, **extra)

    def qkvpacked(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                  causal: bool = False, window_size=(-1, -1), alibi_slopes=None, deterministic: bool = False,
                  return_attn_probs: bool = False, group=None, **extra: Any):
        """``qkv (b, s_local, 3, h, d)``."""
        return _run(layout, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                    window_size, alibi_slopes, deterministic, return_attn_probs, group, **extra)

    for f, suffix in ((func, ""), (kvpacked, " (kv packed)"), (qkvpacked, " (qkv packed)")):
        f.__doc__ = (f"Ring attention, {layout} layout{suffix}: ``seqpar.attention(method='ring', "
                     f"layout='{layout}')`` with flash-attn's arguments. " + (f.__doc__ or ""))
    return func, kvpacked, qkvpacked


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = _family("contiguous")
zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func = \
    _family("zigzag")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = _family("stripe")
