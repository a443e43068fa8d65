"""All-gather KV context parallelism ("llama3", ALGORITHMS.md §4): contiguous and zigzag layouts.

Every rank all-gathers K and V (``heads_k_stride`` KV heads at a time, to bound memory), computes its own
queries against the keys they may see in one pass (no merges across ranks: one pass sees every key), and in
backward re-gathers K and V, accumulates dK/dV for the whole gathered buffer in fp32 and reduce-scatters it
back to the owners (``cfg.grad_dtype`` on the wire, fp32 by default).

Note [Gather into global order]
    (Plain layouts gather by parts since 2026-11-26, Note [Gather by parts]; this holds for the per-batch ones.)
    The collective delivers rank-major rows: contiguous ranks arrive in global order, zigzag ranks as
    ``[c0 c_{2W-1} | c1 c_{2W-2} | ...]``. We permute the gathered chunks into global order (one
    ``index_select`` of the gathered buffer on the device, chunk granularity, map precomputed) and plan
    against ONE key run per document. Then every query run sees one contiguous key span, so causal zigzag is
    exactly two bottom-right calls per rank (front chunk against keys ``[0, (r+1)L/2)``, back chunk against
    ``[0, (2W-r)L/2)``), varlen is one call per local document piece (packed into one varlen call), and
    no two calls share a query row. Planning against the rank-order buffer instead
    (``Segments.concat`` of every rank's segments) needs no copy but splits each zigzag query chunk into
    up to W calls (front chunks are interleaved with back chunks) plus fp32 merges: about 2W+1 small
    calls per rank against 2. The copy moves the gathered KV once through memory (O(S Hkv D) bytes) while
    the attention it feeds is O(S^2 H D / W) work, so the copy is the cheaper side on every GPU shape.
    Backward permutes the fp32 dK/dV buffer back to rank order the same way before the reduce-scatter.
    Contiguous needs neither copy.

Note [Gather by parts]
    A plain layout's ranks hold their rows as the same runs (zigzag: a front and a back chunk of L/2 rows). Such a
    layout gathers run by run - every rank's fronts into one part of the buffer, then every rank's backs into the
    next - so no permutation of the gathered keys and no permutation of the fp32 dK/dV back is needed: the buffer's
    parts are rank-major, as the reduce-scatter of each part wants them. In zigzag's fronts part global order
    holds (c0, c1, ..., c_{W-1}); the backs part runs backwards (c_{2W-1}, ..., c_W). The planner takes the
    buffer's runs as they lie (a fully visible key run merges with its fully visible neighbours whatever their
    global order), so causal zigzag is three calls per rank, the order of the two parts chosen per rank for the
    fewest (a band cuDNN splits counting as two: Note [Split bands as tasks]): the front chunk bottom-right
    against the fronts it sees, the back chunk's diagonal block, and the rest of what the back chunk sees in one
    full call - one more call than in global order, and one merge of the back chunk's two partials (Note [One
    merge per call]), where global order moved the whole gathered buffer through memory twice per forward and
    backward plus the fp32 dK/dV once (at 2K tokens per rank over 8, MHA: 0.17 ms forward, 0.5 ms backward,
    against a merge of 1K rows). On rank 0 the parts' order decides between three calls and four (its front
    chunk sees only its own keys: the backs part first leaves the back chunk's diagonal at the buffer's start
    and everything after it fully visible). The per-batch layouts, whose runs differ from rank to
    rank, keep one gather and the permutation (Note [Gather into global order]); the cost model prices the
    permutation for them alone.

Note [K and V apart]
    The gather's buffers hold K and V side by side (Note [One KV message] in ``_shared``), so one collective moves
    both - at the price of packing the local K and V into the send buffer in every forward and every backward
    re-gather: at 2K tokens per rank over 8 on an H100, 11 us (GQA 32/8) and 47 us (MHA) of a 0.59 ms forward
    (``benchmarks/gpu/probe_host.py``). With one head round and a batch of one, the local K and V already are the
    sequence-major rows the gather wants (``(L, 1, Hkv, D)`` views of contiguous tensors), so they are gathered
    as they lie: two messages of one coalesced collective (Note [Coalesced parts] in ``seqpar.comm.all_gather``)
    into a receive buffer each, which the kernels read as contiguous K and V. Head rounds (``heads_k_stride``)
    and batches of several rows still pack: their local rows are not contiguous. The fp32 dK/dV return keeps one
    buffer (its reduce-scatter sends what the backward accumulated, a copy either way).

Note [First touch]
    Backward accumulates every call's dK/dV into the fp32 buffer of the gathered keys (W L rows per head chunk).
    Zeroing it and adding every call moves 4 + 10 bytes per element of the buffer (a fill; then read the
    gradient, read and write the accumulator); most rows are written by exactly one call. So the plan's calls
    are read once per planned call (``_first_touch``, cached with the calls): where a call is the first to write
    a row it copies its gradient (6 bytes per element), where an earlier call wrote it, it adds, and only the
    rows no call writes are zeroed (zigzag by parts: the back chunks of the ranks below, which this rank's
    queries never see). The sums are the same, bit for bit: the first add to a zero is exact.

Note [All-gather calls side by side]
    A round's calls read the same gathered keys and share no output until they are merged or summed: in the
    forward always, in the backward where the round's dK/dV are held and summed once (Note [Overlapping calls
    in one pass]; first touch writes them call by call). So the calls but the largest (by rows x keys) run on
    the side stream, launched first, and the largest on the current stream (Note [Calls side by side] in
    ``seqpar.kernels.side``); their results join the current stream, which merges, writes or sums them. At 4K
    tokens per rank a balanced rank's packed documents make two varlen calls, one of the long pieces' rows
    against all their earlier keys (0.47 ms forward for 0.26 ms of its share of the one-GPU call) and one of
    every short document's rows (0.13 ms for 0.02 ms), each leaving the GPU partly idle.

Note [Overlapping calls in one pass]
    Where calls overlap on keys (a packed row on a balanced layout: a rank's two chunks hold pieces of the same
    documents, and their calls both reach back over the gathered keys), first touch still copies one call's
    gradient and adds the next: 6 + 10 bytes per element over the overlap, in two strided kernels per tensor -
    at 4K tokens per rank over 8, four kernels of 111-148 us each of a 4.5 ms backward (one H100,
    ``probe_host.py``). When some call adds and the calls' gradients together take no more memory than the fp32
    accumulator itself (``_in_one_pass``), the round holds them and ``combine.sum_parts`` writes each tensor's
    accumulator once - every row summed in fp32 in the calls' order, the rows no call reaches zeroed, in one
    kernel: 2 bytes per element per call read, 4 written. Past the bound (many calls, or long calls that each
    span most keys) the calls stay first touch, each call's gradients freed before the next runs.

Note [Chunk copies]
    The permutation moves 2W chunks of up to tens of MiB each. ``index_select`` with so few indices runs CUDA's
    small-index kernel, which reads a huge row with a handful of blocks: 504 us for the 256 MiB of an MHA KV
    buffer at 2K tokens per rank over 8 (H100), against ~170 us at memory bandwidth, and 596 us for its fp32
    dK/dV - a third of the call's forward and backward. A plain layout's permutation is a few arithmetic runs
    (zigzag into global order: the fronts ``0, 2, 4, ...`` as one strided copy, then each back chunk; back to
    rank order: a front and its back chunk per rank), so it is applied as one copy per run, each at memory
    bandwidth (a strided ``copy_``, or a DtoD memcpy for a run of one). A per-batch layout's order can hold one
    chunk per token; past ``COPY_RUNS`` runs it stays one ``index_select`` (many small rows: its large-index
    kernel). The cost model charges the permutation to the per-batch layouts alone, at ``permute_gelems`` (the
    profiled index_select rate, ``seqpar.planner.measured``): the rate of the many-run case, above what a few
    strided copies take; its fixed costs were refitted on a real run of the code that gathers by parts.

Note [All-gather pipeline]
    KV heads are processed in chunks of ``heads_k_stride`` (None = all heads in one round; GQA: query heads
    ``[c0 G, (c0 + stride) G)`` go with KV heads ``[c0, c0 + stride)``). Chunk c+1's gather is posted
    before chunk c is computed (double-buffered receive buffers), so the transfer hides behind compute;
    with one chunk the gather is exposed. In backward the reduce-scatter of chunk c is posted right after
    its compute and waited only before its buffer is reused, so it overlaps chunk c+1. Backward re-gathers
    K and V rather than keeping the forward's buffer: keeping it would hold W times the local KV of every
    layer from forward to backward (e.g. 512 MiB per layer at 128K tokens, 8 KV heads, d 128, bf16), which
    is the memory this method exists to bound.

Note [Selective gather]
    With documents, windows or padding a rank's queries often see a small part of the sequence: on a packed
    batch in the balanced layout, a short document placed whole on a rank needs no key from elsewhere. Each
    query run (cut at documents) sees exactly the keys ``[max(a_d, first + lo), min(b_d, last + hi + 1))`` of
    its document ``[a_d, b_d)`` (``lo, hi`` the rule's bounds on ``key - query``); their union ``N_r`` is what
    rank r must read. Every rank computes every ``N_r`` from ``cu_seqlens`` alone (O(runs) each, no
    communication), so senders and receivers agree: rank j sends rank r the rows it holds in ``N_r`` in
    global order, one uneven all-to-all per head chunk, and rank r plans its queries against the compact
    buffer of ``N_r`` in global order (one ``index_select`` when arrivals are not already in that order).
    Backward is the adjoint: dK/dV of the compact buffer go back in arrival order by the reverse all-to-all
    and each owner adds the partials of every reader (``index_add_`` per reader, unique rows each, so the
    sum is deterministic). The selective path runs when the busiest reader needs at most ``SELECT_AT`` of
    the sequence; otherwise the full all-gather is cheaper (an all-gather is the better-tuned collective,
    and the busiest rank - rank 0 of a causal zigzag - receives everything anyway). Under a named mask the keys
    a rank reads are those of the blocks the planner keeps for its queries against the whole sequence (empty
    blocks skipped, Note [Block planning]): the sink window's rank at 16K of 128K over 8 reads its sinks and its
    4095-key halo (4224 foreign rows with the tiles below, where the full gather moved 114688), Llama 4's chunks
    of 8K inside a rank's 16K read nothing from another rank, a shared prefix's responses read the prompt. Finding
    those keys plans every rank's queries against the whole sequence, O(pieces^2) host work in all, so a mask of
    more than ``SELECT_PIECES`` pieces (video frames by the thousand) keeps the full gather.

Note [Local keys]
    Where no rank's queries see a key another rank holds - Llama 4's chunks inside each rank's rows, documents
    placed whole on ranks (``balanced_whole``) - the selective gather would move nothing but each rank's own rows
    through an all-to-all, a copy in and out of a compact buffer, and a reverse all-to-all and an fp32 sum of dK/dV
    in the backward. Every rank finds this alike from the plan (``selected_rows``: no foreign rows for the busiest
    reader), so every rank skips the collectives together and runs pass-KV's single step instead, as at W = 1
    (``_passkv.OneRank``: its schedule ends after the local step, and a call that is one block takes the direct
    path).

Note [Selective gather on tiles]
    Kernels work in tiles of 128 query rows x 128 keys, and a band whose diagonal cuts its tiles off their corners
    pays one more partial tile per tile row. In global order a rank's diagonal lies on tiles whenever its runs
    start on them; a compact buffer of the exact keys would not keep that: the sink window's rank reads 4 sinks
    then its halo, so its own keys start at 4099 and its joined flex call took 3.67 / 13.38 ms (forward /
    backward, 16K rows, H100) against 3.12 / 10.55 with them from 4224 = 33 x 128
    (``benchmarks/results/2026-11-28-h100-joined-alignment``). So where every run of the layout starts on a tile
    (``KEY_TILE``, locally and globally) each interval a rank reads widens to whole tiles of global positions: a
    compact row then sits at its global position's offset in its tile, at the cost of at most 254 more rows per
    interval (keys the planner's blocks hide). Layouts off tiles (tests' tiny shapes) read exactly the visible
    keys. A window of 4095 under the all-gather had its own keys one row off the tiles (at 4095): on tiles its
    busiest rank of 8 at 128K runs forward+backward 1-3% faster (13.39 -> 13.22 ms contiguous, 13.81 -> 13.41
    zigzag; ``benchmarks/results/2026-11-28-h100-window-allgather``).

One rank: the gather is the identity, so the call runs pass-KV's single step (``_passkv.OneRank``) with no
buffers or copies, ``heads_k_stride`` KV heads per kernel call (it still bounds the kernel's workspace). At
W = 1 on a packed 128K row the pipelined engine cost 1.15x the single-GPU varlen kernel (fwd+bwd, H100,
``benchmarks/results/2026-11-23-h100/run3``), its copies and fp32 dK/dV buffer included.

Windows, documents and end padding all come from the block planner; with a window a rank reads only the
keys the window shows (Note [Selective gather]) once that is at most ``SELECT_AT`` of the sequence.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass

import torch

from ..comm.all_gather import AllGather, AllToAllV, Handle
from ..comm.loop import Loop, run_steps
from ..cost import model
from ..errors import rank_suffix
from ..kernels import combine
from ..kernels.executor import TaskRunner, split_band
from ..kernels.merge import Accumulator
from ..kernels.side import beside_largest
from ..layouts import Layout, make_layout
from ..layouts.blocks import Rule, Run, Segments, Task, plan, union_spans
from ..memo import batch_memo
from ..numerics import GradRows, acc_dtype, wire_dtype
from . import _passkv
from .base import LONG_CONTEXT, BackwardInputs, Call, Method

__all__ = ["KEY_TILE", "METHOD", "SELECT_AT", "SELECT_PIECES", "GatherPlan", "Selection", "gather_plan", "local_keys",
           "needed_keys"]

SELECT_AT = 0.75
"""The selective gather runs when the busiest reader needs at most this share of the sequence."""
SELECT_PIECES = 512
"""Pieces of a named mask up to which the selective gather plans every rank's reads (Note [Selective gather]: W
plans over the whole sequence, 0.07 s of host time for 256 video frames at 1M over 8, 0.28 s for 512, 1.2 s for
1024, on a 2-core CPU: ``benchmarks/planning_host_time.py``; planned once per call signature). A mask of more
pieces gathers everything."""

PARTS = 4
"""A plain layout of at most this many runs per rank is gathered run by run (Note [Gather by parts])."""


Spans = tuple[tuple[int, int], ...]      # sorted, disjoint global intervals [start, stop)


@dataclass(frozen=True)
class Selection:
    """The rows of one rank's selective gather (Note [Selective gather]).

    Attributes:
        send: per destination rank, my ``(local row, count)`` pieces it reads, in global order.
        recv: per source rank, the ``(compact row, count)`` pieces it sends me, in arrival order.
        rows: rows of my compact buffer (the keys my queries read, in global order).
    """

    send: tuple[Spans, ...]
    recv: tuple[Spans, ...]
    rows: int


@dataclass(frozen=True)
class GatherPlan:
    """This rank's kernel calls against the gathered KV in global order, and how the rows get there.

    Attributes:
        tasks: calls of this rank's query rows against key rows of the global-order buffer (the compact
            buffer of the keys it reads under a ``selection``).
        chunk: rows per chunk of the rank-order -> global-order map.
        order: ``order[c]`` is the rank-order chunk holding global chunk c; None when they coincide.
        keys: the global positions of the buffer's rows, as intervals in row order.
        selection: the selective gather's rows, or None for the full all-gather.
        slots: one gather per part (Note [Gather by parts]): per part, ``(local start, rows, buffer offset)``
            of every rank's rows of that part and where they land; None for one gather of all local rows.
    """

    tasks: tuple[Task, ...]
    chunk: int
    order: tuple[int, ...] | None
    keys: Spans
    selection: Selection | None = None
    slots: tuple[tuple[int, int, int], ...] | None = None

    def key_positions(self, task: Task) -> list[int]:
        """The global positions of ``task``'s key rows."""
        pos = [g for a, b in self.keys for g in range(a, b)]
        return pos[task.k_start:task.k_stop]


