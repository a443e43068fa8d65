"""Attention work: how many (query, key) pairs a rank's queries see, in closed form.

The work of a rank is the number of visible (query, key) pairs of its queries, wherever the keys live
(over a whole ring pass every key block meets the rank's queries once). A query at global position p of
document ``[a, b)`` sees the keys ``max(a, p + lo) .. min(b - 1, p + hi)`` (``Rule.delta_bounds``; the rule
always keeps the diagonal, so at least one); padding sees nothing. Along a run (positions
``g + stride * i``) both ends are clamped linear functions of i, so a run's total is two arithmetic
series: O(runs log D) per rank, never O(S^2). Causal, no window: a token at offset p of its document
costs p + 1, the quantity ``layouts.documents.Balanced`` balances.

``block_work(q, k, rule)`` counts the pairs of one block (one ring step) from the planner's tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Layout
from .blocks import Rule, Run, Segments, Task, plan
from .documents import DocumentLayout

__all__ = ["block_work", "task_pairs", "work"]


def _sum_min(first: int, step: int, count: int, cap: int) -> int:
    """``sum(min(first + step * i, cap) for i in range(count))`` for ``step > 0``, in O(1)."""
    n = min(count, max(0, (cap - first) // step + 1))                # terms that stay at most cap
    return n * first + step * n * (n - 1) // 2 + (count - n) * cap


def _sum_max(first: int, step: int, count: int, floor: int) -> int:
    """``sum(max(first + step * i, floor) for i in range(count))`` for ``step > 0``, in O(1)."""
    n = min(count, max(0, -((first - floor) // step)))              # terms below floor (a ceiling division)
    m = count - n
    return n * floor + m * (first + step * n) + step * m * (m - 1) // 2


def _run_pairs(run: Run, stride: int, bounds: Sequence[int], lo: int | None, hi: int | None) -> int:
    """Visible keys of every query of ``run`` (a run cut at documents, ``run.doc`` indexing ``bounds``)."""
    if run.doc < 0:
        return 0
    a, b, m = bounds[run.doc], bounds[run.doc + 1], run.length
    top = m * (b - 1) if hi is None else _sum_min(run.glob + hi, stride, m, b - 1)
    bottom = m * a if lo is None else _sum_max(run.glob + lo, stride, m, a)
    return top - bottom + m


def work(layout: Layout, seq_len: int, rule: Rule, cu_seqlens: Sequence[int] | None = None) -> list[int]:
    """Visible (query, key) pairs of every rank's queries, ``[rank 0, ..., rank W-1]``.

    Args:
        layout: the placement.
        seq_len: the sharded global length; positions at or past the documents' end are padding.
        rule: causal, window and mask (with a mask: the planned blocks' pairs, an upper bound for a generic
            ``mask_mod``, O(W^2) plans).
        cu_seqlens: global document boundaries (0 first, the valid length last); None = a document
            layout's own, else one document of ``seq_len``.
    """
    if cu_seqlens is not None:
        bounds: Sequence[int] = tuple(int(c) for c in cu_seqlens)
    else:
        bounds = layout.bounds if isinstance(layout, DocumentLayout) else (0, seq_len)
    if rule.mask is not None:          # a mask: count the planned blocks against every rank's keys
        segs = [layout.segments(r, seq_len).cut(bounds) for r in range(layout.world)]
        return [sum(block_work(s, k, rule) for k in segs) for s in segs]
    lo, hi = rule.delta_bounds()
    out = []
    for rank in range(layout.world):
        seg = layout.segments(rank, seq_len).cut(bounds)
        out.append(sum(_run_pairs(r, seg.stride, bounds, lo, hi) for r in seg.runs))
    return out


def task_pairs(t: Task) -> int:
    """Cells of a planned call's band (every row of a trimmed call sees at least one key)."""
    band = getattr(t.mask, "base", t.mask)       # a mask_mod block counts its band: an upper bound
    lo, hi = band.lo, band.hi  # type: ignore[union-attr]   (plan returns Band and Modded tasks)
    top = t.rows * (t.cols - 1) if hi is None else _sum_min(hi, 1, t.rows, t.cols - 1)
    bottom = 0 if lo is None else _sum_max(lo, 1, t.rows, 0)
    return top - bottom + t.rows


def block_work(q: Segments, k: Segments, rule: Rule) -> int:
    """Visible (query, key) pairs of queries ``q`` against keys ``k`` (cut at documents), e.g. one ring step."""
    return sum(task_pairs(t) for t in plan(q, k, rule))
