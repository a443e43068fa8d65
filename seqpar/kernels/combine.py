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
    output once). Local rows are cut at every partial's first and last row into pieces; each piece is one
    call over the partials that cover it (a zigzag ring's rank: two pieces). A row no partial covers is
    (0, -inf). The same pass without weights sums gradient partials (a pass-KV ring's dQ). On CUDA the pass is
    one Triton kernel per piece reading the partials through a table of addresses and strides (any layout
    with a contiguous last dim, as kernels return them); elsewhere (CPU, fp64, no Triton) the same
    arithmetic in torch. Held partials cost memory, so ``Accumulator`` holds at most ``DEFER_BYTES`` of them
    and folds them into its fp32 accumulator with this same pass when more arrive (long chunks, where a
    merge is cheap next to the attention).

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

__all__ = ["host_table", "keep_tables", "merge_parts", "pieces", "sum_parts"]

Part = tuple[slice, torch.Tensor, torch.Tensor]

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


def pieces(rows: Sequence[slice], length: int) -> list[tuple[int, int, list[int]]]:
    """``[(start, stop, covering)]``: local rows ``[0, length)`` cut at every part's bounds, each piece with the
    indices of the parts that cover it (parts cover whole pieces by construction)."""
    cuts = sorted({0, length, *(r.start for r in rows), *(r.stop for r in rows)})
    out = []
    for a, b in itertools.pairwise(cuts):
        if a < b:
            out.append((a, b, [i for i, r in enumerate(rows) if r.start <= a and b <= r.stop]))
    return out


def merge_parts(parts: Sequence[Part], shape: tuple[int, int, int, int], out_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, S, H, Dv) in out_dtype, lse (B, H, S) fp32 / fp64)``: the partials merged (Note [One merge per
    call]). ``parts``: ``(rows, out_BSHD, lse_BHS)`` with ``out`` and ``lse`` covering exactly ``rows``."""
    B, S, H, _ = shape
    like = parts[0][1]
    acc = acc_dtype(like.dtype if like.dtype == torch.float64 else out_dtype)
    out = torch.empty(shape, dtype=out_dtype, device=like.device)
    lse = torch.empty(B, H, S, dtype=acc, device=like.device)
    for a, b, idx in pieces([p[0] for p in parts], S):
        o_v, l_v = out[:, a:b], lse[:, :, a:b]
        if not idx:
            o_v.zero_()
            l_v.fill_(float("-inf"))
            continue
        views = [(parts[i][1][:, a - parts[i][0].start:b - parts[i][0].start],
                  parts[i][2][:, :, a - parts[i][0].start:b - parts[i][0].start]) for i in idx]
        if _fused([x for x, _ in views], acc):
            _triton_pass(views, o_v, l_v, weighted=True)
        else:
            _torch_merge(views, o_v, l_v)
    return out, lse


def sum_parts(parts: Sequence[tuple[slice, torch.Tensor]], shape: tuple[int, int, int, int],
              out_dtype: torch.dtype) -> torch.Tensor:
    """``x (B, S, H, D)`` in ``out_dtype``: the sum of ``(rows, x_BSHD)`` partials, accumulated in fp32 (fp64 for
    fp64); rows no part covers are 0."""
    like = parts[0][1]
    acc = acc_dtype(out_dtype if like.dtype != torch.float64 else like.dtype)
    out = torch.empty(shape, dtype=out_dtype, device=like.device)
    for a, b, idx in pieces([p[0] for p in parts], shape[1]):
        o_v = out[:, a:b]
        if not idx:
            o_v.zero_()
            continue
        views = [parts[i][1][:, a - parts[i][0].start:b - parts[i][0].start] for i in idx]
        if len(views) > 1 and _fused(views, acc):
            _triton_pass([(x, None) for x in views], o_v, None, weighted=False)
        else:
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


def _fused(views: list[torch.Tensor], acc: torch.dtype) -> bool:
    """The Triton pass serves: CUDA, fp32 accumulation, partials after the first of one dtype, last dim
    contiguous."""
    return (views[0].is_cuda and acc == torch.float32 and len({x.dtype for x in views[1:]}) <= 1
            and all(x.stride(-1) == 1 for x in views) and _triton() is not None)


@functools.lru_cache(maxsize=1)
def _triton():
    try:
        from . import _combine_triton
    except ImportError:                   # no Triton (a CPU build): the torch pass serves
        return None
    return _combine_triton


def _triton_pass(views: list[tuple[torch.Tensor, torch.Tensor | None]], out_BSHD: torch.Tensor,
                 lse_BHS: torch.Tensor | None, weighted: bool) -> None:
    """One kernel over ``views`` (each ``(x_BSHD, lse_BHS or None)`` of the piece's rows) into the piece."""
    if out_BSHD.shape[1] == 0:
        return
    rows = []
    for x, lv in views:
        row = [x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)]
        row += [lv.data_ptr(), lv.stride(0), lv.stride(1), lv.stride(2)] if lv is not None else [0, 0, 0, 0]
        rows.append(row)
    table_d = host_table(torch.tensor(rows, dtype=torch.int64), out_BSHD.device)
    dtypes = (views[0][0].dtype, views[-1][0].dtype)
    _triton().launch(table_d, len(views), out_BSHD, lse_BHS, dtypes, weighted)
