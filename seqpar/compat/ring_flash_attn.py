"""ring-flash-attn 0.1.8's public names, with its conventions, as thin adapters over ``seqpar.attention``.

A ring-flash-attn user changes ``from ring_flash_attn import ...`` to ``from seqpar.compat.ring_flash_attn
import ...`` (the names are also ``seqpar.<name>``). Same names, argument order and return values: inputs are
this rank's shards (``group=`` is the process group), ``return_attn_probs=True`` returns ``(out, lse, None)``
with an fp32 lse, ``(b, h, s_local)`` for the batch names and ``(h, total_local)`` for the varlen names.

What differs, on purpose (PEERS.md §1): dq/dk/dv have the input's dtype (not bf16); ``window_size`` is applied
in global positions (ring-flash-attn applies it to each block's local coordinates); every layout supports
``causal=False``; GQA never replicates K/V; ``dropout_p``, ``alibi_slopes`` and softcapping raise instead of
being accepted and ignored; and lengths a layout cannot split raise a clear error before any communication.

Note [ring-flash-attn's varlen conventions]
    ``ring_flash_attn_varlen_*`` and ``zigzag_ring_flash_attn_varlen_*`` take ``q (total_local, h, d)``,
    ``k, v (total_local, h_kv, d)`` and, as in ring-flash-attn, THIS RANK's ``cu_seqlens`` (0 first,
    ``total_local`` last). Each document is split across the W ranks on its own:

        ring (layout "doc_contiguous"): document i is cut into W equal parts, rank r holds part r;
        zigzag (layout "doc_zigzag"):    document i is cut into 2W equal chunks, rank r holds chunks r and
                                         2W-1-r (in that order);
        rank r's rows are its pieces of documents 0, 1, ... in document order.

    So every document length divides by W (2W for zigzag) and rank r's local boundaries are the global ones
    divided by W: seqpar runs ``seqpar.attention(layout="doc_contiguous" | "doc_zigzag",
    cu_seqlens=W * cu_seqlens)`` (``seqpar.layouts.documents``). Boundaries that cannot be this rank's (not
    ending at ``total_local``; for zigzag, a document with an odd local length) raise.

    seqpar's own convention stays available with ``layout="contiguous" | "zigzag"`` (keyword): then
    ``cu_seqlens`` are the GLOBAL boundaries of the packed stream and the stream is split as a whole
    (``seqpar.shard(x, dim=0, layout=...)``), so documents have any length, may span ranks, and the end may be
    padding (``seq_len=`` the valid length). ``stripe_flash_attn_varlen_*`` (not in ring-flash-attn 0.1.8)
    has that convention only (layout "stripe"). ``max_seqlen`` is checked to be a positive int or None:
    seqpar derives every segment from the boundaries and never needs it.

Note [llama3 varlen: ring-flash-attn's prepare step]
    ``llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size)`` takes the GLOBAL
    boundaries of a stream split contiguously (rank r holds rows ``[r L, (r+1) L)``) and returns exactly
    ring-flash-attn's values: ``cu_seqlens_q`` (this rank's query segments), ``cu_seqlens_k`` (each segment's
    keys relative to ``local_k_slice.start``), ``max_seqlen_q``, ``max_seqlen_k`` (ints) and ``local_k_slice``
    (the span of the gathered keys this rank reads). ``llama3_flash_attn_varlen_func`` runs
    ``seqpar.attention(method="allgather", layout="contiguous")``, which needs the global documents on every
    rank; they cannot be rebuilt from one rank's values. So ``prepare`` also records, in this process, the
    global boundaries behind the values it returned (the last 16 calls, keyed by rank, world size, causal and
    the returned values' contents), and the varlen function looks its arguments up there: ``prepare`` then
    the varlen function, as in ring-flash-attn's tests and adapter, ports by changing the import. Values
    that ``prepare`` did not return in this process raise, naming both ways out: call ``prepare``, or pass
    the GLOBAL boundaries as ``cu_seqlens_q = cu_seqlens_k`` (``local_k_slice`` None, or the slice prepare
    gives) - seqpar's own form, which also takes ``layout="zigzag"`` (keyword) to balance causal work.

torch.compile: every seqpar call here, the host reads of boundary tensors and the body of
``llama3_flash_attn_prepare_cu_seqlens`` run eagerly (Note [Compat adapters under torch.compile] in
``seqpar.compat._eager``): a compiled caller graph-breaks there, never on an unbacked integer.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..integrations.hf_ring_flash import substitute_hf_flash_attn, update_ring_flash_attn_params
from ._eager import attention

__all__ = [
    "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func", "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func", "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func", "stripe_flash_attn_varlen_func", "stripe_flash_attn_varlen_kvpacked_func",
    "stripe_flash_attn_varlen_qkvpacked_func", "substitute_hf_flash_attn", "update_ring_flash_attn_params",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]

DOC_LAYOUTS = ("doc_contiguous", "doc_zigzag")
STREAM_LAYOUTS = ("contiguous", "zigzag", "stripe")


# ---- batch names ----

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
        """``q (b, s_local, h, d)``, ``k, v (b, s_local, h_kv, d)``."""
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
                     f"layout='{layout}')`` with flash-attn's arguments; extra keywords go to seqpar.attention. "
                     + (f.__doc__ or ""))
    return func, kvpacked, qkvpacked


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = _family("contiguous")
zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func = \
    _family("zigzag")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = _family("stripe")


# ---- varlen names (Note [ring-flash-attn's varlen conventions]) ----

@torch.compiler.disable
def _host(cu: Any, what: str) -> tuple[int, ...]:
    """Host ints of boundaries given as a 1D integer tensor or a sequence (eager under torch.compile)."""
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what} must be a 1D int32 tensor, got {cu.dtype} of shape {tuple(cu.shape)}"
                            f"{rank_suffix()}")
        return tuple(int(x) for x in cu.tolist())
    if cu is None or isinstance(cu, (str, bytes)) or not isinstance(cu, Sequence):
        raise TypeError(f"{what} must be a 1D int32 tensor or a sequence of ints, got {type(cu).__name__}"
                        f"{rank_suffix()}")
    return tuple(int(x) for x in cu)


def _check_varlen(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (total_local, heads, head_dim) in the varlen functions, got {shape}"
                             f"{rank_suffix()}")


def _check_max(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}{rank_suffix()}")


def _check_rising(cu: tuple[int, ...], what: str, end: int, meaning: str) -> None:
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != end or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"{what} must rise from 0 to {meaning} {end}, got {list(cu[:12])}"
                         f"{' ...' if len(cu) > 12 else ''}{rank_suffix()}")


def _global_cu(cu_seqlens, total_local: int, world: int, extra: dict[str, Any], what: str = "cu_seqlens"
               ) -> tuple[int, ...]:
    """seqpar's convention: the GLOBAL boundaries of the packed stream (ending at W * total_local, or seq_len)."""
    cu = _host(cu_seqlens, what)
    end = extra.get("seq_len") or world * total_local
    if not cu or cu[-1] != end:
        raise ValueError(
            f"{what} must be the GLOBAL document boundaries ending at the global length {end} ({world} ranks x "
            f"{total_local} local tokens, or seq_len= when the shards end in padding) with a stream layout, got "
            f"{what}[-1]={cu[-1] if cu else None}; ring-flash-attn's per-rank cu_seqlens (each document split "
            f"across the ranks) are the default layouts {list(DOC_LAYOUTS)}{rank_suffix()}")
    return cu


