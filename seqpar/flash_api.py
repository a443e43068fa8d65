"""flash-attn / ring-flash-attn style entry points, so ring-flash-attn users switch by an import.

Same names and argument order as ring-flash-attn 0.1.8 (``group=`` is the process group; inputs are local
shards ``(b, s_local, h, d)`` in that function's layout). ``return_attn_probs=True`` returns
``(out, lse, None)`` like flash-attn. Unlike ring-flash-attn: dq has q's dtype, windows are applied in
global positions, every layout supports ``causal=False``, and dropout / alibi / softcap raise instead of
being accepted and ignored.

Note [Varlen names take GLOBAL cu_seqlens]
    ``*_varlen_func`` take flash-attn's varlen shapes: ``q (total_local, h, d)``, ``k, v (total_local,
    h_kv, d)``, run as batch 1. Two differences from ring-flash-attn, both deliberate:

    * ``cu_seqlens`` are the GLOBAL document boundaries of the packed stream (int32, 0 first, the global
      length ``W * total_local`` last), identical on every rank. ring-flash-attn takes each rank's LOCAL
      ``cu_seqlens``. Passing local ones here raises (their last entry is ``total_local``, not the global
      length); ``seqpar.shard_info(..., cu_seqlens=global)`` gives each rank its local segments and RoPE
      positions when the model needs them.
    * Tokens are placed by the layout over the whole packed stream (``seqpar.shard(x, dim=0, ...)``): ring =
      contiguous, zigzag = chunks r and 2W-1-r of the stream, stripe = every W-th token. ring-flash-attn
      splits each DOCUMENT separately, so every document must divide by W (2W for zigzag); here documents
      have any length, may span ranks, and the end may be padding (pass ``seq_len=`` the valid length).

    ``max_seqlen`` is accepted for signature compatibility and checked to be a positive int: seqpar derives
    every segment length from ``cu_seqlens`` and never needs it. ``return_attn_probs=True`` returns
    ``(out, lse (h, total_local) fp32, None)``, flash-attn's varlen lse layout.

    ``llama3_flash_attn_varlen_func`` is ``method="allgather"``. Its ``cu_seqlens_q`` / ``cu_seqlens_k``
    are the global boundaries too (equal: self-attention), and ``llama3_flash_attn_prepare_cu_seqlens``
    returns them unchanged in those two slots, with this rank's ``max_seqlen_q``, ``max_seqlen_k`` and
    ``local_k_slice`` computed as ring-flash-attn computes them, so the usual two-line pattern
    ``prepare(...) -> llama3_flash_attn_varlen_func(...)`` ports by changing the import. A ``local_k_slice``
    that does not match the global boundaries raises. ``layout="zigzag"`` (keyword) balances causal work.
"""

from __future__ import annotations

from typing import Any

import torch

from .api import attention
from .errors import rank_suffix
from .groups import SeqParallelGroups
from .layouts.varlen import contiguous_gather_segments
from .runtime.call import host_cu_seqlens as _host_cu

