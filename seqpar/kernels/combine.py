"""One pass over many partial results of the same rows: their merge (forward) or their sum (backward).

    merge_parts(parts, shape, out_dtype)      parts [(rows, out_BSHD, lse_BHS)] -> (out, lse), one read of each
    sum_parts(parts, shape, out_dtype)        parts [(rows, x_BSHD)] -> sum over parts, fp32 inside

Note [One merge per call]
    A schedule whose steps each produce a partial ``(o_s, lse_s)`` of its query rows used to merge every
    partial into an fp32 accumulator as it arrived (``merge.merge_``): a read and a write of the whole
    accumulator per step, about 30 us per step for 2K rows of 32 heads of 128 on an H100 - at 2K tokens per
    rank as much GPU time as the attention kernels themselves. Here the partials are kept and merged once:

        lse = logsumexp_s(lse_s)          out = sum_s exp(lse_s - lse) o_s     (the max taken first, no overflow)

    reading each partial once and writing the result once, in the output dtype, with the sum in fp32
    registers (one rounding, where the step-by-step merge rounded the fp32 accumulator W times and the
    output once). A row no partial covers is (0, -inf). The same pass without weights sums gradient partials
    (a pass-KV ring's dQ). On CUDA the pass is ONE Triton launch over every local row, whatever the number of
    partials and row ranges: each block of rows reads the spans its block list names (Note [Covered rows])
    through a table of addresses and strides (any layout with a contiguous last dim, as kernels return them).
    Elsewhere (CPU, fp64, no Triton) the same arithmetic in torch, piece by piece: local rows cut at every
    span's bounds, each piece merging the spans that cover it. Held partials cost memory, so ``Accumulator``
    holds at most ``DEFER_BYTES`` of them and folds them into its fp32 accumulator with this same pass when
    more arrive (long chunks, where a merge is cheap next to the attention).

Note [Covered rows]
    A step's small per-document blocks run as one varlen call over the rows from the first block's to the
    last one's (``blocks.group_varlen``); the rows between them are gap segments with no keys, which the
    kernel returns as (0, -inf). Under ``layout="balanced"`` most of a remote step's rows are gaps: at 128K
    tokens over 8 ranks a step's call spans ~14K of a rank's 16K rows and computes ~3K of them. So a partial
    carries its covered ranges (``Task.covered``: the segments with keys) and a merge reads only those
    spans: the (0, -inf) rows weigh nothing, so the result is the same bit for bit (``tests/test_merge.py``).
    The Triton pass takes the spans as CSR block lists, one list per block of ``block_rows`` rows, made once
    per structure of a call's partials (a planned call's partials have the same rows every call; only their
    addresses, in the per-call table, change) and kept pinned on the host (``BLOCKS`` structures; copied per call:
    Note [Graphs under compile] in ``seqpar.runtime.graphs``); a fold's fp32
    accumulator covers the union of what it merged. Measured before this on an H100 (emulated W = 8, packed
    128K, ``benchmarks/gpu/probe_host.py``): a ring's balanced forward launched nine merge kernels in three
    folds, 1.0 ms of its 4.3 ms on the GPU, and 1.7 ms of host time for their tables and launches.

Note [Tables under capture]
    The table of addresses is a pinned host tensor copied to the device without blocking. Captured in a CUDA
    graph, that copy reads the host tensor at every replay, so the tensor must live as long as the graph:
    ``keep_tables(list)`` collects the tables made while a graph is captured (``seqpar.runtime.graphs``); a
    table captured into a graph seqpar does not own (``torch.compile(mode="reduce-overhead")``) is kept for the
    life of the process, since nothing says when that graph goes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence

import torch

from ..numerics import acc_dtype

__all__ = ["Covered", "host_table", "keep_tables", "merge_parts", "pieces", "sum_parts", "union"]

_KEEP: list[list[torch.Tensor]] = []
_FOREIGN: list[torch.Tensor] = []      # tables captured into graphs seqpar does not own (64 bytes per partial)


@contextlib.contextmanager
def keep_tables(into: list[torch.Tensor]) -> Iterator[None]:
    """Keep every address table made inside the block alive in ``into`` (Note [Tables under capture])."""
    _KEEP.append(into)
    try:
        yield
    finally:
        _KEEP.pop()


def host_table(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` (a small host tensor) on ``device`` through pinned memory and a non-blocking copy, legal inside a
    CUDA graph capture: the pinned tensor is kept as long as the graph (Note [Tables under capture])."""
    table = table.pin_memory()
    if _KEEP:
        _KEEP[-1].append(table)
    elif torch.cuda.is_current_stream_capturing():
        _FOREIGN.append(table)               # a caller's capture (reduce-overhead): kept for its graph's life
    return table.to(device, non_blocking=True)


Covered = tuple[tuple[int, int], ...] | None