def _document_cu(cu_seqlens, total_local: int, world: int, layout: str) -> tuple[int, ...]:
    """ring-flash-attn's convention: this rank's boundaries; the global ones are W times them."""
    cu = _host(cu_seqlens, "cu_seqlens")
    if not cu or cu[-1] != total_local:
        raise ValueError(
            f"cu_seqlens must be this rank's LOCAL document boundaries ending at total_local={total_local} (ring-"
            f"flash-attn's convention for layout={layout!r}: every document split across the {world} ranks), got "
            f"cu_seqlens[-1]={cu[-1] if cu else None}; for the GLOBAL boundaries of a packed stream split as a "
            f"whole pass layout='contiguous' or 'zigzag'{rank_suffix()}")
    _check_rising(cu, "cu_seqlens", total_local, "total_local")
    odd = [i for i, (a, b) in enumerate(itertools.pairwise(cu)) if (b - a) % 2]
    if layout == "doc_zigzag" and odd:
        raise ValueError(f"every document must have an even number of local tokens with layout='doc_zigzag' (its "
                         f"chunks r and 2W-1-r; the document's length a multiple of 2W = {2 * world}), got odd "
                         f"lengths in documents {odd[:8]} of cu_seqlens={list(cu[:12])}{rank_suffix()}")
    return tuple(world * c for c in cu)


