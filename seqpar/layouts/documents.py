"""Document layouts: placements computed from the batch's global ``cu_seqlens`` (packed training).

A plain layout (contiguous, zigzag, stripe) cuts the packed row without looking at the documents, so its
causal work follows them: a token sees only its own document, so its work is its position inside the
document plus one, and zigzag's chunk pairs no longer add up (busiest rank / mean 2.0 on average, 3.6 at
worst, at W = 8 on 128K rows of ~2K documents, ``benchmarks/results/balance-2026-11-23.txt``). A document
layout places tokens knowing the documents. Its fields are ``world`` and ``bounds``, the global
``cu_seqlens`` (0 first, non-decreasing, the valid length last); the sharded length may exceed
``bounds[-1]`` by end padding, placed too, as document -1. A new batch means a new layout object (frozen,
hashable: it keys the methods' plan caches).

Documents a (8 tokens), b (4), c (4) over W = 2, tokens named by document and offset::

    global:            a0 a1 a2 a3 a4 a5 a6 a7 | b0 b1 b2 b3 | c0 c1 c2 c3
    doc_contiguous     rank 0: a0-a3 b0 b1 c0 c1        rank 1: a4-a7 b2 b3 c2 c3
    doc_zigzag         rank 0: a0 a1 a6 a7 b0 b3 c0 c3  rank 1: a2-a5 b1 b2 c1 c2

``doc_contiguous`` is ring-flash-attn's ``ring_flash_attn_varlen_func`` convention (every document cut
into W equal parts, rank r holds part r of each, documents in order) and ``doc_zigzag`` its
``zigzag_ring_flash_attn_varlen_func`` convention (every document cut into 2W equal chunks, rank r holds
chunks r and 2W-1-r of each, document by document). Both need every document to divide (by W, by 2W) and
give local ``cu_seqlens = global cu_seqlens // W``; ``doc_zigzag`` balances causal work exactly,
``doc_contiguous`` does not (rank W-1 holds every document's last part). ``balanced`` takes any lengths.
Documents a (12), b (4), c (3), d (3), e (2) over W = 2 (12 tokens per rank; a and b are long)::

    balanced           rank 0: a0-a2 a9-a11 b0 b3 c0-c2 e0     12 tokens, work 51
                       rank 1: a3-a8 b1 b2 d0-d2 e1            12 tokens, work 52

Long documents are split like zigzag, short ones stay whole, and one short one (e) is cut to make the
tokens and the work come out even:

Note [Balanced layout]
    Goal: every rank holds exactly C = S / W tokens and the same causal work, where a token at offset p
    of its document costs p + 1 (the keys it sees) and padding costs 0; a pure function of
    (W, bounds, S), so every rank computes the same placement with no communication.
    1. Long documents (longer than C / 4 and at least 2W tokens) are split like zigzag over all W ranks:
       2W chunks of h = n // 2W, rank r holds chunks r and 2W-1-r. The n mod 2W tokens left over form a
       middle piece ``[W h, W h + n mod 2W)`` between chunks W-1 and W. Every rank gets the same tokens and
       the same work of the document, at every ring step too (Note [Zigzag load balance]).
    2. Everything else is the pool: short documents whole, the middle pieces, the end padding; k = C - 2h
       summed over long documents is what each rank still needs. Pool items are sorted by density (work
       per token, (a + b + 1) / 2 for offsets ``[a, b)``; padding 0), densest first, ties by position.
    3. Rank by rank, take j tokens from the dense end of the pool and k - j from the light end, j found by
       bisection so that the rank's work is the pool's remaining work / remaining ranks. An item cut at
       either end gives its OUTER tokens (head and tail, like zigzag) and keeps its middle, whose density
       is the item's, so the pool stays sorted. In a sorted pool the densest k tokens weigh at least the
       average and the lightest k at most (an average of averages sorted the same way), so the rank's work
       crosses the target as j goes from 0 to k and the bisection lands within about a token's weight of it;
       the last rank takes what is left.
    4. Each rank's pieces are ordered by global position (adjacent ones merge into one run).
    Result: tokens exactly C on every rank; work within a few token weights of the mean (busiest / mean
    <= 1.0002 on 128K rows at W = 4, 8, 16, ``benchmarks/results/balance-2026-11-23.txt``). Whole short
    documents stay on one rank (no cross-rank blocks); each rank cuts at most two pool items, each into a
    head and a tail piece. The long/short threshold trades runs for per-step balance: a cut item's
    cross-rank pairs fall on one or two ring steps of one rank, a zigzag-split document's on every step of
    every rank equally. Measured on the same rows (the pass-KV lockstep bound: the sum over ring steps of
    the busiest rank's work, over the mean total), splitting documents longer than C / 4 gives at worst
    1.17 with 17-47 runs per rank; longer than C / 2, 1.72; longer than C, 2.29 with 10-19 runs per rank.
    Cost: O(D log D) for the sort of D documents, O(log S log D) per rank for the bisection, and the
    pieces emitted (2W per long document, O(D + W) otherwise): O(D log D + W log S log D) before output.
    Masks: with a named mask (``Balanced.rule``, set from the call's ``causal`` and ``mask_mod``, the same in
    ``seqpar.shard``), a token weighs the keys it sees under the mask, and the units of steps 1-2 are the
    affine pieces of ``seqpar.layouts.profile`` (documents cut where a query's count of visible keys changes
    slope) instead of whole documents. Zigzag splits and head-and-tail cuts keep a piece's mean weight for
    any affine weight, so the steps hold unchanged: at W = 8 on 128K, busiest / mean visible pairs is
    1.00 for every named mask (zigzag: 1.28 for 8 responses sharing a 64K prompt, 1.15 for a 32K prefix LM;
    ``tests/test_masks_balance.py`` asserts <= 1.05).
    Why not a solver: exact token counts and balance within a token's weight are already reached by a
    sort and W bisections, deterministically (integer keys and integer targets, no float ties); an ILP
    or bin-packing search would add a dependency and run time per batch to gain nothing on balance. A
    greedy by work under the exact token capacity (tried first) left the busiest rank up to 11% over.

Note [Whole documents]
    ``balanced_whole`` is ``balanced`` with step 1's threshold at C: only a document longer than a rank's
    tokens is split over every rank; every other one goes to the pool whole, and each rank cuts at most two
    pool items (step 3), so almost every document is attended on one rank with no cross-rank block. The work
    per rank is as even (steps 2-3 are the same); what changes is the work per ring step, which concentrates
    on the steps where the cut items' keys arrive - the lockstep bound above goes from 1.17 to 2.29. So the
    layout is for methods with no lockstep: all-gather computes once every key has arrived, and its rank's
    queries then make a few long varlen calls instead of a piece of every long document. At short chunks the
    zigzag-split documents' pieces are what costs: packed rows of lognormal documents (mean ~2K tokens) over 8
    ranks, emulated on an H100 (the busiest rank, ``benchmarks/results/2026-11-26-h100-balanced-long``), GPU
    time per call fell from 4.56 to 3.05 ms (all-gather, 32K row, forward+backward) and
    from 15.9 to 11.4 ms (128K row), and the ring's from 18.1 to 10.7 ms at 128K: a document of 8K tokens over
    8 ranks was 16 pieces of 512 tokens, each a call at every step. On 4 real H100s (128K rows, 32K tokens per
    GPU, ``benchmarks/results/2026-11-26-h100x4-packed-real``) all-gather gained on every row (forward+backward
    0.61 -> 0.65 lognormal, 0.69 -> 0.83 long tail; its selective gather also moves fewer rows when documents stay
    on one rank) and the ring lost forward (0.66 -> 0.55, 0.83 -> 0.77): the lockstep, which the emulation cannot
    see. So ``balanced_whole`` is all-gather's layout for packed batches (``Method.packed_layout``), and the ring,
    which accepts it for short chunks, keeps ``balanced``.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from .base import Layout
from .blocks import Rule, Run, Segments
from .profile import affine_pieces

__all__ = ["Balanced", "BalancedWhole", "DocContiguous", "DocZigzag", "DocumentLayout"]

#: Note [Balanced layout] step 1: a document longer than 1/_LONG of a rank's tokens is split over all ranks
_LONG = 4


def _shown(bounds: tuple[int, ...]) -> str:
    return f"{list(bounds[:12])}{' ...' if len(bounds) > 12 else ''}"


def _segments(pieces: Iterable[tuple[int, int]]) -> Segments:
    """Local rows from ``(global start, length)`` pieces in local order; globally adjacent neighbours merge."""
    runs: list[Run] = []
    for glob, n in pieces:
        if n <= 0:
            continue
        if runs and runs[-1].glob + runs[-1].length == glob:
            runs[-1] = Run(runs[-1].local, runs[-1].glob, runs[-1].length + n)
        else:
            runs.append(Run(runs[-1].end if runs else 0, glob, n))
    return Segments(tuple(runs))


@dataclass(frozen=True)
class DocumentLayout(Layout):
    """Base class: a placement computed from the global document boundaries ``bounds`` (``cu_seqlens``)."""

    #: the global ``cu_seqlens``: document d is ``[bounds[d], bounds[d+1])``, the valid length last
    bounds: tuple[int, ...]
    documents: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        bounds = tuple(int(b) for b in self.bounds)
        object.__setattr__(self, "bounds", bounds)
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] < 1 or any(b < a for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at the valid length (>= 1) "
                             f"for {self.described()}, got {_shown(bounds)}")

    def check_len(self, seq_len: int, what: str = "global sequence length") -> None:
        if seq_len < self.bounds[-1]:
            raise ValueError(f"{what} must be at least the documents' end cu_seqlens[-1] = {self.bounds[-1]} for "
                             f"{self.described()}, got {seq_len}")
        super().check_len(seq_len, what)

    def _zones(self, seq_len: int) -> Iterable[tuple[int, int]]:
        """Every non-empty document's ``[start, end)``, then the end padding's if any."""
        yield from ((a, b) for a, b in itertools.pairwise(self.bounds) if b > a)
        if seq_len > self.bounds[-1]:
            yield self.bounds[-1], seq_len


@dataclass(frozen=True)
class _EvenSplit(DocumentLayout):
    """Every document cut into ``world * pieces`` equal parts (ring-flash-attn's varlen conventions)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        m = self.divisor
        for d, (a, b) in enumerate(itertools.pairwise(self.bounds)):
            if (b - a) % m:
                what = "W" if self.pieces == 1 else f"{self.pieces}W"
                raise ValueError(f"document {d} has length {b - a}, not a multiple of {what} = {m} for "
                                 f"{self.described()} (cu_seqlens[{d}:{d + 2}] = ({a}, {b}); pad each document "
                                 f"to a multiple of {m}, or use the balanced layout)")

    def local_cu_seqlens(self) -> tuple[int, ...]:
        """``cu_seqlens // W``: rows ``[cu[d], cu[d+1])`` of every rank are document d's (what ring-flash-attn's
        varlen functions take; end padding rows follow the last document)."""
        return tuple(c // self.world for c in self.bounds)


@dataclass(frozen=True)
class DocContiguous(_EvenSplit):
    """Rank r holds part r of W equal parts of every document, documents in order (ring-flash-attn varlen)."""

    name: ClassVar[str] = "doc_contiguous"
    pieces: ClassVar[int] = 1

    def segments(self, rank: int, seq_len: int) -> Segments:
        self.check_len(seq_len)
        return _segments((a + rank * ((b - a) // self.world), (b - a) // self.world) for a, b in self._zones(seq_len))


@dataclass(frozen=True)
class DocZigzag(_EvenSplit):
    """Rank r holds chunks r and 2W-1-r of 2W equal chunks of every document (ring-flash-attn zigzag varlen)."""

    name: ClassVar[str] = "doc_zigzag"
    pieces: ClassVar[int] = 2

    def segments(self, rank: int, seq_len: int) -> Segments:
        self.check_len(seq_len)
        return _segments(self._chunks(rank, seq_len))

    def _chunks(self, rank: int, seq_len: int) -> Iterable[tuple[int, int]]:
        for a, b in self._zones(seq_len):
            h = (b - a) // (2 * self.world)
            yield a + rank * h, h
            yield a + (2 * self.world - 1 - rank) * h, h


@dataclass(frozen=True)
class Balanced(DocumentLayout):
    """Equal tokens and equal work on every rank for any document lengths (Note [Balanced layout]): causal
    work, or with ``rule`` (a rule with a named mask) the keys each query sees under it."""

    rule: Rule | None = None
    name: ClassVar[str] = "balanced"
    pieces: ClassVar[int] = 1
    #: step 1 splits a document longer than C / ``long`` tokens over every rank
    long: ClassVar[int] = _LONG

    def segments(self, rank: int, seq_len: int) -> Segments:
        self.check_len(seq_len)
        return _segments(_balanced(self.world, self.bounds, seq_len, self.rule, self.long)[rank])


@dataclass(frozen=True)
class BalancedWhole(Balanced):
    """``balanced`` keeping every document that fits on a rank whole (Note [Whole documents]): for methods
    without lockstep steps (all-gather), and rings at short chunks."""

    name: ClassVar[str] = "balanced_whole"
    long: ClassVar[int] = 1


@functools.lru_cache(maxsize=16)
def _balanced(world: int, bounds: tuple[int, ...], seq_len: int, rule: Rule | None = None, long: int = _LONG
              ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Every rank's ``(global start, length)`` pieces in global order (Note [Balanced layout]); a unit longer than
    C / ``long`` tokens is split over every rank."""
    W, C = world, seq_len // world
    ranks: list[list[tuple[int, int]]] = [[] for _ in range(W)]
    items = []
    # units of affine work: documents with the causal ramp (work 1 + offset), or a masked rule's pieces
    units = [(a, b - a, 1, 1) for a, b in itertools.pairwise(bounds)] if rule is None \
        else affine_pieces(bounds, rule)
    for a, n, c, slope in units:
        h = n // (2 * W)
        if h and long * n > C:                                       # step 1: zigzag over every rank
            rem = n - 2 * W * h
            for r in range(W):
                ranks[r] += [(a + r * h, h), (a + (2 * W - 1 - r) * h + rem, h)]
            if rem:
                items.append((a, W * h, W * h + rem, False, c, slope))
        elif n:
            items.append((a, 0, n, False, c, slope))
    if seq_len > bounds[-1]:
        items.append((bounds[-1], 0, seq_len - bounds[-1], True, 0, 0))
    pool = _Pool(items)
    k, left = pool.size // W, pool.cum_w[-1]
    for r in range(W):
        j = _split(pool, k, left, W - r)
        left -= pool.work(j, k - j)
        ranks[r] += pool.take(j, k - j)
    return tuple(tuple(sorted(p for p in pieces if p[1])) for pieces in ranks)


def _split(pool: _Pool, k: int, left: int, ranks: int) -> int:
    """Tokens j from the dense end (k - j from the light end) whose work is nearest ``left / ranks`` (step 3)."""
    if ranks == 1 or k == 0:
        return k

    def gap(j: int) -> int:
        return pool.work(j, k - j) * ranks - left

    lo, hi = 0, k
    g_lo, g_hi = gap(lo), gap(hi)
    if g_lo == 0 or g_hi == 0 or (g_lo > 0) == (g_hi > 0):     # exact at an end, or no crossing (rounding)
        return lo if abs(g_lo) <= abs(g_hi) else hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        g = gap(mid)
        if g == 0:
            return mid
        if (g > 0) == (g_lo > 0):
            lo, g_lo = mid, g
        else:
            hi, g_hi = mid, g
    return lo if abs(g_lo) <= abs(g_hi) else hi


class _Pool:
    """Note [Balanced layout] steps 2-3: the items not split over every rank, densest first.

    Item i is the piece ``[lo[i], hi[i])`` of the offsets of a document (or an affine piece of one) starting at
    global position ``origin[i]``, whose token at offset p weighs ``c[i] + slope[i] * p`` (the end padding
    weighs 0). Only the items at the two ends of the order
    (``first`` and ``last``) can be partly taken; prefix sums over the original items give every other
    item's tokens and work, so ``work(j, u)`` costs O(log D).
    """

    def __init__(self, items: list[tuple[int, int, int, bool, int, int]]):
        # densest first: twice the mean weight, 2c + slope (a + b - 1), is an integer key
        items = sorted(items, key=lambda it: (0 if it[3] else -(2 * it[4] + it[5] * (it[1] + it[2] - 1)),
                                              it[0] + it[1]))
        self.origin = [it[0] for it in items]
        self.lo = [it[1] for it in items]
        self.hi = [it[2] for it in items]
        self.pad = [it[3] for it in items]
        self.c = [it[4] for it in items]
        self.slope = [it[5] for it in items]
        self.cum_t = list(itertools.accumulate((it[2] - it[1] for it in items), initial=0))
        self.cum_w = list(itertools.accumulate((self._work(i, self.lo[i], self.hi[i]) for i in range(len(items))),
                                               initial=0))
        self.first, self.last = 0, len(items) - 1
        self.size = self.cum_t[-1]

    def _work(self, i: int, a: int, b: int) -> int:
        return 0 if self.pad[i] else self.c[i] * (b - a) + self.slope[i] * (b * (b - 1) - a * (a - 1)) // 2

    def _whole(self, items: range) -> int:
        """Work of what remains of ``items``."""
        if not items:
            return 0
        w = self.cum_w[items.stop] - self.cum_w[items.start]
        for i in {self.first, self.last}:                    # the only items that can be partly taken
            if i in items:
                w += self._work(i, self.lo[i], self.hi[i]) - (self.cum_w[i + 1] - self.cum_w[i])
        return w

    def _locate(self, t: int) -> tuple[int, int]:
        """``(item, offset in what remains of it)`` of remaining token t, counted from the dense end."""
        f = self.first
        taken = (self.cum_t[f + 1] - self.cum_t[f]) - (self.hi[f] - self.lo[f])
        s = self.cum_t[f] + taken + t
        i = bisect.bisect_right(self.cum_t, s) - 1
        return i, s - self.cum_t[i] - (taken if i == f else 0)

    def _outer(self, i: int, m: int, dense: bool) -> tuple[int, int, int]:
        """``(item, head, tail)``: the outer m tokens of item i; an odd extra comes from the tail at the dense end."""
        if self.pad[i]:
            return i, m, 0
        head = m // 2 if dense else m - m // 2
        return i, head, m - head

    def _plan(self, j: int, u: int) -> tuple[list[range], list[tuple[int, int, int]]]:
        """What ``take(j, u)`` removes: ranges of whole items, and ``(item, head, tail)`` cuts."""
        front = self._locate(j - 1) if j else None
        back = self._locate(self.size - u) if u else None
        if front and back and front[0] == back[0]:              # both ends meet inside one item
            i = front[0]
            m = front[1] + 1 + (self.hi[i] - self.lo[i] - back[1])
            return [range(self.first, i), range(i + 1, self.last + 1)], [self._outer(i, m, True)]
        wholes, cuts = [], []
        if front:
            wholes.append(range(self.first, front[0]))
            cuts.append(self._outer(front[0], front[1] + 1, True))
        if back:
            wholes.append(range(back[0] + 1, self.last + 1))
            cuts.append(self._outer(back[0], self.hi[back[0]] - self.lo[back[0]] - back[1], False))
        return wholes, cuts

    def work(self, j: int, u: int) -> int:
        """Work of the j densest and u lightest remaining tokens (``j + u <= size``)."""
        wholes, cuts = self._plan(j, u)
        return sum(self._whole(r) for r in wholes) + sum(
            self._work(i, self.lo[i], self.lo[i] + h) + self._work(i, self.hi[i] - t, self.hi[i]) for i, h, t in cuts)

    def take(self, j: int, u: int) -> list[tuple[int, int]]:
        """Remove those tokens; their ``(global start, length)`` pieces."""
        wholes, cuts = self._plan(j, u)
        out = []
        for i in itertools.chain.from_iterable(wholes):
            out.append((self.origin[i] + self.lo[i], self.hi[i] - self.lo[i]))
            self.lo[i] = self.hi[i]
        for i, h, t in cuts:
            out += [(self.origin[i] + self.lo[i], h), (self.origin[i] + self.hi[i] - t, t)]
            self.lo[i], self.hi[i] = self.lo[i] + h, self.hi[i] - t
        while self.first <= self.last and self.lo[self.first] == self.hi[self.first]:
            self.first += 1
        while self.last >= self.first and self.lo[self.last] == self.hi[self.last]:
            self.last -= 1
        self.size -= j + u
        return out
