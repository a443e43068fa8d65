"""The block planner: which query rows see which key rows, as few kernel calls as possible.

Every method asks the same question at every step: "my queries (these global positions) against that key
block (those global positions), under this rule (causal, window, documents, padding): what must I compute?"
The answer is a tuple of ``Task``s, each one kernel call ``(q rows, k rows, mask)`` with the mask in the
call's own coordinates (``seqpar.masks``). Blocks that see nothing are skipped, never computed and masked.

Positions come as ``Segments``: runs of local rows whose global positions advance by a common ``stride``
(1 for contiguous and zigzag layouts, W for stripe). Documents cut runs, so a run never spans two
documents; padding is document -1, which sees nothing and is seen by nothing.

Note [Block planning]
    1. For every (query run, key run) pair, the visible set is a band ``lo <= j - i <= hi`` in run-local
       coordinates (same document only): positions are affine in the local index with the same stride,
       and every rule (causal, window) bounds ``key_pos - query_pos``. Only same-document pairs are
       evaluated (key runs are bucketed by document), so the empty pairs of different documents cost nothing.
    2. Try to cover all non-empty pairs with ONE call: the bounding rows x columns with a single band,
       verified against every pair inside, empty ones included. The band meets an interval of key runs on
       each query run (key runs are consecutive), found by bisection; the call is exact iff that interval
       holds exactly the run's non-empty pairs, each clipped to its own band, so the empty pairs inside are
       proven empty without visiting them. Zigzag's diagonal step (front and back chunks, both in global
       order) and its off-diagonal steps each become one call this way.
    3. Otherwise one call per query run, its key runs grouped greedily left to right by the same test (on one
       query run the test holds incrementally, so ``_longest`` finds each group's end in one pass over its key
       runs).
    4. Trim each call to the bounding box of what it shows. A trimmed band always has
       ``lo <= n - m <= hi`` (n key rows, m query rows), so it is a flash-attn bottom-right window, and a
       band with ``lo`` unbounded is "full" plus a top-left causal square that cuDNN serves.
    Rows of a call that see nothing are trimmed away; rows no call covers keep (out, lse) = (0, -inf).
    5. A named mask (``Rule.mask``, Note [Masks as pieces] in ``seqpar.masks.named``) first cuts the runs at
       its piece boundaries; a pair's band is then the rule's bounds intersected with the mask's relation of
       the two pieces, and pairs it relates by nothing are empty like different documents. A generic
       ``mask_mod`` is applied after steps 1-4, block by block (Note [Generic mask_mod] in ``seqpar.masks.mod``).
    6. Under a named mask, a staircase (a frame or an image seeing everything before its end) is one call per
       piece, but its part below the diagonal (``key <= query``) is often one causal call and its part above it
       a few small blocks that pack into one varlen call. So the planner also plans the two halves apart and
       keeps whichever gives fewer calls once grouped (``group_varlen``), after joining full calls over the
       same keys on adjacent rows (a shared prompt seen by every response: one call). Halves overlap in no
       cell; rows seen by both merge by lse like any two blocks.
    Cost: O(K + (Q + P) log K) for Q query runs, K key runs and P same-document pairs (step 3 visits each key run
    of a query run once; testing each growing group with ``merged`` was g^2 for g key runs - 34 s for one rank's
    plan under a block-causal mask of 1024 frames at 1M - and g log g by galloping, 1.0 s; one pass, 0.33 s). With a
    bounded number of runs per document on each side that is O(runs log runs); the full (query run x key run)
    matrix was quadratic in the documents.
    ``tests/test_blocks.py`` checks all of this against a dense mask for random layouts and rules, and
    counts band evaluations to pin the cost.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..masks.forms import Band, Modded, Varlen, bottom_right_window, fa2_exact

if TYPE_CHECKING:
    from ..masks.mod import ModMask
    from ..masks.named import PieceMask

__all__ = ["Rule", "Run", "Segments", "Task", "any_visible", "group_varlen", "plan", "slice_rows", "union_spans",
           "visible_dense"]


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


@dataclass(frozen=True)
class Run:
    """``length`` local rows from ``local``; global positions ``glob + stride * i``; document ``doc``; the piece
    of a named mask ``piece`` (Note [Block planning] step 5)."""

    local: int
    glob: int
    length: int
    doc: int = 0
    piece: int = 0

    @property
    def end(self) -> int:
        return self.local + self.length


@dataclass(frozen=True)
class Segments:
    """A rank's rows (or a gathered buffer's) as consecutive runs sharing one global ``stride``."""

    runs: tuple[Run, ...]
    stride: int = 1

    def __post_init__(self) -> None:
        at = self.runs[0].local if self.runs else 0
        for r in self.runs:
            if r.local != at or r.length <= 0:
                raise ValueError(f"runs must be consecutive and non-empty, got {self.runs}")
            at = r.end

    @property
    def length(self) -> int:
        return sum(r.length for r in self.runs)

    def positions(self) -> list[int]:
        """Global position of every row, in local order (for tests and RoPE)."""
        return [r.glob + self.stride * i for r in self.runs for i in range(r.length)]

    def shifted(self, offset: int) -> Segments:
        """The same runs placed ``offset`` rows later (a block inside a larger buffer)."""
        return Segments(tuple(Run(r.local + offset, r.glob, r.length, r.doc) for r in self.runs), self.stride)

    @staticmethod
    def concat(parts: Sequence[Segments]) -> Segments:
        """Buffers laid end to end (e.g. an all-gather in rank order)."""
        runs, at = [], 0
        for p in parts:
            if p.stride != parts[0].stride:
                raise ValueError("segments to concatenate must share a stride")
            runs.extend(Run(r.local - (p.runs[0].local if p.runs else 0) + at, r.glob, r.length, r.doc)
                        for r in p.runs)
            at += p.length
        return Segments(tuple(runs), parts[0].stride if parts else 1)

    def cut(self, doc_bounds: Sequence[int] | None = None, valid_len: int | None = None) -> Segments:
        """Split runs at document boundaries (global ``cu_seqlens``) and mark positions past the end as pad.

        Document d covers global positions ``doc_bounds[d]:doc_bounds[d+1]``; positions at or past the last
        bound (or ``valid_len`` when there are no documents) are padding, doc -1. One bisection per run piece
        out, so O(pieces log D) for D documents (a list or tuple of bounds is read in place, not copied).
        """
        if doc_bounds is None and valid_len is None:
            return self
        if doc_bounds is None:
            bounds: Sequence[int] = (0, valid_len)
        else:
            bounds = doc_bounds if isinstance(doc_bounds, (list, tuple)) else tuple(doc_bounds)
        if valid_len is not None and bounds[-1] != valid_len:
            raise ValueError(f"documents must end at the valid length {valid_len}, got {bounds[-1]}")
        out: list[Run] = []
        s = self.stride
        for r in self.runs:
            a = 0
            while a < r.length:
                pos = r.glob + s * a
                if pos >= bounds[-1]:
                    doc, nxt = -1, r.length                  # positions only grow along a run
                else:
                    doc = bisect.bisect_right(bounds, pos) - 1
                    nxt = min(r.length, _ceil_div(bounds[doc + 1] - r.glob, s))
                out.append(Run(r.local + a, pos, nxt - a, doc))
                a = nxt
        return Segments(tuple(out), s)


@dataclass(frozen=True)
class Rule:
    """Global visibility: causal (key pos <= query pos), a flash-attn window ``(left, right)`` (-1 = none) and a
    mask (``seqpar.masks``: a named mask or a ``ModMask``), all of which must allow a key.

    With ``causal`` the right window is 0 whatever is given (flash-attn's convention).
    """

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    mask: PieceMask | ModMask | None = None

    @property
    def pieces(self) -> PieceMask | None:
        """The named mask, if the mask is one (declared structure, step 5)."""
        from ..masks.named import PieceMask

        return self.mask if isinstance(self.mask, PieceMask) else None

    def delta_bounds(self) -> tuple[int | None, int | None]:
        """Bounds on ``key_pos - query_pos`` (None = unbounded)."""
        left, right = self.window
        lo = None if left < 0 else -left
        hi = 0 if self.causal else (None if right < 0 else right)
        return lo, hi


@dataclass(frozen=True)
class Task:
    """One kernel call: query rows ``q_start:q_stop`` against key rows ``k_start:k_stop`` under ``mask``."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    mask: Band | Varlen | Modded

    @property
    def q(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def k(self) -> slice:
        return slice(self.k_start, self.k_stop)

    @property
    def rows(self) -> int:
        return self.q_stop - self.q_start

    @property
    def cols(self) -> int:
        return self.k_stop - self.k_start

    @functools.cached_property
    def covered(self) -> tuple[tuple[int, int], ...] | None:
        """The row ranges (relative to ``q_start``) of a varlen call whose segments have keys, or None when every
        row may: a grouped call's gap segments (rows between its tasks, no keys) give (0, -inf) rows that a
        merge may skip (Note [Covered rows] in ``seqpar.kernels.combine``)."""
        if not isinstance(self.mask, Varlen):
            return None
        cu_q, cu_k, out = self.mask.cu_q, self.mask.cu_k, []
        for i in range(len(cu_q) - 1):
            if cu_q[i + 1] > cu_q[i] and cu_k[i + 1] > cu_k[i]:
                if out and out[-1][1] == cu_q[i]:
                    out[-1] = (out[-1][0], cu_q[i + 1])
                else:
                    out.append((cu_q[i], cu_q[i + 1]))
        return None if out == [(0, self.rows)] else tuple(out)


_Eff = tuple[int, int] | None   # an effective (clipped) band on a block, or None when it shows nothing


def _clip(lo: int | None, hi: int | None, m: int, n: int) -> _Eff:
    lo_e = -(m - 1) if lo is None else max(lo, -(m - 1))
    hi_e = n - 1 if hi is None else min(hi, n - 1)
    return None if lo_e > hi_e else (lo_e, hi_e)


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _min(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def split_pieces(seg: Segments, mask: PieceMask | None) -> Segments:
    """``seg`` with every run cut at the piece boundaries of ``mask`` and labelled with its piece."""
    if mask is None:
        return seg
    out: list[Run] = []
    s = seg.stride
    for r in seg.runs:
        i = 0
        while i < r.length:
            pos = r.glob + s * i
            n = min(r.length - i, _ceil_div(mask.piece_end(pos) - pos, s))
            out.append(Run(r.local + i, pos, n, r.doc, mask.piece(pos)))
            i += n
    return Segments(tuple(out), s)


def _pair_band(qr: Run, kr: Run, stride: int, lo_g: int | None, hi_g: int | None,
               mask: PieceMask | None = None) -> _Eff:
    if qr.doc != kr.doc or qr.doc < 0:
        return None
    if mask is not None:
        rel = mask.relation(qr.piece, kr.piece)
        if rel is None:
            return None
        lo_g, hi_g = _max(lo_g, rel[0]), _min(hi_g, rel[1])
    d0 = kr.glob - qr.glob                      # key_pos - query_pos = d0 + stride * (j - i)
    lo = None if lo_g is None else _ceil_div(lo_g - d0, stride)
    hi = None if hi_g is None else (hi_g - d0) // stride
    return _clip(lo, hi, qr.length, kr.length)


class _Grid:
    """The non-empty bands of the (query run x key run) matrix, found document by document.

    Pairs of different documents, or with padding, show nothing, so only same-document pairs are
    evaluated: with a bounded number of runs per document on each side this is linear in the runs
    (Note [Block planning] step 1), where the full matrix is quadratic in the documents.
    """

    def __init__(self, q: Segments, k: Segments, rule: Rule, cap: tuple[int | None, int | None] = (None, None)):
        if q.stride != k.stride:
            raise ValueError(f"query and key segments must share a stride, got {q.stride} and {k.stride}")
        lo_g, hi_g = rule.delta_bounds()
        lo_g, hi_g = _max(lo_g, cap[0]), _min(hi_g, cap[1])
        pieces = rule.pieces
        self.q, self.k = q.runs, k.runs
        self.k_start = [r.local for r in k.runs]
        self.k_end = [r.end for r in k.runs]
        by_doc = _buckets(k, pieces)
        #: per query run, its non-empty ``(key run, band)`` pairs in key order
        self.rows: list[list[tuple[int, tuple[int, int]]]] = [
            [(j, b) for j in by_doc.get(_bucket(qr, pieces), ())
             if (b := _pair_band(qr, k.runs[j], q.stride, lo_g, hi_g, pieces))]
            for qr in q.runs]
        self.row_keys = [[j for j, _ in row] for row in self.rows]

    def merged(self, i0: int, i1: int, j0: int, j1: int) -> tuple[int, int] | None:
        """The single call band covering runs i0..i1 x j0..j1 exactly, or None if there is none.

        The candidate spans the non-empty pairs' bands. It is exact iff, on every query run, the key runs
        whose block it meets are exactly that run's non-empty pairs, each clipped to its own band. Key runs
        are consecutive, so the runs a band meets are an interval, found by bisection: the empty pairs
        between are never visited (Note [Block planning] step 2).
        """
        q0, k0 = self.q[i0].local, self.k[j0].local
        spans = []
        for i in range(i0, i1 + 1):
            a, b = bisect.bisect_left(self.row_keys[i], j0), bisect.bisect_right(self.row_keys[i], j1)
            spans.append((a, b))
        cands = [(band[0] + s, band[1] + s) for i, (a, b) in zip(range(i0, i1 + 1), spans)
                 for j, band in self.rows[i][a:b] for s in [(self.k[j].local - k0) - (self.q[i].local - q0)]]
        if not cands:
            return None
        lo, hi = min(c[0] for c in cands), max(c[1] for c in cands)
        for i, (a, b) in zip(range(i0, i1 + 1), spans):
            x, m = self.q[i].local - q0, self.q[i].length
            ja = max(j0, bisect.bisect_left(self.k_end, lo + x + k0 + 1))      # first key run the band meets
            jb = min(j1, bisect.bisect_right(self.k_start, hi + x + m - 1 + k0) - 1)   # and the last
            pairs = self.rows[i][a:b]
            if len(pairs) != max(0, jb - ja + 1) or (pairs and (pairs[0][0], pairs[-1][0]) != (ja, jb)):
                return None
            for j, band in pairs:
                s = (self.k[j].local - k0) - x
                if _clip(lo - s, hi - s, m, self.k[j].length) != band:
                    return None
        return lo, hi

    def task(self, i0: int, i1: int, j0: int, j1: int, band: tuple[int, int]) -> Task:
        """Trim the call to the bounding box of what it shows and canonicalise its band."""
        q0, k0 = self.q[i0].local, self.k[j0].local
        m, n = self.q[i1].end - q0, self.k[j1].end - k0
        lo, hi = band
        r0, r1 = max(0, -hi), min(m - 1, n - 1 - lo)
        c0, c1 = max(0, lo), min(n - 1, m - 1 + hi)
        lo, hi = lo + r0 - c0, hi + r0 - c0
        m, n = r1 - r0 + 1, c1 - c0 + 1
        mask = Band(None if lo <= -(m - 1) else lo, None if hi >= n - 1 else hi)
        return Task(q0 + r0, q0 + r1 + 1, k0 + c0, k0 + c1 + 1, mask)


def _bucket(r: Run, pieces: PieceMask | None) -> tuple[int, int]:
    return (r.doc, r.piece if pieces is not None and pieces.same_piece_only else 0)


def _buckets(k: Segments, pieces: PieceMask | None) -> dict[tuple[int, int], list[int]]:
    """Key runs by document (and piece, for masks relating only a piece to itself): the only candidates."""
    out: dict[tuple[int, int], list[int]] = {}
    for j, kr in enumerate(k.runs):
        if kr.doc >= 0:
            out.setdefault(_bucket(kr, pieces), []).append(j)
    return out


def any_visible(q: Segments, k: Segments, rule: Rule) -> bool:
    """Whether some query of ``q`` may see some key of ``k``: ``bool(plan(q, k, rule))`` without planning (a
    ring's step count asks it of every rank pair; O(runs)). A generic ``mask_mod`` is not evaluated here, so
    for one this may say True of a pair that plans to nothing (never the reverse)."""
    lo_g, hi_g = rule.delta_bounds()
    pieces = rule.pieces
    q, k = split_pieces(q, pieces), split_pieces(k, pieces)
    by_doc = _buckets(k, pieces)
    return any(_pair_band(qr, k.runs[j], q.stride, lo_g, hi_g, pieces)
               for qr in q.runs for j in by_doc.get(_bucket(qr, pieces), ()))


def plan(q: Segments, k: Segments, rule: Rule, *, fewest_calls: bool = True) -> tuple[Task, ...]:
    """The kernel calls that compute queries ``q`` against keys ``k`` under ``rule`` (Note [Block planning]).
    ``fewest_calls=False`` skips step 6 - the same cells in possibly more calls, a third of the host time - for a
    caller that reads only which rows, keys and pairs are visible (the cost model, the all-gather's reads)."""
    from ..masks.mod import ModMask

    pieces = rule.pieces
    qs, ks = split_pieces(q, pieces), split_pieces(k, pieces)
    tasks = _plan(qs, ks, rule)
    if fewest_calls and pieces is not None and len(tasks) > 2:   # step 6: the fewer calls of the whole and halves
        halves = _plan(qs, ks, rule, (None, 0)) + _plan(qs, ks, rule, (1, None))
        tasks = min(_coalesce_full(tasks), _coalesce_full(halves), key=lambda ts: len(group_varlen(ts)))
    if isinstance(rule.mask, ModMask):
        tasks = _apply_mod(tasks, q, k, rule.mask)
    return tasks


def _coalesce_full(tasks: tuple[Task, ...]) -> tuple[Task, ...]:
    """Full tasks over the same keys on adjacent query rows joined into one (step 6)."""
    out: list[Task] = []
    for t in sorted(tasks, key=lambda t: (not (isinstance(t.mask, Band) and t.mask.is_full), t.k_start, t.k_stop,
                                          t.q_start)):
        last = out[-1] if out else None
        if (last is not None and isinstance(t.mask, Band) and t.mask.is_full and isinstance(last.mask, Band)
                and last.mask.is_full and (last.k_start, last.k_stop) == (t.k_start, t.k_stop)
                and last.q_stop == t.q_start):
            out[-1] = Task(last.q_start, t.q_stop, t.k_start, t.k_stop, t.mask)
        else:
            out.append(t)
    return tuple(sorted(out, key=lambda t: (t.q_start, t.k_start)))


def _apply_mod(tasks: tuple[Task, ...], q: Segments, k: Segments, mask: ModMask) -> tuple[Task, ...]:
    """Each block of ``tasks`` dropped, kept, or made ``Modded`` by a generic mask (Note [Generic mask_mod])."""
    from ..masks.mod import classify

    out = []
    for t in tasks:
        assert isinstance(t.mask, Band)
        qr = tuple((r.glob, r.length) for r in slice_rows(q, t.q_start, t.q_stop).runs)
        kr = tuple((r.glob, r.length) for r in slice_rows(k, t.k_start, t.k_stop).runs)
        form = Modded(t.mask, mask.fn, qr, kr, q.stride, mask.stamp)
        qp, kp = form.positions()
        kind = classify(mask.fn, t.mask.lo, t.mask.hi, qp, kp, mask.device)
        if kind == "all":
            out.append(t)
        elif kind == "some":
            out.append(replace(t, mask=form))
    return tuple(out)


def _plan(q: Segments, k: Segments, rule: Rule, cap: tuple[int | None, int | None] = (None, None)
          ) -> tuple[Task, ...]:
    g = _Grid(q, k, rule, cap)
    rows = [i for i, row in enumerate(g.rows) if row]
    if not rows:
        return ()
    j0, j1 = min(g.row_keys[i][0] for i in rows), max(g.row_keys[i][-1] for i in rows)
    whole = g.merged(rows[0], rows[-1], j0, j1)
    if whole is not None:
        return (g.task(rows[0], rows[-1], j0, j1, whole),)
    tasks = []
    for i in rows:
        mine = g.row_keys[i]
        start = 0
        while start < len(mine):
            end = _longest(g, i, mine, start)
            band = g.merged(i, i, mine[start], mine[end])
            assert band is not None  # a single non-empty pair always merges with itself
            tasks.append(g.task(i, i, mine[start], mine[end], band))
            start = end + 1
    return tuple(tasks)


def _longest(g: _Grid, i: int, mine: list[int], start: int) -> int:
    """The last e with query run i's key runs ``mine[start..e]`` one call (step 3), in one pass over them.

    On one query run (m rows) ``merged``'s test is: the key runs are consecutive (the band meets every run between
    its first and last), and each pair's band ``(bl, bh)`` shifted by its key offset ``s`` is the group band
    ``(lo, hi)`` clipped - ``lo = min(bl + s)``, ``hi = max(bh + s)`` over the group, and a pair whose band stops
    short of its run's edge (``bl > -(m - 1)``, ``bh < n - 1``) must set that bound itself: ``bl + s == lo``,
    ``bh + s == hi``. Widening the group only lowers ``lo`` and raises ``hi``, so a failed test stays failed: the
    group ends at the first failure, as a left-to-right scan of ``merged`` ends it, each key run visited once
    (``tests/test_blocks.py`` compares them)."""
    row, m = g.rows[i], g.q[i].length
    k0 = g.k[mine[start]].local
    lo = hi = short_lo = short_hi = None          # the group band; the tightest bound a short band insists on
    for e in range(start, len(mine)):
        j, (bl, bh) = row[e]
        if e > start and j != mine[e - 1] + 1:
            return e - 1
        sh = g.k[j].local - k0
        lo = bl + sh if lo is None else min(lo, bl + sh)
        hi = bh + sh if hi is None else max(hi, bh + sh)
        if bl > -(m - 1):
            short_lo = bl + sh if short_lo is None else max(short_lo, bl + sh)
        if bh < g.k[j].length - 1:
            short_hi = bh + sh if short_hi is None else min(short_hi, bh + sh)
        if (short_lo is not None and short_lo != lo) or (short_hi is not None and short_hi != hi):
            return e - 1
    return len(mine) - 1


def group_varlen(tasks: Sequence[Task]) -> tuple[Task, ...]:
    """Pack tasks into flash-attn varlen calls: same bottom-right window, disjoint increasing rows and keys.

    Returns Band tasks unchanged where a group would hold a single task, and those whose window FA2 would clamp
    (``fa2_exact``: they run as row ranges, Note [FA2's capped windows] in ``seqpar.kernels.sdpa``). Used by
    kernels with a varlen path when a step has many small per-document tasks (one launch instead of one per
    document). Each task joins the first open group it fits: O(T log T + T G) for T tasks and G calls out. When
    queries and keys are both in document order (every layout's own rows), a later document's task fits
    any group of its window, so G is bounded by the windows times the tasks of one document.
    """
    # one query seeing all its keys is full and causal alike: such a task (window None) joins a group of either,
    # and a group of only such tasks takes the window of the first other task that joins it
    either = ((-1, -1), (-1, 0))
    groups: list[list] = []                     # [window or None, members]
    others = tuple(t for t in tasks if not isinstance(t.mask, Band))      # Modded blocks run alone
    bands = [t for t in tasks if isinstance(t.mask, Band)]
    alone = tuple(t for t in bands if not fa2_exact(t.mask, t.rows, t.cols))   # Note [FA2's capped windows]
    others = alone + others
    for t in sorted((t for t in bands if t not in alone), key=lambda t: (t.q_start, t.k_start)):
        w = bottom_right_window(t.mask, t.rows, t.cols)
        w = None if w == (-1, -1) and t.rows == 1 else w
        for g in groups:
            last = g[1][-1]
            if g[0] == w or (g[0] is None and w in either) or (w is None and g[0] in either):
                if t.q_start >= last.q_stop and t.k_start >= last.k_stop:
                    g[1].append(t)
                    g[0] = g[0] if g[0] is not None else w
                    break
        else:
            groups.append([w, [t]])
    out = []
    for w, members in groups:
        w = (-1, -1) if w is None else w
        if len(members) == 1:
            out.append(members[0])
            continue
        cu_q, cu_k = [0], [0]
        q0, k0 = members[0].q_start, members[0].k_start
        for t in members:
            if t.q_start - q0 > cu_q[-1]:          # query rows between tasks: a segment with no keys
                cu_q.append(t.q_start - q0)
                cu_k.append(cu_k[-1])
            if t.k_start - k0 > cu_k[-1]:          # key rows between tasks: a segment with no queries
                cu_q.append(cu_q[-1])
                cu_k.append(t.k_start - k0)
            cu_q.append(t.q_stop - q0)
            cu_k.append(t.k_stop - k0)
        out.append(Task(q0, members[-1].q_stop, k0, members[-1].k_stop, Varlen(tuple(cu_q), tuple(cu_k), w)))
    return tuple(out) + others


def visible_dense(q_pos: Sequence[int], k_pos: Sequence[int], rule: Rule,
                  q_doc: Sequence[int] | None = None, k_doc: Sequence[int] | None = None) -> list[list[bool]]:
    """The truth the planner must reproduce, as nested lists (tests only; O(Sq * Sk))."""
    lo, hi = rule.delta_bounds()
    qd = q_doc or [0] * len(q_pos)
    kd = k_doc or [0] * len(k_pos)
    vis = [[qd[i] == kd[j] and qd[i] >= 0 and (lo is None or kp - qp >= lo) and (hi is None or kp - qp <= hi)
            for j, kp in enumerate(k_pos)] for i, qp in enumerate(q_pos)]
    if rule.mask is None or not q_pos or not k_pos:
        return vis
    import torch

    fn = getattr(rule.mask, "fn", rule.mask)
    zero = torch.zeros((), dtype=torch.long)
    allowed = fn(zero, zero, torch.tensor(list(q_pos))[:, None], torch.tensor(list(k_pos))[None, :])
    allowed = allowed.expand(len(q_pos), len(k_pos)).tolist()
    return [[a and b for a, b in zip(r, m)] for r, m in zip(vis, allowed)]


def union_spans(spans) -> tuple[tuple[int, int], ...]:
    """Intervals ``[a, b)`` merged into sorted, disjoint ones (empty ones dropped)."""
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif a < b:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def slice_rows(seg: Segments, start: int, stop: int) -> Segments:
    """Local rows ``start:stop`` of ``seg`` as their own Segments, renumbered from 0 (documents kept)."""
    runs = []
    for r in seg.runs:
        a, b = max(r.local, start), min(r.end, stop)
        if a < b:
            runs.append(Run(a - start, r.glob + seg.stride * (a - r.local), b - a, r.doc))
    return Segments(tuple(runs), seg.stride)