__all__ = [
    "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func", "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func", "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func", "stripe_flash_attn_varlen_func", "stripe_flash_attn_varlen_kvpacked_func",
    "stripe_flash_attn_varlen_qkvpacked_func", "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func",
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


# ---- varlen (Note [Varlen names take GLOBAL cu_seqlens]) ----

def _check_varlen(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (total_local, heads, head_dim) in the varlen functions, got {shape}"
                             f"{rank_suffix()}")


def _check_max(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}{rank_suffix()}")


def _global_cu(cu_seqlens, total_local: int, group, extra: dict[str, Any], what: str = "cu_seqlens"
               ) -> tuple[int, ...]:
    """The host boundaries, checked to be GLOBAL (they end at W * total_local, or at ``seq_len``)."""
    if cu_seqlens is None:
        raise ValueError(f"{what} must be given (global document boundaries), got None{rank_suffix()}")
    cu = _host_cu(cu_seqlens)
    world = SeqParallelGroups.resolve(group).world
    end = extra.get("seq_len") or world * total_local
    if cu[-1] != end:
        raise ValueError(
            f"{what} must be the GLOBAL document boundaries ending at the global length {end} ({world} ranks x "
            f"{total_local} local tokens, or seq_len= when the shards end in padding), got {what}[-1]={cu[-1]}. "
            f"ring-flash-attn takes per-rank cu_seqlens; seqpar takes the global ones "
            f"(seqpar.shard_info gives each rank its local segments){rank_suffix()}")
    return cu


def _varlen_run(method: str, layout: str, q, k, v, cu, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                deterministic, return_attn_probs, group, **extra: Any):
    res = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mesh=group, method=method, layout=layout,
                    causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size), cu_seqlens=cu,
                    dropout_p=dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True,
                    **extra)
    out = res.out[0]
    return (out, res.lse[0], None) if return_attn_probs else out


def _varlen_family(layout: str):
    def func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, max_seqlen: int | None = None,
             dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
             alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False, group=None,
             **extra: Any):
        _check_varlen(q, k, v)
        _check_max("max_seqlen", max_seqlen)
        cu = _global_cu(cu_seqlens, q.shape[0], group, extra)
        return _varlen_run("ring", layout, q, k, v, cu, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                           deterministic, return_attn_probs, group, **extra)

    def kvpacked(q: torch.Tensor, kv: torch.Tensor, cu_seqlens, max_seqlen: int | None = None, dropout_p: float = 0.0,
                 softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), alibi_slopes=None,
                 deterministic: bool = False, return_attn_probs: bool = False, group=None, **extra: Any):
        """``kv (total_local, 2, h_kv, d)``."""
        return func(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                    alibi_slopes, deterministic, return_attn_probs, group, **extra)

    def qkvpacked(qkv: torch.Tensor, cu_seqlens, max_seqlen: int | None = None, dropout_p: float = 0.0,
                  softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), alibi_slopes=None,
                  deterministic: bool = False, return_attn_probs: bool = False, group=None, **extra: Any):
        """``qkv (total_local, 3, h, d)``."""
        return func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                    window_size, alibi_slopes, deterministic, return_attn_probs, group, **extra)

    for f, suffix in ((func, ""), (kvpacked, " (kv packed)"), (qkvpacked, " (qkv packed)")):
        f.__doc__ = (f"Varlen ring attention, {layout} layout of the packed stream{suffix}: inputs "
                     f"``(total_local, h, d)``, GLOBAL ``cu_seqlens`` (Note [Varlen names take GLOBAL cu_seqlens] "
                     f"in ``seqpar.flash_api``). " + (f.__doc__ or ""))
    return func, kvpacked, qkvpacked


ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func = \
    _varlen_family("contiguous")
zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func, \
    zigzag_ring_flash_attn_varlen_qkvpacked_func = _varlen_family("zigzag")
stripe_flash_attn_varlen_func, stripe_flash_attn_varlen_kvpacked_func, stripe_flash_attn_varlen_qkvpacked_func = \
    _varlen_family("stripe")


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal: bool, rank: int, world_size: int):
    """ring-flash-attn's llama3 preparation step, for the contiguous all-gather layout.

    Returns:
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``: the first two are the
        GLOBAL ``cu_seqlens`` passed in, unchanged (seqpar cuts them per rank itself; ring-flash-attn returns
        per-rank ones here); ``max_seqlen_q`` / ``max_seqlen_k`` (ints) and ``local_k_slice`` (the span of
        the gathered keys this rank's queries read) are this rank's, as ring-flash-attn computes them.
    """
    cu = _host_cu(cu_seqlens)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}{rank_suffix()}")
    try:
        _, _, max_q, max_k, (lo, hi) = contiguous_gather_segments(cu, causal, rank, world_size)
    except ValueError as e:
        raise ValueError(f"{e}{rank_suffix()}") from None
    return cu_seqlens, cu_seqlens, max_q, max_k, slice(lo, hi)