def pieces(rows: Sequence[slice], length: int,
           covered: Sequence[Covered] | None = None) -> list[tuple[int, int, list[int]]]:
    """``[(start, stop, covering)]``: local rows ``[0, length)`` cut at every part's bounds, each piece with the
    indices of the parts that cover it (parts cover whole pieces by construction). ``covered``: per part, the
    ranges of its rows (relative to its first) that may hold a result, None for all (Note [Covered rows])."""
    spans = _spans(rows, covered)
    cuts = sorted({0, length, *(a for a, _, _ in spans), *(b for _, b, _ in spans)})
    out = []
    for a, b in itertools.pairwise(cuts):
        if a < b:
            out.append((a, b, sorted({i for lo, hi, i in spans if lo <= a and b <= hi})))
    return out


def _spans(rows: Sequence[slice], covered: Sequence[Covered] | None) -> list[tuple[int, int, int]]:
    """``(start, stop, part)`` in local rows: each part's covered ranges (its whole rows when None)."""
    spans = []
    for i, r in enumerate(rows):
        c = None if covered is None else covered[i]
        if c is None:
            spans.append((r.start, r.stop, i))
        else:
            spans.extend((r.start + a, r.start + b, i) for a, b in c if a < b)
    return spans


def union(parts: Sequence, length: int) -> Covered:
    """The covered rows of ``parts`` (``(rows, ..., covered)`` tuples) together, as ranges of ``[0, length)``;
    None when that is every row."""
    out: list[tuple[int, int]] = []
    for a, b, _ in sorted(_spans([p[0] for p in parts], [p[-1] for p in parts])):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif a < b:
            out.append((a, b))
    return None if out == [(0, length)] else tuple(out)


def _split(parts: Sequence, n: int) -> tuple[list, list[Covered]]:
    """Parts as their first ``n`` elements, and each one's optional last element, its covered ranges."""
    return [p[:n] for p in parts], [p[n] if len(p) > n else None for p in parts]


def merge_parts(parts: Sequence, shape: tuple[int, int, int, int], out_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, S, H, Dv) in out_dtype, lse (B, H, S) fp32 / fp64)``: the partials merged (Note [One merge per
    call]). ``parts``: ``(rows, out_BSHD, lse_BHS[, covered])`` with ``out`` and ``lse`` covering exactly ``rows``;
    ``covered`` (Note [Covered rows]) names the ranges that may hold a result, the rest being (0, -inf)."""
    parts, covered = _split(parts, 3)
    B, S, H, _ = shape
    like = parts[0][1]
    acc = acc_dtype(like.dtype if like.dtype == torch.float64 else out_dtype)
    out = torch.empty(shape, dtype=out_dtype, device=like.device)
    lse = torch.empty(B, H, S, dtype=acc, device=like.device)
    if _fused([p[1] for p in parts], acc):
        _triton_table(parts, covered, out, lse, weighted=True)
        return out, lse
    for a, b, idx in pieces([p[0] for p in parts], S, covered):
        o_v, l_v = out[:, a:b], lse[:, :, a:b]
        if not idx:
            o_v.zero_()
            l_v.fill_(float("-inf"))
            continue
        views = [(parts[i][1][:, a - parts[i][0].start:b - parts[i][0].start],
                  parts[i][2][:, :, a - parts[i][0].start:b - parts[i][0].start]) for i in idx]
        _torch_merge(views, o_v, l_v)
    return out, lse


def sum_parts(parts: Sequence, shape: tuple[int, int, int, int], out_dtype: torch.dtype,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``x (B, S, H, D)`` in ``out_dtype``: the sum of ``(rows, x_BSHD[, covered])`` partials, accumulated in fp32
    (fp64 for fp64); rows no part covers are 0. ``out``: write there (any strides, last dim contiguous) instead;
    with ``out``, no parts at all zero it."""
    if not parts and out is not None:
        return out.zero_()
    parts, covered = _split(parts, 2)
    like = parts[0][1]
    acc = acc_dtype(out_dtype if like.dtype != torch.float64 else like.dtype)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=like.device)
    if _fused([p[1] for p in parts], acc):
        _triton_table([(r, x, None) for r, x in parts], covered, out, None, weighted=False)
        return out
    for a, b, idx in pieces([p[0] for p in parts], shape[1], covered):
        o_v = out[:, a:b]
        if not idx:
            o_v.zero_()
            continue
        views = [parts[i][1][:, a - parts[i][0].start:b - parts[i][0].start] for i in idx]
        total = views[0].to(acc, copy=True)
        for x in views[1:]:
            total += x
        o_v.copy_(total)
    return out