def _varlen_run(method: str, layout: str, q, k, v, cu, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                deterministic, return_attn_probs, group, **extra: Any):
    res = attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mesh=group, method=method, layout=layout,
                    causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size), cu_seqlens=cu,
                    dropout_p=dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True,
                    **extra)
    out = res.out[0]
    return (out, res.lse[0], None) if return_attn_probs else out


def _ring_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                 deterministic, return_attn_probs, group, layout: str, allowed: tuple[str, ...], **extra: Any):
    """The ring varlen names: checks, the boundaries in ``layout``'s convention, then ``seqpar.attention``."""
    _check_varlen(q, k, v)
    _check_max("max_seqlen", max_seqlen)
    if layout not in allowed:
        raise ValueError(f"layout must be one of {list(allowed)}, got {layout!r}{rank_suffix()}")
    world = SeqParallelGroups.resolve(group).world
    if layout in DOC_LAYOUTS:
        cu = _document_cu(cu_seqlens, q.shape[0], world, layout)
    else:
        cu = _global_cu(cu_seqlens, q.shape[0], world, extra)
    return _varlen_run("ring", layout, q, k, v, cu, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                       deterministic, return_attn_probs, group, **extra)


def _varlen_family(default: str, allowed: tuple[str, ...]):
    def func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, max_seqlen: int | None = None,
             dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
             alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False, group=None, *,
             layout: str = default, **extra: Any):
        """``q (total_local, h, d)``, ``k, v (total_local, h_kv, d)``; ``cu_seqlens`` int32."""
        return _ring_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size,
                            alibi_slopes, deterministic, return_attn_probs, group, layout, allowed, **extra)

    def kvpacked(q: torch.Tensor, kv: torch.Tensor, cu_seqlens, max_seqlen: int | None = None, dropout_p: float = 0.0,
                 softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), alibi_slopes=None,
                 deterministic: bool = False, return_attn_probs: bool = False, group=None, *, layout: str = default,
                 **extra: Any):
        """``kv (total_local, 2, h_kv, d)``."""
        return _ring_varlen(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                            window_size, alibi_slopes, deterministic, return_attn_probs, group, layout, allowed,
                            **extra)

    def qkvpacked(qkv: torch.Tensor, cu_seqlens, max_seqlen: int | None = None, dropout_p: float = 0.0,
                  softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), alibi_slopes=None,
                  deterministic: bool = False, return_attn_probs: bool = False, group=None, *,
                  layout: str = default, **extra: Any):
        """``qkv (total_local, 3, h, d)``."""
        return _ring_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                            causal, window_size, alibi_slopes, deterministic, return_attn_probs, group, layout,
                            allowed, **extra)

    convention = ("this rank's cu_seqlens, each document split across the ranks" if default in DOC_LAYOUTS
                  else "GLOBAL cu_seqlens of the packed stream")
    for f, suffix in ((func, ""), (kvpacked, " (kv packed)"), (qkvpacked, " (qkv packed)")):
        f.__doc__ = (f"Varlen ring attention{suffix}, layout {default!r} by default ({convention}); "
                     f"``layout=`` one of {list(allowed)} (Note [ring-flash-attn's varlen conventions] in "
                     f"``seqpar.compat.ring_flash_attn``). " + (f.__doc__ or ""))
    return func, kvpacked, qkvpacked


ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func = \
    _varlen_family("doc_contiguous", ("doc_contiguous", "contiguous"))
zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func, \
    zigzag_ring_flash_attn_varlen_qkvpacked_func = _varlen_family("doc_zigzag", ("doc_zigzag", "zigzag"))
stripe_flash_attn_varlen_func, stripe_flash_attn_varlen_kvpacked_func, stripe_flash_attn_varlen_qkvpacked_func = \
    _varlen_family("stripe", ("stripe",))


