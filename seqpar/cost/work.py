"""How much attention each rank computes at each step: closed-form index math, no tensors.

The cost model needs, per schedule step, the kernel call the critical rank makes: its query rows, key
columns, the visible (query, key) pairs and whether a mask is applied. This module answers from global
positions, like the block planner (``seqpar.layouts.blocks``) but in closed form, so it scales to
thousands of ranks. A rank's tokens are ``Run(start, length, stride)``s: one run for contiguous, two
(chunks r and 2W-1-r) for zigzag, one run of stride W for stripe.

Visibility is a band on ``key_pos - query_pos``: causal is ``hi = 0``; a left window w gives
``lo = -w``; a right window gives ``hi``; None is unbounded (the flash-attn window convention).

Note [Critical step]
    Ranks of a ring move in lock-step (each waits for its neighbour's transfer), so a step lasts as long
    as its slowest rank. For each step we take the rank with the most visible pairs (ties: the masked
    call, which runs slower). Without a window the answer is known in closed form (ALGORITHMS.md §2,
    §12.2): contiguous causal does a dense L x L block on every step after the first (rank W-1 is
    critical), zigzag an unmasked L x L/2 block, stripe a masked L x L block. With a window the steps
    are computed from the runs, over every rank up to 64 ranks and a spread sample of 64 beyond.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["Block", "Run", "band", "count_pairs", "gather_blocks", "rank_runs", "ring_steps", "run_pairs", "self_block"]


@dataclass(frozen=True)
class Run:
    """``length`` tokens at global positions ``start + stride * i``."""

    start: int
    length: int
    stride: int = 1


@dataclass(frozen=True)
class Block:
    """One kernel call: ``rows`` x ``cols`` with ``pairs`` visible; ``masked`` unless every pair is. A packed call
    (documents) also counts its query tiles per head and its pairs on whole tiles (``tiles``, ``padded``: Note [Query
    tiles of packed calls] in ``model.py``); 0 for a dense call."""

    rows: int
    cols: int
    pairs: int
    tiles: int = 0
    padded: int = 0

    @property
    def masked(self) -> bool:
        return self.pairs < self.rows * self.cols

    @property
    def tokens(self) -> float:
        """The call's size for kernel-rate lookups: sqrt(rows * cols)."""
        return (self.rows * self.cols) ** 0.5