def _torch_merge(views: list[tuple[torch.Tensor, torch.Tensor]], out_BSHD: torch.Tensor,
                 lse_BHS: torch.Tensor) -> None:
    """The merge in torch (the Triton kernel's arithmetic): max, weights, one weighted sum."""
    acc = lse_BHS.dtype
    lses = torch.stack([lv.to(acc) for _, lv in views])                       # (n, B, H, r)
    m = lses.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)                                                    # -inf rows: 0
    s = w.sum(0)
    total = torch.zeros(out_BSHD.shape, dtype=acc, device=out_BSHD.device)
    for (o, _), wi in zip(views, w):
        total.addcmul_(o.to(acc), wi.transpose(1, 2).unsqueeze(-1))
    seen = s > 0
    scale = torch.where(seen, 1.0 / torch.where(seen, s, torch.ones_like(s)), torch.zeros_like(s))
    out_BSHD.copy_(total * scale.transpose(1, 2).unsqueeze(-1))
    lse_BHS.copy_(torch.where(seen, m + torch.log(torch.where(seen, s, torch.ones_like(s))),
                              torch.full_like(s, float("-inf"))))


def _fused(xs: list[torch.Tensor], acc: torch.dtype) -> bool:
    """The Triton pass serves: CUDA, fp32 accumulation, partials of fp32 and at most one other dtype, last dim
    contiguous."""
    return (xs[0].is_cuda and acc == torch.float32 and len({x.dtype for x in xs} - {torch.float32}) <= 1
            and all(x.stride(-1) == 1 for x in xs) and _triton() is not None)


@functools.lru_cache(maxsize=1)
def _triton():
    try:
        from . import _combine_triton
    except ImportError:                   # no Triton (a CPU build): the torch pass serves
        return None
    return _combine_triton


BLOCKS = 256
"""Row-block lists kept, pinned on the host (Note [Covered rows]): one per structure of a call's partials."""


def _triton_table(parts: list, covered: list[Covered], out_BSHD: torch.Tensor, lse_BHS: torch.Tensor | None,
                  weighted: bool) -> None:
    """One kernel over every row of ``out_BSHD`` reading the partials that cover each block of rows (Note
    [Covered rows]); ``parts``: ``(rows, x_BSHD, lse_BHS or None)``."""
    S, D = out_BSHD.shape[1], out_BSHD.shape[3]
    if S == 0:
        return
    tri = _triton()
    block_r = tri.block_rows(D)
    spans = tuple(_spans([p[0] for p in parts], covered))
    offs, ents = _block_lists(spans, S, block_r, out_BSHD.device)
    other = next((x.dtype for _, x, _ in parts if x.dtype != torch.float32), torch.float32)
    table = []
    for lo, hi, i in spans:
        r, x, lv = parts[i]
        row = [x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)]
        row += [lv.data_ptr(), lv.stride(0), lv.stride(1), lv.stride(2)] if lv is not None else [0, 0, 0, 0]
        row += [lo, hi, r.start, int(x.dtype != other)]
        table.append(row)
    if not table:
        table = [[0] * tri.TABLE_WIDTH]
    table_d = host_table(torch.tensor(table, dtype=torch.int64), out_BSHD.device)
    tri.launch(table_d, offs, ents, out_BSHD, lse_BHS, other, weighted, block_r)


def _block_lists(spans: tuple[tuple[int, int, int], ...], rows: int, block_r: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets (n_blocks + 1,), entries)`` int32 on ``device``: block j of ``block_r`` rows reads the spans
    ``entries[offsets[j]:offsets[j + 1]]``, in span order (CSR). Built once per structure (a planned call's
    partials have the same rows every call, only their addresses change) and kept on the host, pinned; each call
    copies them without blocking, so no device tensor outlives the call (Note [Graphs under compile] in
    ``seqpar.runtime.graphs``) and a capture keeps its pinned copy source (Note [Tables under capture])."""
    n, both = _pinned_lists(spans, rows, block_r)
    both = host_table(both, device)                  # already pinned: kept and copied, not pinned again
    return both[: n + 1], both[n + 1:]


@functools.lru_cache(maxsize=BLOCKS)
def _pinned_lists(spans: tuple[tuple[int, int, int], ...], rows: int, block_r: int) -> tuple[int, torch.Tensor]:
    n, both = _lists(spans, rows, block_r)
    return n, both.pin_memory()


def _lists(spans: tuple[tuple[int, int, int], ...], rows: int, block_r: int) -> tuple[int, torch.Tensor]:
    n = -(-rows // block_r)
    lists: list[list[int]] = [[] for _ in range(n)]
    for e, (lo, hi, _) in enumerate(spans):
        for j in range(lo // block_r, -(-hi // block_r)):
            lists[j].append(e)
    offs = [0]
    for lst in lists:
        offs.append(offs[-1] + len(lst))
    return n, torch.tensor(offs + ([e for lst in lists for e in lst] or [0]), dtype=torch.int32)