def llama3_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                                  heads_k_stride: int | None = None, local_k_slice: slice | None = None,
                                  dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic: bool = False,
                                  return_attn_probs: bool = False, group=None, *, layout: str = "contiguous",
                                  **extra: Any):
    """All-gather KV ("llama3") varlen attention: ``seqpar.attention(method="allgather")`` on batch 1.

    ``cu_seqlens_q == cu_seqlens_k`` are the GLOBAL boundaries (Note [Varlen names take GLOBAL cu_seqlens]);
    ``heads_k_stride`` KV heads are gathered per round (None = all); ``local_k_slice`` (optional) must be
    the slice ``llama3_flash_attn_prepare_cu_seqlens`` gives this rank for the contiguous layout.
    """
    _check_varlen(q, k, v)
    _check_max("max_seqlen_q", max_seqlen_q)
    _check_max("max_seqlen_k", max_seqlen_k)
    cu = _global_cu(cu_seqlens_q, q.shape[0], group, extra, "cu_seqlens_q")
    if _host_cu(cu_seqlens_k) != cu:
        raise NotImplementedError(f"cu_seqlens_k must equal cu_seqlens_q (self-attention over the global documents; "
                                  f"cross-attention is not supported), got {_host_cu(cu_seqlens_k)[:8]} and "
                                  f"{cu[:8]}{rank_suffix()}")
    if local_k_slice is not None:
        _check_slice(local_k_slice, cu, causal, layout, group, q.shape[0], extra)
    return _varlen_run("allgather", layout, q, k, v, cu, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                       deterministic, return_attn_probs, group, heads_k_stride=heads_k_stride, **extra)


def _check_slice(local_k_slice, cu, causal, layout, group, total_local, extra) -> None:
    if layout != "contiguous":
        raise ValueError(f"local_k_slice describes the contiguous layout; pass None with layout={layout!r}, got "
                         f"{local_k_slice}{rank_suffix()}")
    groups = SeqParallelGroups.resolve(group)
    padded = list(cu) if extra.get("seq_len") is None else [*cu, groups.world * total_local]
    _, _, _, _, (lo, hi) = contiguous_gather_segments(padded, causal, groups.index, groups.world)
    if not isinstance(local_k_slice, slice) or (local_k_slice.start, local_k_slice.stop) != (lo, hi):
        raise ValueError(f"local_k_slice must be slice({lo}, {hi}) for this rank's documents (from "
                         f"llama3_flash_attn_prepare_cu_seqlens with the global cu_seqlens), got {local_k_slice}"
                         f"{rank_suffix()}")


def llama3_flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                                           heads_k_stride: int | None = None, local_k_slice: slice | None = None,
                                           dropout_p: float = 0.0, softmax_scale: float | None = None,
                                           causal: bool = False, window_size=(-1, -1), alibi_slopes=None,
                                           deterministic: bool = False, return_attn_probs: bool = False, group=None,
                                           **extra: Any):
    """``llama3_flash_attn_varlen_func`` with ``kv (total_local, 2, h_kv, d)``."""
    return llama3_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal, window_size,
                                         alibi_slopes, deterministic, return_attn_probs, group, **extra)


def llama3_flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                                            heads_k_stride: int | None = None, local_k_slice: slice | None = None,
                                            dropout_p: float = 0.0, softmax_scale: float | None = None,
                                            causal: bool = False, window_size=(-1, -1), alibi_slopes=None,
                                            deterministic: bool = False, return_attn_probs: bool = False, group=None,
                                            **extra: Any):
    """``llama3_flash_attn_varlen_func`` with ``qkv (total_local, 3, h, d)``."""
    return llama3_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
                                         window_size, alibi_slopes, deterministic, return_attn_probs, group, **extra)