# ---- llama3 (Note [llama3 varlen: ring-flash-attn's prepare step]) ----

_PREPARED: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
_PREPARED_KEEP = 16


def _rfa_prepare(cu: tuple[int, ...], causal: bool, rank: int, world: int):
    """ring-flash-attn's per-rank values as host ints: (cu_q, cu_k, max_q, max_k, (k_lo, k_hi))."""
    total = cu[-1]
    if total % world:
        raise ValueError(f"cu_seqlens[-1] (the packed length) must be a multiple of world_size={world} for a "
                         f"contiguous split, got {total} (pad to {-(-total // world) * world}){rank_suffix()}")
    n = total // world
    lo, hi = rank * n, (rank + 1) * n
    left = bisect.bisect_left(cu, lo)
    if cu[left] != lo:
        left -= 1
    right = bisect.bisect_left(cu, hi)
    cu_q = [c - lo for c in cu[left:right + 1]]
    cu_q[0], cu_q[-1] = 0, n
    k_lo = cu[left]
    k_hi = hi if causal else cu[right]
    cu_k = [c - k_lo for c in cu[left:right]] + [k_hi - k_lo]
    max_q = max(b - a for a, b in itertools.pairwise(cu_q))
    max_k = max(b - a for a, b in itertools.pairwise(cu_k))
    return cu_q, cu_k, max_q, max_k, (k_lo, k_hi)


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal: bool, rank: int, world_size: int):
    """ring-flash-attn's llama3 preparation step, its return values exactly (Note [llama3 varlen: ...]).

    Args:
        cu_seqlens: GLOBAL document boundaries of the packed stream, int32 ``(n + 1,)`` (a tensor or a list),
            split contiguously over ``world_size`` ranks; the length must divide by ``world_size``.
        causal: whether the attention will be causal (the keys a segment reads end at its last query).
        rank, world_size: this rank's index in the group and the group size.

    Returns:
        ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)``: this rank's query segments
        and their key segments (tensors of ``cu_seqlens``' dtype and device; int32 on the CPU for a list), the
        longest of each (ints), and ``slice(k_lo, k_hi)`` of the gathered keys. The global boundaries behind
        them are recorded for ``llama3_flash_attn_varlen_func`` in this process.
    """
    return _prepare(cu_seqlens, causal, rank, world_size)


@torch.compiler.disable
def _prepare(cu_seqlens, causal: bool, rank: int, world_size: int):
    """``llama3_flash_attn_prepare_cu_seqlens``'s body, excluded from tracing even when the public function is
    compiled (``torch.compile`` unwraps a disabled function it is given directly)."""
    cu = _host(cu_seqlens, "cu_seqlens")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}{rank_suffix()}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}{rank_suffix()}")
    _check_rising(cu, "cu_seqlens", cu[-1] if cu else 0, "the packed length")
    if cu[-1] == 0:
        raise ValueError(f"cu_seqlens must end at a positive packed length, got {list(cu)}{rank_suffix()}")
    cu_q, cu_k, max_q, max_k, (k_lo, k_hi) = _rfa_prepare(cu, bool(causal), rank, world_size)
    key = (rank, world_size, bool(causal), tuple(cu_q), tuple(cu_k), k_lo, k_hi)
    _PREPARED.pop(key, None)
    _PREPARED[key] = cu
    while len(_PREPARED) > _PREPARED_KEEP:
        _PREPARED.popitem(last=False)
    like = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.empty(0, dtype=torch.int32)
    as_t = {"dtype": like.dtype, "device": like.device}
    return torch.tensor(cu_q, **as_t), torch.tensor(cu_k, **as_t), max_q, max_k, slice(k_lo, k_hi)


