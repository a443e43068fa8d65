"""What one rank holds of a packed (varlen) and possibly padded sequence: positions, documents, segments.

Packed training streams concatenate documents; attention never crosses a document boundary (global
``cu_seqlens``), and RoPE restarts at each document's first token. A layout moves tokens between ranks, so
the model needs, per rank and in local row order, each token's global position, its position inside its
document and which local rows form one piece of one document. ``shard_info`` gives exactly that, from the
layout's positions alone (pure index math, no communication). A document layout (``layouts.documents``)
carries its documents, so ``cu_seqlens`` may be left out for it.

Example: 10 tokens, documents ``[0, 3) [3, 10)``, zigzag over W = 2 (4 chunks of 3 after padding to 12)::

    global:  0 1 2 | 3 4 5 | 6 7 8 | 9 p p          (p = padding, positions 10 and 11)
    rank 0 holds chunks 0 and 3:  positions 0 1 2 9 10 11
        positions_in_document     0 1 2 6 0  0        documents  0 0 0 1 -1 -1
        local cu_seqlens          [0, 3, 4, 6]        (doc 0 | doc 1 | padding)
    rank 1 holds chunks 1 and 2:  positions 3 4 5 6 7 8 -> one segment [0, 6) of document 1
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Layout
from .blocks import Run
from .documents import DocumentLayout, _shown

__all__ = ["ShardInfo", "contiguous_gather_segments", "padded_len", "shard_info"]


@dataclass(frozen=True, eq=False)
class ShardInfo:
    """One rank's view of a packed / padded sequence, every tensor in local row order ``(L,)``.

    Attributes:
        positions: int64 global position of each local row (padding rows: positions >= ``seq_len``).
        positions_in_document: int64 position inside the row's document (RoPE for packed data); 0 on padding.
        documents: int64 document index of each row (index into the global ``cu_seqlens``); -1 on padding.
        pad_mask: bool, True on padding rows (exclude them from the loss).
        cu_seqlens: int32 ``(n + 1,)`` local segments: rows ``cu[i]:cu[i+1]`` are one document's consecutive
            tokens (or a run of padding), flash-attn's varlen convention for this rank's rows.
        max_seqlen: the longest local segment (flash-attn's ``max_seqlen`` for ``cu_seqlens``), a host int.
        seq_len: the valid global length (the last document boundary).
        padded_len: the global length of the sharded tensors (``shard(..., pad=True)`` pads to it).
    """

    positions: torch.Tensor
    positions_in_document: torch.Tensor
    documents: torch.Tensor
    pad_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_len: int
    padded_len: int


def padded_len(layout: Layout, seq_len: int) -> int:
    """The smallest length >= ``seq_len`` that ``layout`` splits evenly."""
    return -(-seq_len // layout.divisor) * layout.divisor


def _segments(layout: Layout, rank: int, total: int, bounds: Sequence[int], seq_len: int) -> list[Run]:
    """The rank's runs cut at documents, adjacent runs of one document in global sequence merged."""
    seg = layout.segments(rank, total).cut(bounds, seq_len)
    runs: list[Run] = []
    for r in seg.runs:
        last = runs[-1] if runs else None
        if last is not None and last.doc == r.doc and r.glob == last.glob + seg.stride * last.length:
            runs[-1] = Run(last.local, last.glob, last.length + r.length, last.doc)
        else:
            runs.append(r)
    return runs


def shard_info(layout: Layout, rank: int, seq_len: int, cu_seqlens: Sequence[int] | None = None,
               device: torch.device | str | None = None) -> ShardInfo:
    """Rank ``rank``'s positions, documents and local segments for a sequence of valid length ``seq_len``.

    Args:
        layout: the token layout (a method's placement).
        rank: the piece of the layout this rank holds.
        seq_len: valid global length; the sharded tensors are padded at the end to ``padded_len``.
        cu_seqlens: global document boundaries (0 first, ``seq_len`` last); None = one document, or the
            documents a document layout was built for (given, they must be those).
        device: where the returned tensors live.
    """
    if isinstance(layout, DocumentLayout):
        if cu_seqlens is not None and tuple(int(c) for c in cu_seqlens) != layout.bounds:
            raise ValueError(f"cu_seqlens must be the documents the {layout.name} layout was built for "
                             f"({_shown(layout.bounds)}), got {_shown(tuple(int(c) for c in cu_seqlens))}")
        cu_seqlens = layout.bounds
    bounds = [0, seq_len] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    if seq_len < 1 or bounds[0] != 0 or bounds[-1] != seq_len or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at seq_len={seq_len}, got "
                         f"{bounds[:12]}{' ...' if len(bounds) > 12 else ''}")
    total = padded_len(layout, seq_len)
    runs = _segments(layout, rank, total, bounds, seq_len)
    stride = layout.segments(rank, total).stride
    pos: list[int] = []
    in_doc: list[int] = []
    docs: list[int] = []
    cu = [0]
    for r in runs:
        p = [r.glob + stride * i for i in range(r.length)]
        pos += p
        in_doc += [x - bounds[r.doc] for x in p] if r.doc >= 0 else [0] * r.length
        docs += [r.doc] * r.length
        cu.append(cu[-1] + r.length)
    t = {"dtype": torch.long, "device": device}
    docs_t = torch.tensor(docs, **t)
    return ShardInfo(torch.tensor(pos, **t), torch.tensor(in_doc, **t), docs_t, docs_t < 0,
                     torch.tensor(cu, dtype=torch.int32, device=device), max(r.length for r in runs), seq_len, total)


def contiguous_gather_segments(bounds: Sequence[int], causal: bool, rank: int, world: int
                               ) -> tuple[list[int], list[int], int, int, tuple[int, int]]:
    """Rank ``rank``'s varlen segments against an all-gathered contiguous sequence (ALGORITHMS.md §4.2).

    With documents ``bounds`` (global, 0 first, total last) split contiguously over ``world`` ranks, rank r
    holds rows ``[r L, (r+1) L)``. Returns ``(cu_q, cu_k, max_q, max_k, (k_lo, k_hi))``: the local query
    segments (one per document piece), each segment's keys inside the gathered span ``[k_lo, k_hi)`` (from
    the document's global start to the segment end when causal, to the document end otherwise, so that
    bottom-right alignment is the causal offset), the longest of each, and the span of gathered keys any
    local query reads. Empty documents are skipped.
    """
    total = bounds[-1]
    if total % world:
        raise ValueError(f"the packed length must be a multiple of the world size {world} for a contiguous "
                         f"split, got {total} (pad to {-(-total // world) * world})")
    n = total // world
    lo, hi = rank * n, (rank + 1) * n
    pieces = []                                   # (start, end, doc) of each local document piece
    for d in range(len(bounds) - 1):
        a, b = max(bounds[d], lo), min(bounds[d + 1], hi)
        if a < b:
            pieces.append((a, b, d))
    k_lo = bounds[pieces[0][2]]
    k_hi = hi if causal else bounds[pieces[-1][2] + 1]
    cu_q, cu_k = [0], [0]
    for _, b, d in pieces:
        cu_q.append(b - lo)
        cu_k.append((b if causal else bounds[d + 1]) - k_lo)
    max_q = max(y - x for x, y in itertools.pairwise(cu_q))
    max_k = max(y - x for x, y in itertools.pairwise(cu_k))
    return cu_q, cu_k, max_q, max_k, (k_lo, k_hi)