def _chunk_order(layout: Layout, seq_len: int) -> tuple[int, tuple[int, ...] | None]:
    runs = [(j, r) for j in range(layout.world) for r in layout.segments(j, seq_len).runs]
    chunk = math.gcd(*(r.length for _, r in runs), *(r.glob for _, r in runs))
    local = seq_len // layout.world
    order = [0] * (seq_len // chunk)
    for j, r in runs:
        for t in range(r.length // chunk):
            order[(r.glob + t * chunk) // chunk] = (j * local + r.local + t * chunk) // chunk
    return chunk, None if order == sorted(order) else tuple(order)


KEY_TILE = 128
"""Key rows per kernel tile: a selective gather's intervals widen to whole tiles of global positions where every run
of the layout starts on one (Note [Selective gather on tiles])."""


def _tile(layout: Layout, seq_len: int) -> int:
    """``KEY_TILE`` where every rank's runs start on a tile, locally and globally; else 1 (no widening)."""
    runs = [r for j in range(layout.world) for r in layout.segments(j, seq_len).runs]
    return KEY_TILE if all(r.glob % KEY_TILE == 0 and r.local % KEY_TILE == 0 for r in runs) else 1


@batch_memo()
def needed_keys(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
                valid_len: int | None) -> Spans:
    """The global key positions rank ``rank``'s queries see, as merged intervals widened to whole tiles (Note
    [Selective gather], Note [Selective gather on tiles]). A named mask's keys are those of the blocks the planner
    keeps (empty blocks skipped: Note [Block planning])."""
    q = layout.segments(rank, seq_len).cut(doc_bounds, valid_len)
    if rule.pieces is not None:
        keys = Segments((Run(0, 0, seq_len),)).cut(doc_bounds, valid_len)
        spans = [(t.k_start, t.k_stop) for t in plan(q, keys, rule, fewest_calls=False)]
    else:
        bounds = doc_bounds if doc_bounds is not None else (0, seq_len if valid_len is None else valid_len)
        lo, hi = rule.delta_bounds()
        spans = []
        for r in q.runs:
            if r.doc < 0:
                continue
            a, b = bounds[r.doc], bounds[r.doc + 1]
            start = a if lo is None else max(a, r.glob + lo)
            stop = b if hi is None else min(b, r.glob + r.length + hi)
            if start < stop:
                spans.append((start, stop))
    t = _tile(layout, seq_len)
    return union_spans((a - a % t, min(seq_len, b + -b % t)) for a, b in spans)


def _held(layout: Layout, rank: int, seq_len: int) -> tuple[tuple[int, int, int], ...]:
    """Rank ``rank``'s rows as ``(global start, local start, count)`` runs in global order."""
    return tuple(sorted((r.glob, r.local, r.length) for r in layout.segments(rank, seq_len).runs))


def _intersect(held: tuple[tuple[int, int, int], ...], spans: Spans) -> list[tuple[int, int, int]]:
    """``(global start, local start, count)`` pieces of ``held`` inside ``spans``, in global order."""
    out, i = [], 0
    for g, loc, n in held:
        while i < len(spans) and spans[i][1] <= g:
            i += 1
        j = i
        while j < len(spans) and spans[j][0] < g + n:
            a, b = max(g, spans[j][0]), min(g + n, spans[j][1])
            out.append((a, loc + a - g, b - a))
            j += 1
    return out


def _selection(layout: Layout, rank: int, seq_len: int, needs: tuple[Spans, ...]) -> Selection:
    mine = needs[rank]
    starts = list(itertools.accumulate((b - a for a, b in mine), initial=0))

    def compact(g: int) -> int:
        i = bisect.bisect_right(mine, (g, math.inf)) - 1
        return starts[i] + g - mine[i][0]

    held = _held(layout, rank, seq_len)
    send = tuple(tuple((loc, n) for _, loc, n in _intersect(held, need)) for need in needs)
    recv = tuple(tuple((compact(g), n) for g, _, n in _intersect(_held(layout, j, seq_len), mine))
                 for j in range(layout.world))
    return Selection(send, recv, starts[-1])


@functools.lru_cache(maxsize=32)
def selected_rows(layout: Layout, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
                  valid_len: int | None = None) -> tuple[int, int] | None:
    """``(rows, foreign)``: the busiest reader's compact buffer and the rows it receives from other ranks, or
    None when the call gathers everything (Note [Selective gather]; the planner's traffic)."""
    if layout.world == 1 or (doc_bounds is None and valid_len is None and rule.window == (-1, -1)
                             and rule.pieces is None):
        return None
    if rule.pieces is not None and rule.pieces.pieces_within(seq_len, SELECT_PIECES) > SELECT_PIECES:
        return None                     # every rank's plan over the whole sequence: O(pieces^2) host work
    needs = [needed_keys(layout, r, seq_len, rule, doc_bounds, valid_len) for r in range(layout.world)]
    rows = [sum(b - a for a, b in n) for n in needs]
    if max(rows) > SELECT_AT * seq_len:
        return None
    own = [sum(n for _, _, n in _intersect(_held(layout, r, seq_len), needs[r])) for r in range(layout.world)]
    return max(rows), max(x - o for x, o in zip(rows, own))


@batch_memo()
def gather_plan(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
                valid_len: int | None) -> GatherPlan:
    """Rank ``rank``'s queries against the whole sequence in global order (Note [Gather into global order]),
    or against the keys they read when that is at most ``SELECT_AT`` of it (Note [Selective gather])."""
    if layout.segments(rank, seq_len).stride != 1:
        raise ValueError(f"method='allgather' needs a layout of consecutive runs, got {layout.name}")
    q = layout.segments(rank, seq_len).cut(doc_bounds, valid_len)
    if selected_rows(layout, seq_len, rule, doc_bounds, valid_len) is not None:
        needs = tuple(needed_keys(layout, r, seq_len, rule, doc_bounds, valid_len) for r in range(layout.world))
        sel = _selection(layout, rank, seq_len, needs)
        starts = itertools.accumulate((b - a for a, b in needs[rank]), initial=0)
        k = Segments(tuple(Run(at, a, b - a) for at, (a, b) in zip(starts, needs[rank])))
        tasks = plan(q, k.cut(doc_bounds, valid_len), rule) if k.runs else ()
        return GatherPlan(tasks, 1, None, needs[rank], sel)
    parts = _parts(layout, seq_len)
    if parts is not None:
        return min((_by_parts(layout, seq_len, q, rule, doc_bounds, valid_len, parts, buffer)
                    for buffer in itertools.permutations(range(len(parts)))),
                   key=lambda gp: len(gp.tasks) + sum(map(split_band, gp.tasks)))
    k = Segments((Run(0, 0, seq_len),)).cut(doc_bounds, valid_len)
    chunk, order = _chunk_order(layout, seq_len)
    return GatherPlan(plan(q, k, rule), chunk, order, ((0, seq_len),))


def _parts(layout: Layout, seq_len: int) -> tuple[tuple[int, int], ...] | None:
    """``(local start, rows)`` of the runs every rank holds alike - a plain layout of 2-4 runs per rank, like
    zigzag's two - or None (one run: the rank-major gather is global order already; per-batch layouts differ
    from rank to rank)."""
    shapes = {tuple((r.local, r.length) for r in layout.segments(j, seq_len).runs) for j in range(layout.world)}
    if len(shapes) != 1:
        return None
    (shape,) = shapes
    return shape if 2 <= len(shape) <= PARTS else None


def _by_parts(layout: Layout, seq_len: int, q: Segments, rule: Rule, doc_bounds: tuple[int, ...] | None,
              valid_len: int | None, parts: tuple[tuple[int, int], ...], buffer: tuple[int, ...]) -> GatherPlan:
    """The plan against a buffer holding part ``buffer[0]`` of every rank (in rank order), then part
    ``buffer[1]``, ... (Note [Gather by parts])."""
    W = layout.world
    runs, slots, at = [], {}, 0
    for p in buffer:
        slots[p] = (parts[p][0], parts[p][1], at)
        for j in range(W):
            r = layout.segments(j, seq_len).runs[p]
            runs.append(Run(at, r.glob, r.length))
            at += r.length
    k = Segments(tuple(runs))
    keys = tuple((r.glob, r.glob + r.length) for r in runs)
    return GatherPlan(plan(q, k.cut(doc_bounds, valid_len), rule), 1, None, keys,
                      slots=tuple(slots[p] for p in range(len(parts))))


COPY_RUNS = 128
"""A chunk permutation of at most this many strided runs is applied as that many copies, longer ones as one
``index_select`` (Note [Chunk copies])."""


@dataclass(frozen=True)
class _ChunkMap:
    """One chunk permutation (Note [Chunk copies]): destination chunk c = source chunk ``index[c]``, applied as a
    few strided copies (``runs``: ``(dst, src, step, count)``) or, with many runs, one ``index_select``."""

    n: int
    runs: tuple[tuple[int, int, int, int], ...] | None
    index: torch.Tensor | None

    @staticmethod
    def of(index: list[int], device: torch.device) -> _ChunkMap:
        runs: list[list[int]] = []
        for c, s in enumerate(index):
            last = runs[-1] if runs else None
            if last is not None and last[3] == 1 and s > last[1]:
                last[2], last[3] = s - last[1], 2                       # a run's second chunk fixes its step
            elif last is not None and last[3] > 1 and s == last[1] + last[2] * last[3]:
                last[3] += 1
            else:
                runs.append([c, s, 1, 1])
        if len(runs) <= COPY_RUNS:
            return _ChunkMap(len(index), tuple(tuple(r) for r in runs), None)
        return _ChunkMap(len(index), None, torch.tensor(index, dtype=torch.long, device=device))

    def apply(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` chunk c = ``src`` chunk ``index[c]`` (dim 0 cut into ``n`` chunks)."""
        a, b = src.view(self.n, -1), dst.view(self.n, -1)
        if self.runs is None:
            torch.index_select(a, 0, self.index, out=b)
            return
        for d, s, step, count in self.runs:
            b[d:d + count].copy_(a[s:s + step * (count - 1) + 1:step])


@dataclass(frozen=True)
class _ChunkIndex:
    """A ``GatherPlan.order`` as its two chunk maps, built once per planned call and held by it (a per-batch
    layout's order is one entry per chunk, up to one per token: never kept in a module-level cache).

    Attributes:
        to_global: global chunk c <- rank-order chunk ``order[c]``; to_rank: its inverse.
    """

    to_global: _ChunkMap
    to_rank: _ChunkMap

    @staticmethod
    def of(order: tuple[int, ...], device: torch.device) -> _ChunkIndex:
        inverse = [0] * len(order)
        for c, r in enumerate(order):
            inverse[r] = c
        return _ChunkIndex(_ChunkMap.of(list(order), device), _ChunkMap.of(inverse, device))


class _Gathered:
    """Double-buffered all-gather of one KV head chunk at a time, read back in global order (per-batch layouts)
    or part by part (Note [Gather by parts]).

    Buffers are sequence-major, ``(rows, B, stride, D + Dv)`` with K and V side by side on the last dim (Note
    [One KV message] in ``_shared``), so the rank-major gather concatenates along the sequence and the
    gathered K is the view ``(B, S, stride, D)``; with one head round and a batch of one, K and V travel apart
    in buffers of their own (Note [K and V apart]). ``recv[slot]`` is the slot's tuple of receive buffers.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, stride: int, ag: AllGather, chunks: _ChunkIndex | None,
                 slots: tuple[tuple[int, int, int], ...] | None = None):
        B, L, Hkv, D = k.shape
        self.k, self.v, self.stride, self.ag, self.chunks, self.slots, self.d = k, v, stride, ag, chunks, slots, D
        self.rounds = Hkv // stride
        self.rows = ag.world * L
        self.apart = self.rounds == 1 and B == 1 and k.is_contiguous() and v.is_contiguous()
        if self.apart:
            self.send = None
            self.recv = [(k.new_empty(self.rows, 1, Hkv, D), v.new_empty(self.rows, 1, Hkv, v.shape[-1]))]
        else:
            self.send = k.new_empty(L, B, stride, D + v.shape[-1])
            self.recv = [(k.new_empty(self.rows, B, stride, D + v.shape[-1]),) for _ in range(min(2, self.rounds))]
        self.glob = None if chunks is None else tuple(torch.empty_like(b) for b in self.recv[0])

    def post(self, c: int) -> Handle:
        """Post chunk c's gather, its parts coalesced with slots (Note [All-gather pipeline], Note [Gather by
        parts]): K and V as they lie (Note [K and V apart]), or packed into one send buffer."""
        recv = self.recv[c % len(self.recv)]
        if self.apart:
            sends = (self.k.transpose(0, 1), self.v.transpose(0, 1))
        else:
            hs = slice(c * self.stride, (c + 1) * self.stride)
            self.send[..., : self.d].copy_(self.k[:, :, hs].transpose(0, 1))
            self.send[..., self.d:].copy_(self.v[:, :, hs].transpose(0, 1))
            sends = (self.send,)
        return self.ag.gather_parts([p for s, r in zip(sends, recv) for p in _slot_pairs(s, r, self.slots,
                                                                                          self.ag.world)])

    def grads(self, grad_dtype: torch.dtype, loop: Loop) -> _DKV:
        """The matching dK/dV return: fp32 accumulators reduce-scattered to the owners."""
        return _DKV(self.k, self.v, self.stride, self.ag, self.rounds, self.chunks, grad_dtype, loop, self.slots)

    def kv(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk c's gathered ``k (B, S, stride, D), v (B, S, stride, Dv)`` in global order (after its wait)."""
        bufs = self.recv[c % len(self.recv)]
        if self.glob is not None:
            for b, g in zip(bufs, self.glob):
                self.chunks.to_global.apply(b, g)
            bufs = self.glob
        if self.apart:
            return bufs[0].transpose(0, 1), bufs[1].transpose(0, 1)
        return bufs[0][..., : self.d].transpose(0, 1), bufs[0][..., self.d:].transpose(0, 1)


def _slot_pairs(local: torch.Tensor, full: torch.Tensor, slots: tuple[tuple[int, int, int], ...] | None,
                world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Local rows and their W-rank buffer: all rows, or one pair per part (Note [Gather by parts]), to be posted as
    one coalesced collective (Note [Coalesced parts] in ``seqpar.comm.all_gather``)."""
    if slots is None:
        return [(local, full)]
    return [(local[a:a + n], full[o:o + world * n]) for a, n, o in slots]


class _DKV:
    """fp32 dK/dV of the gathered buffer per head chunk, and their pipelined reduce-scatter to the owners.

    ``start(c)`` gives chunk c's accumulator ``(S, B, stride, D + Dv)`` in the gathered buffer's order, not
    zeroed (the caller writes or zeroes every row: Note [First touch]);
    ``post(c)`` brings it to rank order in the wire dtype (a copy only when the order or the dtype differs) and
    posts the reduce-scatter into ``out[c]`` (its parts coalesced with slots: Note [Gather by parts]); ``finish`` waits
    and returns ``dk (B, L, Hkv, D), dv (B, L, Hkv, Dv)``.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, stride: int, ag: AllGather, rounds: int,
                 chunks: _ChunkIndex | None, grad_dtype: torch.dtype, loop: Loop,
                 slots: tuple[tuple[int, int, int], ...] | None = None):
        B, L, _, D = k.shape
        F = D + v.shape[-1]
        self.acc_dtype = acc_dtype(k.dtype)
        self.wire = wire_dtype(grad_dtype, k.dtype)
        self.chunks, self.shape, self.d, self.loop, self.ag = chunks, (B, L, k.shape[2], D, v.shape[-1]), D, loop, ag
        self.slots = slots
        self.direct = chunks is None and self.wire == self.acc_dtype     # reduce-scatter the accumulator
        nbuf = min(2, rounds)
        self.acc = [k.new_empty(ag.world * L, B, stride, F, dtype=self.acc_dtype)
                    for _ in range(nbuf if self.direct else 1)]
        self.send = [] if self.direct else [torch.empty_like(self.acc[0], dtype=self.wire) for _ in range(nbuf)]
        self.stage = (torch.empty_like(self.acc[0], dtype=self.wire)
                      if chunks is not None and self.wire != self.acc_dtype else None)
        self.out = k.new_empty(rounds, L, B, stride, F, dtype=self.wire)
        self.pending: list[Handle | None] = [None] * nbuf

    def _wait(self, slot: int) -> None:
        h = self.pending[slot]
        if h is not None:
            self.loop.wait([h])
            self.pending[slot] = None

    def start(self, c: int) -> torch.Tensor:
        """Chunk c's accumulator, not zeroed (Note [First touch])."""
        slot = c % len(self.pending)
        if self.direct:
            self._wait(slot)                   # its reduce-scatter still reads this accumulator
        return self.acc[c % len(self.acc)]

    def post(self, c: int) -> Handle:
        slot = c % len(self.pending)
        buf = self.acc[c % len(self.acc)]
        if not self.direct:
            self._wait(slot)
            send = self.send[slot]
            if self.chunks is None:
                send.copy_(buf)
            elif self.stage is None:
                self.chunks.to_rank.apply(buf, send)
            else:
                self.stage.copy_(buf)
                self.chunks.to_rank.apply(self.stage, send)
            buf = send
        self.pending[slot] = self.ag.reduce_scatter_parts(
            [(w, p) for p, w in _slot_pairs(self.out[c], buf, self.slots, self.ag.world)])
        return self.pending[slot]

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        for slot in range(len(self.pending)):
            self._wait(slot)
        B, L, Hkv, D, Dv = self.shape
        g = self.out.permute(2, 1, 0, 3, 4)                # (n, L, B, s, F) -> (B, L, n, s, F)
        g = g.reshape(B, L, Hkv, D + Dv)
        return g[..., :D].to(dtype), g[..., D:].to(dtype)


def _rows(pieces) -> torch.Tensor:
    """The row indices of ``(start, count)`` pieces, concatenated (int64, on the host)."""
    flat = [p for part in pieces for p in part]
    if not flat:
        return torch.empty(0, dtype=torch.long)
    start, count = torch.tensor(flat, dtype=torch.long).T
    offset = torch.cumsum(count, 0) - count
    return torch.arange(int(count.sum())) + torch.repeat_interleave(start - offset, count)


@dataclass(frozen=True)
class _SelectionIndex:
    """A ``Selection`` as device index tensors, built once per planned call (no host work per call).

    Attributes:
        send_rows: my local rows, destination by destination; send_splits / recv_splits: rows per peer.
        place: the compact row of each arrival, and order its inverse (compact row i <- arrival order[i]);
            both None when arrivals already come in compact order.
        rows: rows of the compact buffer.
    """

    send_rows: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    place: torch.Tensor | None
    order: torch.Tensor | None
    rows: int

    @staticmethod
    def of(sel: Selection, device: torch.device) -> _SelectionIndex:
        place = _rows(sel.recv)
        ordered = torch.equal(place, torch.arange(sel.rows))
        return _SelectionIndex(_rows(sel.send).to(device), [sum(n for _, n in part) for part in sel.send],
                               [sum(n for _, n in part) for part in sel.recv], None if ordered else place.to(device),
                               None if ordered else torch.argsort(place).to(device), sel.rows)


class _Selected:
    """Double-buffered selective gather of one KV head chunk at a time (Note [Selective gather]): the same
    interface as ``_Gathered``, the received rows read back as the compact buffer in global order."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, stride: int, a2a: AllToAllV, idx: _SelectionIndex):
        B, _, _, D = k.shape
        F = D + v.shape[-1]
        self.k, self.v, self.stride, self.a2a, self.idx, self.d = k, v, stride, a2a, idx, D
        self.rounds = k.shape[2] // stride
        self.rows = idx.rows
        self.send = k.new_empty(len(idx.send_rows), B, stride, F)
        self.recv = [k.new_empty(idx.rows, B, stride, F) for _ in range(min(2, self.rounds))]
        self.glob = None if idx.order is None else torch.empty_like(self.recv[0])

    def post(self, c: int) -> Handle:
        hs, idx = slice(c * self.stride, (c + 1) * self.stride), self.idx
        self.send[..., : self.d].copy_(self.k[:, :, hs].index_select(1, idx.send_rows).transpose(0, 1))
        self.send[..., self.d:].copy_(self.v[:, :, hs].index_select(1, idx.send_rows).transpose(0, 1))
        return self.a2a.exchange(self.send, self.recv[c % len(self.recv)], idx.send_splits, idx.recv_splits)

    def grads(self, grad_dtype: torch.dtype, loop: Loop) -> _SelectedDKV:
        """The matching dK/dV return: the reverse all-to-all, added into the owners' rows."""
        return _SelectedDKV(self, grad_dtype, loop)

    def kv(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self.recv[c % len(self.recv)]
        if self.idx.order is not None:
            torch.index_select(buf, 0, self.idx.order, out=self.glob)
            buf = self.glob
        return buf[..., : self.d].transpose(0, 1), buf[..., self.d:].transpose(0, 1)


class _SelectedDKV:
    """fp32 dK/dV of the compact buffer per head chunk, returned to the owners by the reverse all-to-all and
    added into their rows (the adjoint of ``_Selected``); the same interface as ``_DKV``."""

    def __init__(self, sel: _Selected, grad_dtype: torch.dtype, loop: Loop):
        B, L, Hkv, D = sel.k.shape
        F = D + sel.v.shape[-1]
        self.sel, self.loop, self.shape = sel, loop, (B, L, Hkv, D, sel.v.shape[-1])
        self.acc_dtype = acc_dtype(sel.k.dtype)
        self.wire = wire_dtype(grad_dtype, sel.k.dtype)
        nbuf = min(2, sel.rounds)
        self.acc = sel.k.new_empty(sel.recv[0].shape, dtype=self.acc_dtype)
        self.send = [torch.empty_like(self.acc, dtype=self.wire) for _ in range(nbuf)]
        self.out = sel.k.new_empty(sel.rounds, len(sel.idx.send_rows), B, sel.stride, F, dtype=self.wire)
        self.pending: list[Handle | None] = [None] * nbuf

    def start(self, c: int) -> torch.Tensor:
        """The accumulator, not zeroed (Note [First touch])."""
        return self.acc

    def post(self, c: int) -> Handle:
        slot = c % len(self.pending)
        h = self.pending[slot]
        if h is not None:
            self.loop.wait([h])                  # the exchange two chunks back still reads this send buffer
        send, idx = self.send[slot], self.sel.idx
        if idx.place is None:
            send.copy_(self.acc)
        elif self.wire == self.acc_dtype:
            torch.index_select(self.acc, 0, idx.place, out=send)
        else:
            send.copy_(self.acc.index_select(0, idx.place))
        self.pending[slot] = self.sel.a2a.exchange(send, self.out[c], idx.recv_splits, idx.send_splits)
        return self.pending[slot]

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        for slot, h in enumerate(self.pending):
            if h is not None:
                self.loop.wait([h])
                self.pending[slot] = None
        B, L, Hkv, D, Dv = self.shape
        sel, idx = self.sel, self.sel.idx
        g = self.out.new_zeros(sel.rounds, L, B, sel.stride, D + Dv, dtype=self.acc_dtype)
        at = 0
        for n in idx.send_splits:                # one reader at a time: unique rows, a deterministic sum
            if n:
                g.index_add_(1, idx.send_rows[at:at + n], self.out[:, at:at + n].to(self.acc_dtype))
            at += n
        g = g.permute(2, 1, 0, 3, 4).reshape(B, L, Hkv, D + Dv)
        return g[..., :D].to(dtype), g[..., D:].to(dtype)


@functools.lru_cache(maxsize=32)
def _first_touch(tasks: tuple[Task, ...], rows: int
                 ) -> tuple[tuple[tuple[tuple[int, int, bool], ...], ...], tuple[tuple[int, int], ...]]:
    """Note [First touch]: per task, its key rows as ``(start, stop, add)`` pieces - ``add`` where an earlier task
    wrote them, a copy where none did - and the rows of ``[0, rows)`` no task writes (zeroed)."""
    touched: Spans = ()
    program = []
    for t in tasks:
        a, b, at, pieces = t.k_start, t.k_stop, t.k_start, []
        for lo, hi in touched:
            if hi <= at or lo >= b:
                continue
            if lo > at:
                pieces.append((at, lo, False))
            pieces.append((max(lo, at), min(hi, b), True))
            at = min(hi, b)
        if at < b:
            pieces.append((at, b, False))
        program.append(tuple(pieces))
        touched = union_spans([*touched, (a, b)])
    bounds = [0, *(x for span in touched for x in span), rows]
    zero = tuple((bounds[i], bounds[i + 1]) for i in range(0, len(bounds), 2) if bounds[i] < bounds[i + 1])
    return tuple(program), zero


@functools.lru_cache(maxsize=32)
def _in_one_pass(tasks: tuple[Task, ...], rows: int, grad_bytes: int, acc_bytes: int) -> bool:
    """Note [Overlapping calls in one pass]: some call adds to rows an earlier one wrote, and the calls'
    gradients (``grad_bytes`` an element) fit in the accumulator's ``rows`` (``acc_bytes`` an element)."""
    touch, _ = _first_touch(tasks, rows)
    adds = any(add for pieces in touch for _, _, add in pieces)
    return adds and sum(t.cols for t in tasks) * grad_bytes <= rows * acc_bytes


@functools.lru_cache(maxsize=32)
def _disjoint(tasks: tuple[Task, ...]) -> bool:
    """No query row is in two calls (always so for a global-order plan unless varlen packing interleaves)."""
    spans = sorted((t.q_start, t.q_stop) for t in tasks)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def _stride(options, kv_heads: int) -> int:
    s = dict(options).get("heads_k_stride")
    if s is None:
        return kv_heads
    if isinstance(s, bool) or not isinstance(s, int) or s < 1 or kv_heads % s:
        raise ValueError(f"heads_k_stride must be None or a positive divisor of the KV heads ({kv_heads}), "
                         f"got {s!r}{rank_suffix()}")
    return s


def _check(call: Call) -> None:
    _stride(call.cfg.options, call.k_shape[2])


class _Engine:
    """All-gather KV per head chunk (Note [All-gather pipeline]) on the runtime's ``run_steps``."""

    saves = False

    def __init__(self, call: Call):
        cfg = call.cfg
        self.gp = gather_plan(call.layout, call.index, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        self.runner = TaskRunner.of(call)
        self.stride = _stride(cfg.options, call.k_shape[2])
        self.G = call.q_shape[2] // call.k_shape[2]
        self.groups, self.grad_dtype = call.groups, cfg.grad_dtype
        sel = self.gp.selection
        self.index = None if sel is None else _SelectionIndex.of(sel, call.device)
        self.chunks = None if self.gp.order is None else _ChunkIndex.of(self.gp.order, call.device)

    def _transport(self, k: torch.Tensor, v: torch.Tensor) -> _Gathered | _Selected:
        """The full all-gather, or the selective one when the plan has a selection."""
        if self.index is None:
            return _Gathered(k, v, self.stride, AllGather(self.groups.group), self.chunks, self.gp.slots)
        return _Selected(k, v, self.stride, AllToAllV(self.groups.group), self.index)

    def _heads(self, c: int) -> slice:
        return slice(c * self.stride * self.G, (c + 1) * self.stride * self.G)

    def forward(self, q, k, v):
        """``(out (B, L, H, Dv) in q.dtype, lse (B, H, L) fp32)``."""
        runner, G, stride = self.runner, self.G, self.stride
        B, L, H, _ = q.shape
        acc = acc_dtype(q.dtype)
        tasks = runner.prepare(self.gp.tasks, q[:, :, : stride * G], k[:, :, :stride])   # the same for every chunk
        direct = _disjoint(tasks)       # every row in at most one call: write results, no merge
        gathered = self._transport(k, v)
        # with one head round, one call over every row (a joined mask, full attention) or the round's merge is
        # the result itself: nothing is zero-filled or copied
        one_round = gathered.rounds == 1
        alone = one_round and len(tasks) == 1 and (tasks[0].q_start, tasks[0].q_stop) == (0, L)
        whole = not direct and one_round
        out = lse = None
        if direct and not alone:        # rows no call writes stay (0, -inf)
            out = torch.zeros(B, L, H, v.shape[-1], dtype=q.dtype, device=q.device)
            lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
        elif not (direct or whole):     # each round's merge writes all rows of its heads
            out = torch.empty(B, L, H, v.shape[-1], dtype=q.dtype, device=q.device)
            lse = torch.empty((B, H, L), dtype=acc, device=q.device)
        with Loop() as loop:
            handles = [loop.post(gathered.post(0))]

            def compute(c: int) -> None:
                nonlocal out, lse
                kc, vc = gathered.kv(c)
                qh = self._heads(c)
                qc = q[:, :, qh]
                parts = Accumulator(qc, v.shape[-1], defer=True)     # rows in two calls: one merge per round
                results = beside_largest(tasks, lambda t: runner.forward(qc, kc, vc, t), q.device)
                for t, (o, l) in zip(tasks, results):
                    if alone:
                        out, lse = o.to(q.dtype), l.to(acc)
                    elif direct:
                        out[:, t.q, qh] = o
                        lse[:, qh, t.q] = l
                    else:
                        parts.add(t.q, o, l, t.covered)
                if whole:
                    out, lse = parts.result(q.dtype)
                elif not direct:
                    out[:, :, qh], lse[:, qh] = parts.result(q.dtype)

            def post(c: int):
                loop.wait(handles[c])             # chunk c arrived (and its send buffer is free again)
                if c + 1 < gathered.rounds:       # chunk c+1's gather in flight while chunk c computes
                    handles.append(loop.post(gathered.post(c + 1)))
                return None

            run_steps(gathered.rounds, post=post, compute=compute, loop=loop)
        return out, lse

    def backward(self, b: BackwardInputs):
        """Re-gather per head chunk, local block backward, fp32 dK/dV reduce-scattered to the owners."""
        q, k, v, rows = b.q, b.k, b.v, b.rows
        runner, G, stride = self.runner, self.G, self.stride
        gathered = self._transport(k, v)
        dq = torch.empty_like(q)       # each round's dQ partials summed into its heads in one pass
        tasks = runner.prepare(self.gp.tasks, q[:, :, : stride * G], k[:, :, :stride])
        touch, zero = _first_touch(tasks, gathered.rows)
        one_pass = _in_one_pass(tasks, gathered.rows, k.element_size(), acc_dtype(k.dtype).itemsize)
        with Loop() as loop:
            grads = gathered.grads(self.grad_dtype, loop)
            handles = [loop.post(gathered.post(0))]
            d = k.shape[-1]

            def compute(c: int) -> None:
                kc, vc = gathered.kv(c)
                qh = self._heads(c)
                hrows = GradRows(rows.do[:, :, qh], rows.out[:, :, qh], None if rows.dlse is None
                                 else rows.dlse[:, qh])
                dkv = grads.start(c)
                if one_pass:                    # every call's gradients held, then summed once
                    res = beside_largest(tasks, lambda t: runner.backward(hrows, q[:, :, qh], kc, vc,
                                                                           b.lse[:, qh], t), q.device)
                    dqs = [(t.q, g[0]) for t, g in zip(tasks, res)]
                    for i, part in ((1, dkv[..., :d]), (2, dkv[..., d:])):
                        out = part.transpose(0, 1)              # (rows, B, Hkv, .) as (B, rows, Hkv, .)
                        combine.sum_parts([(t.k, g[i]) for t, g in zip(tasks, res)], tuple(out.shape), out.dtype,
                                          out=out)
                else:                           # first touch: each call's dK/dV copied or added, then freed
                    for a, z in zero:
                        dkv[a:z].zero_()
                    dqs = []
                    for t, pieces in zip(tasks, touch):
                        gq, gk, gv = runner.backward(hrows, q[:, :, qh], kc, vc, b.lse[:, qh], t)
                        dqs.append((t.q, gq))
                        for a, z, add in pieces:
                            for part, g in ((dkv[a:z, ..., :d], gk), (dkv[a:z, ..., d:], gv)):
                                g = g[:, a - t.k_start:z - t.k_start].transpose(0, 1)
                                if add:
                                    part.add_(g)
                                else:
                                    part.copy_(g)
                dq_c = dq[:, :, qh]
                combine.sum_parts(dqs, tuple(dq_c.shape), q.dtype, out=dq_c)

            def post(c: int):
                loop.wait(handles[c])
                if c + 1 < gathered.rounds:
                    handles.append(loop.post(gathered.post(c + 1)))
                return None

            def post_after(c: int) -> None:   # chunk c's reduce-scatter runs behind chunk c+1 (waited by _DKV)
                loop.post(grads.post(c))

            run_steps(gathered.rounds, post=post, compute=compute, post_after=post_after, loop=loop)
            dk, dv = grads.finish(k.dtype)
        return dq, dk, dv


def _engine(call: Call):
    """The pipelined all-gather; on one rank, or where no rank reads another's keys (Note [Local keys]), pass-KV's
    single step (the gather is the identity there)."""
    cfg = call.cfg
    if call.groups.world == 1 or local_keys(call.layout, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len):
        return _passkv.OneRank(call, _stride(cfg.options, call.k_shape[2]))
    return _Engine(call)


def local_keys(layout: Layout, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
               valid_len: int | None = None) -> bool:
    """Whether no rank's queries see a key another rank holds (Note [Local keys]); every rank finds the same."""
    sel = selected_rows(layout, seq_len, rule, doc_bounds, valid_len)
    return sel is not None and sel[1] == 0


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """All-gather K, V per head chunk; reduce-scatter dK, dV (ALGORITHMS.md §4, Note [All-gather pipeline]);
    with documents or windows, the selective gather's uneven all-to-alls (Note [Selective gather])."""
    W, S, L = p.world, p.seq_len, p.seq_len / p.world
    stride = c.option("heads_k_stride") or p.kv_heads
    nc = p.kv_heads // stride
    heads = stride * p.group_ratio
    blocks = model.gather_blocks_of(p, c.layout)
    sel = selected_rows(make_layout(c.layout, W, p.documents), S, p.rule, p.documents) if W > 1 else None
    if sel is not None and sel[1] == 0:                 # Note [Local keys]: pass-KV's single step, no collective
        cost = model.passkv(p, m, c.layout, W, p.heads, p.kv_heads, model.Group(W), "allgather")
        cost.notes.append("no rank reads another's keys: the local step alone (Note [Local keys])")
        return cost.prediction()
    rows, foreign = (S, (W - 1) * L) if sel is None else sel
    gather, scatter = ("allgather", "reduce_scatter") if sel is None else ("a2a", "a2a")
    # Note [Gather into global order]: only a per-batch layout's full gather permutes (contiguous arrives in order,
    # a plain layout gathers by parts, the selective gather in the order it reads: Note [Gather by parts])
    permutes = W > 1 and sel is None and c.layout != "contiguous" and \
        _parts(make_layout(c.layout, W, p.documents), S) is None
    perm = m.permute_ms(p.batch * rows * 2 * stride * p.head_dim) if permutes else 0.0
    cf = sum(m.kernel_ms(p, blk, heads) for blk in blocks) + perm
    cb = sum(m.kernel_ms(p, blk, heads, "bwd") for blk in blocks) + 2 * perm \
        + m.hbm_ms(sum(p.act(blk.cols, 2 * stride, 8) for blk in blocks))           # KV into order, dK/dV back
    g_bytes = p.act(foreign, 2 * stride)
    r_bytes = p.act(foreign, 2 * stride, p.grad_bytes)
    grp = model.Group(W)
    t_ag, t_rs = m.comm_ms(gather, g_bytes, grp), m.comm_ms(scatter, r_bytes, grp)
    f, b = model.tallies(m, "allgather")
    f.wait(t_ag, g_bytes)                                                 # the first chunk's gather
    for i in range(nc):
        more = i + 1 < nc
        f.step(cf, t_ag if more else 0.0, gather, g_bytes if more else 0.0)
    b.wait(t_ag, g_bytes)                                                 # backward re-gathers
    for i in range(nc):
        comm = (t_ag if i + 1 < nc else 0.0) + (t_rs if i else 0.0)
        b.step(cb, comm, gather, (g_bytes if i + 1 < nc else 0.0) + (r_bytes if i else 0.0))
    b.wait(t_rs, r_bytes)
    bufs = 2 if nc > 1 else 1
    gathered = bufs * p.act(rows, 2 * stride)
    fb, bb = model.base_mem(p)
    cost = model.Cost(f, b, fb + gathered + p.act(L, p.heads),
                      bb + gathered + bufs * p.act(rows, 2 * stride, 4) + p.act(L, p.heads, 4))
    if nc == 1:
        cost.notes.append("one round: the gather is exposed; the gathered KV is held")
    else:
        cost.notes.append(f"{nc} head chunks pipelined (heads_k_stride={stride})")
    if sel is not None:
        cost.notes.append(f"selective gather: the busiest reader holds {rows / S:.0%} of the keys and receives "
                          f"{foreign / S:.0%} from other ranks")
    if p.shaped:
        cost.balance = model.balance(p, c.layout, W)
        cost.notes.append(f"busiest rank {cost.balance[0]:.2f}x the mean work")
    elif p.causal and c.layout == "contiguous" and W > 1:
        cost.notes.append(f"contiguous causal: the last rank does {2 * W - 1} of {W} average units")
    return cost.prediction()


def _candidates(p: model.Problem, topo, layouts: tuple[str, ...], ulysses: int | None) -> list:
    """Each layout with all KV heads in one round, and in rounds of Hkv/2, Hkv/4 and 1 head."""
    strides = [None] + [s for s in sorted({p.kv_heads // 2, p.kv_heads // 4, 1}, reverse=True)
                        if 0 < s < p.kv_heads and p.kv_heads % s == 0]
    return [model.Candidate("allgather", lay, options=() if s is None else (("heads_k_stride", s),))
            for lay in layouts for s in strides]


def _bench_specs(preset, world: int) -> list:
    """The balanced layout, in one round and in rounds of Hkv/4 heads; one head a round at 1M tokens."""
    if preset.seq_len >= LONG_CONTEXT:
        return [("zigzag", (("heads_k_stride", 1),), None)]
    lay = "zigzag" if preset.causal else "contiguous"
    stride = max(1, preset.kv_heads // 4)
    return [(lay, (), None)] + ([(lay, (("heads_k_stride", stride),), None)] if stride < preset.kv_heads else [])


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    return [dict(layout="contiguous"), dict(layout="zigzag"), dict(layout="zigzag", cu_seqlens=documents),
            dict(layout="balanced_whole", cu_seqlens=documents)]


METHOD = Method(
    name="allgather",
    summary="all-gather K, V per head chunk; reduce-scatter dK/dV (fp32)",
    layouts=("contiguous", "zigzag", "balanced", "balanced_whole", "doc_zigzag", "doc_contiguous"),
    packed_layout="balanced_whole",
    options={"heads_k_stride": None},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "mask",
                        "document_layouts"}),
    check=_check,
    engine=_engine,
    cost=_cost,
    candidates=_candidates,
    bench_specs=_bench_specs,
    demo_cases=_demo_cases,
)