def causal_corner(blk: Block) -> tuple[Block, Block] | None:
    """``blk`` as its full keys and its causal corner when it is exactly that (Note [Causal corners]), else None.

    Note [Causal corners]
        A call of ``r`` query rows against ``c > r`` keys whose last ``r`` keys end on the rows' diagonal
        (bottom-right causal: ``r (c - r)`` full pairs and ``r (r + 1) / 2`` in the corner) is what all-gather's
        back chunks and pass-Q's back chunk run. The runtime runs it as two kernel calls on cuDNN (Note [Split
        bands as tasks] in ``seqpar.kernels.executor``), and any kernel skips the corner's hidden tiles, so its
        pairs go at the full rate save the corner's. Charged whole at the causal rate of its size, all-gather's
        forward at 2K tokens per rank over 8 was predicted 15-18% slower than it ran (emulated, H100,
        ``benchmarks/results/2026-11-26-h100-emulated-final-thirteenth``), more than the fitted fixed costs can
        take back.
    """
    r, c = blk.rows, blk.cols
    if not r < c or blk.pairs != r * (c - r) + r * (r + 1) // 2:
        return None
    return Block(r, c - r, r * (c - r)), Block(r, r, r * (r + 1) // 2)


def band(causal: bool, window: tuple[int, int]) -> tuple[int | None, int | None]:
    """``(lo, hi)`` bounds on ``key_pos - query_pos`` (None = unbounded)."""
    left, right = window
    lo = -left if left >= 0 else None
    if causal:
        hi = 0 if right < 0 else min(0, right)
    else:
        hi = right if right >= 0 else None
    return lo, hi


def _upto(Lq: int, Lk: int, x: int | None) -> int:
    """#{(i, j): 0 <= i < Lq, 0 <= j < Lk, j - i <= x}."""
    if x is None:
        return Lq * Lk
    c = x + 1                       # row i contributes clamp(c + i, 0, Lk)
    a = max(0, min(Lq, 1 - c))      # rows contributing 0
    b = max(a, min(Lq, Lk - c))     # rows from here contribute Lk
    n = b - a
    return n * c + (a + b - 1) * n // 2 + (Lq - b) * Lk


def count_pairs(Lq: int, Lk: int, lo: int | None, hi: int | None) -> int:
    """#{(i, j): 0 <= i < Lq, 0 <= j < Lk, lo <= j - i <= hi} (None = unbounded)."""
    if lo is not None and hi is not None and lo > hi:
        return 0
    below = 0 if lo is None else _upto(Lq, Lk, lo - 1)
    return max(0, _upto(Lq, Lk, hi) - below)


def _floor_div(a: int, b: int) -> int:
    return a // b


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


def run_pairs(q: Run, k: Run, lo: int | None, hi: int | None) -> int:
    """Visible pairs between two runs of one stride: ``lo <= (k.start + s j) - (q.start + s i) <= hi``."""
    if q.stride != k.stride:
        raise ValueError(f"runs must share a stride, got {q.stride} and {k.stride}")
    s, d = q.stride, k.start - q.start
    tlo = None if lo is None else _ceil_div(lo - d, s)
    thi = None if hi is None else _floor_div(hi - d, s)
    return count_pairs(q.length, k.length, tlo, thi)


def rank_runs(layout: str, world: int, seq_len: int, rank: int) -> tuple[Run, ...]:
    """The runs of global positions ``rank`` holds in ``layout`` over ``world`` ranks."""
    L = seq_len // world
    if layout == "contiguous":
        return (Run(rank * L, L),)
    if layout == "zigzag":
        c = L // 2
        return (Run(rank * c, c), Run((2 * world - 1 - rank) * c, c))
    if layout == "stripe":
        return (Run(rank, L, world),)
    raise ValueError(f"layout must be 'contiguous', 'zigzag' or 'stripe', got {layout!r}")


def _call(qs: tuple[Run, ...], ks: tuple[Run, ...], lo: int | None, hi: int | None) -> Block | None:
    """The one call covering every visible run pair (bounding rows x cols), or None if nothing is seen."""
    rows: set[int] = set()
    cols: set[int] = set()
    pairs = 0
    for a, q in enumerate(qs):
        for b, k in enumerate(ks):
            n = run_pairs(q, k, lo, hi)
            if n:
                pairs += n
                rows.add(a)
                cols.add(b)
    if not pairs:
        return None
    return Block(sum(qs[a].length for a in rows), sum(ks[b].length for b in cols), pairs)


def _closed_form(layout: str, W: int, L: int, causal: bool) -> tuple[Block, ...]:
    if not causal:
        return (Block(L, L, L * L),) * W
    diag = Block(L, L, L * (L + 1) // 2)
    if layout == "contiguous":
        return (diag,) + (Block(L, L, L * L),) * (W - 1)
    if layout == "zigzag":
        return (diag,) + (Block(L, L // 2, L * L // 2),) * (W - 1)
    return (diag,) + (Block(L, L, L * (L + 1) // 2),) * (W - 1)     # stripe: the j < r step (diagonal kept)


def _sample(W: int) -> list[int]:
    if W <= 64:
        return list(range(W))
    return sorted({round(i * (W - 1) / 63) for i in range(64)})


@functools.lru_cache(maxsize=4096)
def ring_steps(layout: str, W: int, seq_len: int, causal: bool, window: tuple[int, int]) -> tuple[Block | None, ...]:
    """The critical rank's call at each step of a pass-KV ring (Note [Critical step]).

    Trailing steps on which no rank computes are cut (ALGORITHMS.md §3.5: a window shorter than the ring
    truncates it); a step where the critical rank sees nothing but others do is ``None``.
    """
    L = seq_len // W
    if window == (-1, -1):
        return _closed_form(layout, W, L, causal)
    lo, hi = band(causal, window)
    runs = [rank_runs(layout, W, seq_len, r) for r in range(W)]
    steps: list[Block | None] = []
    for s in range(W):
        best: Block | None = None
        for r in _sample(W):
            blk = _call(runs[r], runs[(r - s) % W], lo, hi)
            if blk is not None and (best is None or (blk.pairs, blk.masked) > (best.pairs, best.masked)):
                best = blk
        steps.append(best)
    while len(steps) > 1 and steps[-1] is None:
        steps.pop()
    return tuple(steps)


@functools.lru_cache(maxsize=1024)
def gather_blocks(layout: str, W: int, seq_len: int, causal: bool, window: tuple[int, int]) -> tuple[Block, ...]:
    """The critical rank's calls against the whole gathered sequence (all-gather KV, ALGORITHMS.md §4).

    One bottom-right call per query run, its columns the span of keys the run sees.
    """
    lo, hi = band(causal, window)
    best: tuple[Block, ...] = ()
    for r in _sample(W):
        calls = []
        for q in rank_runs(layout, W, seq_len, r):
            last = q.start + q.stride * (q.length - 1)
            k0 = 0 if lo is None else max(0, q.start + lo)
            k1 = seq_len - 1 if hi is None else min(seq_len - 1, last + hi)
            if k1 < k0:
                continue
            n = run_pairs(q, Run(k0, k1 - k0 + 1), lo, hi)
            if n:
                calls.append(Block(q.length, k1 - k0 + 1, n))
        if sum(b.pairs for b in calls) > sum(b.pairs for b in best):
            best = tuple(calls)
    return best


def self_block(seq_len: int, causal: bool, window: tuple[int, int]) -> Block:
    """The whole sequence against itself: Ulysses' local call, and the single-GPU yardstick."""
    lo, hi = band(causal, window)
    return Block(seq_len, seq_len, count_pairs(seq_len, seq_len, lo, hi))
