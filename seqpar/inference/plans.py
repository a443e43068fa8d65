"""Kernel calls for queries at known positions against one rank's cached slice (host-side, cached).

Everything here is the block planner (Note [Block planning] in ``seqpar.layouts.blocks``) applied to the
cache's positions: queries as ``Segments`` (a chunk's rows in its layout, or the replicated decode rows),
keys as the slice's segment groups (Note [Pieces and segments] in ``rows``). The rule is causal with the
layer's left window; a batch row that starts late (left padding, ``start > 0``) makes positions before its
start one more document, so its real tokens never see the padding (``Segments.cut``).

``Pairs`` holds, for every (query owner i, slice owner j), the tasks of every row group: pass-KV runs
``tasks[me][j]`` as slice j visits, pass-Q runs ``tasks[i][me]`` as owner i's queries visit. Every rank
computes the same ``Pairs``, so every rank agrees on which transfers carry nothing and on how many steps a pass
needs. Decode needs only its own slice's tasks (``ShardedKVCache.decode_tasks``: the queries are the same
everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import rank_suffix
from ..layouts.blocks import Rule, Run, Segments, Task, plan

__all__ = ["Pairs", "RowGroup", "check_window", "pair_tasks", "plan_pairs"]


@dataclass(frozen=True)
class RowGroup:
    """Batch rows that start at cache position ``start`` (``rows`` None = the whole batch)."""

    start: int
    rows: tuple[int, ...] | None

    def bounds(self, end: int, chunk: int | None = None) -> tuple[int, ...]:
        """Document bounds up to ``end``: padding ``[0, start)`` and the text ``[start, end)`` (one document
        when the row has no padding, or nothing but padding, before ``end``); with ``chunk`` (Llama 4's chunked
        layers) the text is cut every ``chunk`` positions from the row's first real token as well, as transformers
        cuts it (``chunked_overlay``): causal attention within each piece is chunked attention."""
        cuts = {0, end, *((self.start,) if 0 < self.start < end else ())}
        if chunk is not None:
            cuts.update(range(self.start + chunk, end, chunk))
        return tuple(sorted(cuts))


@dataclass(frozen=True)
class Pairs:
    """``tasks[i][j][g]``: query owner i against slice owner j for row group g; ``n_steps`` of a ring pass."""

    tasks: tuple[tuple[tuple[tuple[Task, ...], ...], ...], ...]
    n_steps: int

    def busy(self, i: int, j: int) -> bool:
        return any(self.tasks[i][j])


def _restride(seg: Segments, stride: int) -> Segments | None:
    """``seg`` with ``stride`` if its runs allow it (one-row runs take any stride), else None."""
    if seg.stride == stride:
        return seg
    if all(r.length == 1 for r in seg.runs):
        return Segments(seg.runs, stride)
    return None


def _shift(tasks: Sequence[Task], dq: int, dk: int) -> list[Task]:
    return [Task(t.q_start + dq, t.q_stop + dq, t.k_start + dk, t.k_stop + dk, t.mask) for t in tasks]


def pair_tasks(q: Segments, groups: Sequence[tuple[int, Segments]], rule: Rule,
               bounds: tuple[int, ...]) -> tuple[Task, ...]:
    """Queries ``q`` against a slice given as segment groups ``(row offset, Segments)``; key rows of the
    returned tasks are rows of the slice. Groups whose stride differs from the queries' are planned with
    one-row runs on whichever side allows it (Note [Pieces and segments])."""
    qc = q.cut(bounds)
    tasks: list[Task] = []
    for offset, seg in groups:
        kc = seg.cut(bounds)
        q_same, k_same = _restride(qc, kc.stride), _restride(kc, qc.stride)
        if q_same is not None:
            tasks += _shift(plan(q_same, kc, rule), 0, offset)
        elif k_same is not None:
            tasks += _shift(plan(qc, k_same, rule), 0, offset)
        else:                                   # both sides have longer runs: the keys as one-row runs
            rows = tuple(Run(r.local + i, r.glob + kc.stride * i, 1, r.doc) for r in kc.runs for i in range(r.length))
            tasks += _shift(plan(qc, Segments(rows, qc.stride), rule), 0, offset)
    return _coalesce(tasks)


def _coalesce(tasks: list[Task]) -> tuple[Task, ...]:
    """Join full-mask tasks over the same query rows whose key rows touch (one call instead of several)."""
    out: list[Task] = []
    for t in sorted(tasks, key=lambda t: (t.q_start, t.q_stop, t.k_start)):
        last = out[-1] if out else None
        if (last is not None and (last.q_start, last.q_stop) == (t.q_start, t.q_stop) and last.k_stop == t.k_start
                and last.mask.is_full and t.mask.is_full):
            out[-1] = Task(last.q_start, last.q_stop, last.k_start, t.k_stop, last.mask)
        else:
            out.append(t)
    return tuple(out)


def plan_pairs(queries: Sequence[Segments], slices: Sequence[Sequence[tuple[int, Segments]]], rule: Rule,
               groups: Sequence[RowGroup], end: int, chunk: int | None = None) -> Pairs:
    """Tasks of every (query owner, slice owner) pair and row group, and the steps a ring pass needs."""
    W = len(slices)
    tasks = tuple(tuple(tuple(pair_tasks(q, slices[j], rule, g.bounds(end, chunk)) for g in groups)
                        for j in range(W)) for q in queries)
    busy = [((i - j) % W) for i in range(len(queries)) for j in range(W) if any(tasks[i][j])]
    return Pairs(tasks, 1 + max(busy, default=0))


def check_window(window_size: tuple[int, int]) -> int:
    """The left window of a causal ``window_size`` (-1 = none)."""
    w = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    if (not isinstance(w, tuple) or len(w) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in w)
            or w[0] < -1 or w[1] not in (-1, 0)):
        raise ValueError(f"window_size must be (left, 0) with left >= -1 (causal attention over a cache), got "
                         f"{window_size!r}{rank_suffix()}")
    return w[0]