def _llama3_cu(cu_seqlens_q, cu_seqlens_k, local_k_slice, causal: bool, layout: str, groups: SeqParallelGroups,
               total_local: int, extra: dict[str, Any]) -> tuple[int, ...]:
    """The global boundaries behind the llama3 arguments: prepare's record for local values, else global ones."""
    cu_q, cu_k = _host(cu_seqlens_q, "cu_seqlens_q"), _host(cu_seqlens_k, "cu_seqlens_k")
    rank, world = groups.index, groups.world
    if world > 1 and cu_q and cu_q[-1] == total_local and extra.get("seq_len") is None:
        if layout != "contiguous":
            raise ValueError(f"ring-flash-attn's per-rank cu_seqlens_q describe the contiguous layout; pass the "
                             f"GLOBAL boundaries with layout={layout!r}, got cu_seqlens_q ending at the local length "
                             f"{total_local}{rank_suffix()}")
        span = (local_k_slice.start, local_k_slice.stop) if isinstance(local_k_slice, slice) else None
        cu = _PREPARED.get((rank, world, bool(causal), cu_q, cu_k, *(span or (None, None))))
        if cu is None:
            raise ValueError(
                f"cu_seqlens_q, cu_seqlens_k and local_k_slice must be what llama3_flash_attn_prepare_cu_seqlens"
                f"(cu_seqlens, causal={bool(causal)}, rank={rank}, world_size={world}) returned in this process "
                f"(seqpar recovers the global documents from that call), got cu_seqlens_q={list(cu_q[:8])}, "
                f"cu_seqlens_k={list(cu_k[:8])}, local_k_slice={local_k_slice}; or pass the GLOBAL boundaries as "
                f"cu_seqlens_q = cu_seqlens_k{rank_suffix()}")
        return cu
    cu = _global_cu(cu_seqlens_q, total_local, world, extra, "cu_seqlens_q")
    if cu_k != cu:
        raise NotImplementedError(f"cu_seqlens_k must equal cu_seqlens_q with global boundaries (self-attention over "
                                  f"the same documents; cross-attention is not supported), got {list(cu_k[:8])} and "
                                  f"{list(cu[:8])}{rank_suffix()}")
    if local_k_slice is not None:
        if layout != "contiguous":
            raise ValueError(f"local_k_slice describes the contiguous layout; pass None with layout={layout!r}, got "
                             f"{local_k_slice}{rank_suffix()}")
        padded = cu if extra.get("seq_len") is None else (*cu, world * total_local)
        *_, (lo, hi) = _rfa_prepare(padded, bool(causal), rank, world)
        if not isinstance(local_k_slice, slice) or (local_k_slice.start, local_k_slice.stop) != (lo, hi):
            raise ValueError(f"local_k_slice must be slice({lo}, {hi}) for this rank's documents (what "
                             f"llama3_flash_attn_prepare_cu_seqlens gives), got {local_k_slice}{rank_suffix()}")
    return cu


def llama3_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q, cu_seqlens_k,
                                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                                  heads_k_stride: int | None = None, local_k_slice: slice | None = None,
                                  dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                                  window_size=(-1, -1), alibi_slopes=None, deterministic: bool = False,
                                  return_attn_probs: bool = False, group=None, *, layout: str = "contiguous",
                                  **extra: Any):
    """All-gather KV ("llama3") varlen attention: ``seqpar.attention(method="allgather")`` on batch 1.

    Args:
        q: ``(total_local, h, d)``; k, v: ``(total_local, h_kv, d)``, rank r's rows ``[r L, (r+1) L)``.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice: what
            ``llama3_flash_attn_prepare_cu_seqlens`` returned for this rank (ring-flash-attn's convention), or
            the GLOBAL boundaries in both ``cu_seqlens`` slots (Note [llama3 varlen: ring-flash-attn's prepare
            step]).
        heads_k_stride: KV heads gathered per round (None = all).
        layout: "contiguous" (ring-flash-attn's), or "zigzag" with global boundaries (balances causal work).

    Returns:
        ``out (total_local, h, d)``, or ``(out, lse (h, total_local) fp32, None)`` with ``return_attn_probs``.
    """
    _check_varlen(q, k, v)
    _check_max("max_seqlen_q", max_seqlen_q)
    _check_max("max_seqlen_k", max_seqlen_k)
    groups = SeqParallelGroups.resolve(group)
    cu = _llama3_cu(cu_seqlens_q, cu_seqlens_k, local_k_slice, causal, layout, groups, q.shape[0], extra)
    return _varlen_run("allgather", layout, q, k, v, cu, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                       deterministic, return_attn_probs, group, heads_k_stride=heads_k_stride, **extra)


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
