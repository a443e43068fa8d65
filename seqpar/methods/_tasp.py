"""The TASP engine (ALGORITHMS.md §8): KV in W-1 sub-chunks on every link of a full mesh at every round.

Private: the host-side schedule (``schedule``, cached) and the forward/backward loops behind ``tasp``.

Note [TASP rounds]
    Every rank's KV is cut into W-1 sub-chunks (``layouts.subchunks.Subchunked``: zigzag sub-chunk c is
    part c of the front chunk plus part c of the back chunk; each part is a *piece*, one message). Round
    0 is the rank's own block; in each round t = 1 .. W-1 every rank sends one sub-chunk to every other
    rank and receives one from each, so every link of the mesh carries ‖KV‖ / (W-1) per round:

    * "cycles": the W-1 arc-disjoint Hamiltonian cycles of ``comm.topology``; sub-chunk g of every rank
      travels on cycle g, one hop per round (store and forward), so at round t rank r holds sub-chunk g
      of the rank t places before it on cycle g. Needs W not in {4, 6}.
    * "direct": the staggered all-to-all, origin o sends its own sub-chunk ``c(o, p, t)`` straight to p
      (§8.4); any W, no forwarding, so a round's sends never wait on the previous round's receives.

    Received pieces are laid out in the round buffer in global-position order and planned piece by piece
    (``layouts.blocks.plan``); full calls on the same query rows over adjacent pieces are joined. For
    zigzag causal that gives at most two kernel calls per round - all queries x the front pieces of lower
    ranks ("M"), back queries x everything of higher ranks ("P") - exactly TASP's M/P split, derived from
    positions rather than tables. In "direct" rounds a piece no query of the receiver sees (causal: the
    back pieces of lower ranks) is not sent at all. Each rank plans only its own rounds: both ends of a
    link decide what it carries from the same facts, and each end knows its own buffer rows.

    Backward (§8.5): dQ accumulates locally in fp32. "direct": each round's dK/dV partials go straight
    back to their origin one round later (a reverse all-to-all in the next round's exchange) and are
    summed there in fp32. "cycles": the running dK/dV of every piece follows the piece on its cycle one
    round behind (each holder adds what arrives after its own compute), and the last holder's successor
    is the origin, so the final hop is home. The last return overlaps the back half of the own block (Note [Hiding the
    tail] in ``_shared``).

Note [TASP forward at short chunks]
    A rank between the ends holds two kinds of pieces a round - for zigzag causal, lower ranks' front pieces that
    all its queries see, higher ranks' pieces that its back queries see - so its rounds ran two calls each, and at
    2K tokens per rank over 8 rank 1's all-query call had 146 keys: cuDNN pays a call's fixed cost and a wave of
    query tiles for a sliver of work (rank 1's forward took 0.81 ms of GPU time where the ring's took 0.54). At most
    ``GATHER_MAX_ROWS`` local rows (and ``GATHER_BYTES`` of what the backward would hold), the "direct" schedule
    receives every round into one buffer instead (``Gathered``): pieces all of whose tasks are full blocks are
    grouped by the query rows that see them (a class), each class's pieces laid out round after round, and its keys
    run in (keys // ``GATHER_ROWS``) calls per query range - one at least, one a round at most - a call running once
    its share of the keys has arrived; other pieces (windows, documents, masks) keep their round's calls. Sends and
    receipts are the rounds' own, so transfers still overlap compute; the memory is an all-gather's, bounded by the
    row and byte limits. With groups of 1024 keys rank 1's forward went from 16 calls to 10 and rank 3's to 12; with
    4096 (the backward's measure, below) no rank ran more than 6; with 8192, at 2K and 4K tokens per rank (over 8
    and 4) every class is one call after the last round - TASP's transfers, an all-gather's calls - and a rank runs
    at most 3 (its own block, a class of each kind). On a real link a larger group leaves more of a class's work
    behind its last round, but there the own block covers the rounds (a round is mostly latency at these lengths)
    and each call saved is a fixed cost and a backward's two passes over its query rows: 8192 against 4096, on four
    real H100s at 4K tokens per GPU, took TASP from 0.38 / 0.48 to 0.44-0.45 / 0.53-0.54 (MHA, forward / forward and
    backward) and 0.56-0.60 / 0.57-0.58 to 0.59-0.63 / 0.66 (GQA), with no change at 2K; emulated (one H100), from
    0.78 / 0.73 to 0.86 / 0.77 (MHA, 4K per rank) and 0.71 / 0.65 to 0.78 / 0.73 (MHA, 2K per rank over 8)
    (``benchmarks/results/2026-11-27-h100-tasp-kv-apart``).

Note [TASP backward at short chunks]
    The backward at the same lengths runs on the same ``Gathered`` plan: a cuDNN backward call also passes over its
    query rows before and after its kernel (dO . O, dQ's conversion: 8-16 us each at 2K rows), so at 2K tokens per
    rank over 8 rank 1 ran 17 backward calls where the ring runs 8, and its kernels took 1.9 ms where the ring's
    took 1.3 (H200, before the gathering). Its partials cannot go home one round after their piece, as the rounds'
    backward sends them: a call's dK/dV spans pieces of several rounds and origins, and the origin would have to
    know every holder's groups. So every call's partials are held, and each piece's rows go home in one exchange
    behind the own block's rest - the all-gather's reduce-scatter, in TASP's pairs. A link where each piece is exact
    in the inputs' dtype (one call per key row, a kernel that returns that dtype: ``_shared.exact_partial``, decided
    by both ends from the holder's tasks on the piece) carries the calls' own rows in it (Note [TASP K and V apart]);
    on the others the partials are summed once into one buffer that travels in the wire's dtype: in bf16 fp32 sums,
    receipts and their passes everywhere would move twice the bytes. The origin lands each
    sender's pieces in a buffer of its own and sums them once with its own block's partials (Note [TASP sums]).
    Emulated on an H100, with both passes gathered in groups of 4096 keys, rank 1's forward+backward at 2K tokens
    per rank over 8 went from 3.91 to 2.64 ms (GQA) and 4.20 to 2.93 (MHA), its forward from 0.74 to 0.62 and 0.81
    to 0.67 (``benchmarks/results/2026-11-26-h100-tasp-gathered-bwd``).

Note [TASP K and V apart]
    K and V travel as two messages a piece and land in a buffer each, as the ring's and the all-gather's do (Note [K
    and V apart] in ``allgather``): with a batch of one our K and V already are sequence-major rows, so a piece is sent
    from the inputs as they lie. Packed into one buffer, every forward and every backward's re-gather first copied
    them (two sequence-major copies and a concatenation: 90 us of a 1.09 ms forward, MHA at 4K tokens per rank over 4
    on an H100). The gathered backward's partials go home the same way on an exact link (Note [TASP backward at
    short chunks]): each piece's rows of the one call that covers them, dK and dV as two messages, with no pass
    before they go - where they were first summed into one buffer of dK and dV side by side (two passes over the
    gathered rows: 62 + 63 us of the same backward). Links that are not exact still sum, dK and dV side by side in the
    wire's dtype, as do the rounds' backward partials (``_packed_shape``). Together: GPU time of rank 1's
    forward+backward 4.37 -> 4.13 ms there, 2.58 -> 2.34 ms at 2K tokens per rank over 8
    (``benchmarks/results/2026-11-27-h100-tasp-kv-apart``).

Note [TASP sums]
    The backward's dQ partials are fresh kernel outputs, held and summed once (``RowSum``, Note [One merge per
    call] in ``seqpar.kernels.combine``), and a round's dK/dV partials are summed straight into that round's fp32
    buffer (``sum_parts(out=)``: rows no task covers zero) before the relayed arrivals are added, where every
    task used to add into zeroed fp32 accumulators - element-wise passes of the size of the attention kernels'
    own work at 2K tokens per rank (the same change took TokenRing's forward+backward from 0.44 to 0.49 there,
    Note [Pass-Q sums] in ``_passq``). The partials that come home are held the same way: each round's land in a
    buffer of their own, each run of adjacent rows one partial, and this rank's dK and dV are summed once with its
    own block's partials - where every arriving piece was added into an fp32 dK/dV (at 2K tokens per rank over 8,
    56 small adds a backward). Past ``GATHER_MAX_ROWS`` local rows a round buffer each would cost more memory than the
    adds cost time, so there the arrivals land in one buffer and are folded into an fp32 running sum each round
    (``RowSum.fold``), as the adds did.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import topology
from ..comm.loop import Loop, run_steps
from ..comm.ring import Exchange
from ..kernels import combine
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator, RowSum
from ..layouts.blocks import Band, Rule, Task, plan, slice_rows
from ..layouts.subchunks import Subchunked
from ..memo import batch_memo
from ..numerics import GradRows, acc_dtype, wire_dtype
from ._shared import bshd, exact_partial, split_own, unpack_kv

__all__ = ["Gathered", "Hop", "Piece", "Round", "Tasp", "TaspPlan", "gathers", "schedule"]


@dataclass(frozen=True)
class Piece:
    """Rows ``rows`` of ``origin``'s KV: piece ``part`` of its sub-chunk ``sub``; first global position ``start``."""

    origin: int
    sub: int
    part: int
    rows: tuple[int, int]
    start: int


@dataclass(frozen=True)
class Hop:
    """One message carrying ``piece`` from ``src`` to ``dst``.

    The sender knows ``src_rows`` (in its own KV if ``from_own``, else in its previous round's buffer; for
    gradients in its dK/dV buffer of the round); the receiver knows ``dst_rows`` (in its round buffer; for
    gradients in its own dK/dV if ``home``, else in its next round's buffer). The other side is None.
    """

    src: int
    dst: int
    piece: Piece
    src_rows: tuple[int, int] | None = None
    dst_rows: tuple[int, int] | None = None
    from_own: bool = False
    home: bool = False


@dataclass(frozen=True)
class Round:
    """One rank's part of one round t >= 1.

    Attributes:
        held: the pieces in the round buffer, in buffer (global position) order, at rows ``held_rows``.
        rows: rows of the buffer in use.
        tasks: kernel calls: query rows local, key rows in the round buffer.
        kv_in, kv_out: the hops that fill round buffers (posted one round earlier), received / sent by us.
        grad_in, grad_out: hops that carry this round's dK/dV partials (posted with the next round).
    """

    held: tuple[Piece, ...]
    held_rows: tuple[tuple[int, int], ...]
    rows: int
    tasks: tuple[Task, ...]
    kv_in: tuple[Hop, ...]
    kv_out: tuple[Hop, ...]
    grad_in: tuple[Hop, ...]
    grad_out: tuple[Hop, ...]


@dataclass(frozen=True)
class Gathered:
    """A pass at short chunks (Notes [TASP forward at short chunks], [TASP backward at short chunks]): every round's
    pieces land in one buffer of ``rows`` rows. ``kv_rows[t - 1]``: where round t's ``kv_in`` hops land, in their
    order; ``tasks[t - 1]``: the calls that run once round t has arrived, key rows in the buffer. The backward's
    partials go home in one exchange: ``grad_out`` = (origin, rows in the buffer, the holder's tasks on the piece)
    and ``grad_in`` = (sender, rows of our KV, the sender's tasks on the piece), each in one order on both ends of a
    link (by peer, then the piece's first position); the tasks decide a link's dtype (``Tasp._links``)."""

    rows: int
    kv_rows: tuple[tuple[tuple[int, int], ...], ...]
    tasks: tuple[tuple[Task, ...], ...]
    grad_out: tuple[tuple[int, tuple[int, int], tuple[Task, ...]], ...] = ()
    grad_in: tuple[tuple[int, tuple[int, int], tuple[Task, ...]], ...] = ()


@dataclass(frozen=True)
class TaspPlan:
    """One rank's schedule: ``rounds[t - 1]`` for t = 1 .. W-1, its own block's tasks - whole (``own``: the forward,
    and W = 1) and split in two (``early``, ``late``: the backward, Note [Hiding the tail] in ``_shared``) - and the
    gathered form both passes run at short chunks (``Gathered``, else None)."""

    world: int
    kind: str
    own: tuple[Task, ...]
    early: tuple[Task, ...]
    late: tuple[Task, ...]
    rounds: tuple[Round, ...]
    gathered: Gathered | None = None


class _Geometry:
    """Positions, pieces and per-piece plans of one (layout, length, rule): host-side, built once."""

    def __init__(self, layout: Subchunked, seq_len: int, rule: Rule, doc_bounds, valid_len):
        self.W, self.rule = layout.world, rule
        self.segs = [layout.segments(j, seq_len).cut(doc_bounds, valid_len) for j in range(self.W)]
        pos = [seg.positions() for seg in self.segs]
        prow = layout.piece_rows(self.segs[0].length)
        self.pieces = [[tuple(Piece(o, c, p, prow[c][p], pos[o][prow[c][p][0]]) for p in range(len(prow[c])))
                        for c in range(len(prow))] for o in range(self.W)]
        self._tasks: dict[tuple[int, Piece], tuple[Task, ...]] = {}

    def tasks(self, r: int, p: Piece) -> tuple[Task, ...]:
        """Rank r's queries against piece p alone (key rows from 0)."""
        key = (r, p)
        if key not in self._tasks:
            self._tasks[key] = plan(self.segs[r], slice_rows(self.segs[p.origin], *p.rows), self.rule)
        return self._tasks[key]

    def needs(self, r: int, p: Piece) -> bool:
        return bool(self.tasks(r, p))


def _holdings(kind: str, W: int, t: int, r: int) -> list[tuple[int, int, int]]:
    """``(origin, sub-chunk, sender)`` of what rank r holds in round t."""
    if kind == "direct":
        return [(o, topology.direct_subchunk(o, r, t, W), o) for o in range(W) if o != r]
    out = []
    for g, cyc in enumerate(topology.hamiltonian_cycles(W)):
        i = cyc.index(r)
        out.append((cyc[(i - t) % W], g, cyc[(i - 1) % W]))
    return out


def _coalesce(tasks: list[Task]) -> tuple[Task, ...]:
    """Join full-band tasks on the same query rows whose key rows touch (one call for adjacent pieces)."""
    out: list[Task] = []
    for t in sorted(tasks, key=lambda t: (t.q_start, t.q_stop, t.k_start)):
        last = out[-1] if out else None
        if (last is not None and last.mask.is_full and t.mask.is_full and last.q == t.q
                and last.k_stop == t.k_start):
            out[-1] = Task(last.q_start, last.q_stop, last.k_start, t.k_stop, last.mask)
        else:
            out.append(t)
    return tuple(out)


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` of rows (disjoint) joined where they touch, in order."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _order(hops: list[Hop], peer: str) -> tuple[Hop, ...]:
    """Messages of one link in one order on both ends: by peer, then by the piece's first position."""
    return tuple(sorted(hops, key=lambda h: (getattr(h, peer), h.piece.start)))


@batch_memo(64)
def schedule(layout: Subchunked, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
             valid_len: int | None, kind: str, gather: bool = False) -> TaspPlan:
    """Rank ``rank``'s TASP schedule (Note [TASP rounds]); ``kind`` is "cycles" or "direct"; ``gather``: the
    "direct" forward over one buffer (``gathers``, Note [TASP forward at short chunks]).

    Built from positions alone, without other ranks' buffers: both ends of a link decide what it carries
    from the same facts (which pieces the receiver's queries see), and each end knows its own rows.
    """
    geo, W, r = _Geometry(layout, seq_len, rule, doc_bounds, valid_len), layout.world, rank
    cycles = topology.hamiltonian_cycles(W) if kind == "cycles" else ()
    succ = {g: c[(c.index(r) + 1) % W] for g, c in enumerate(cycles)}
    pred = {g: c[(c.index(r) - 1) % W] for g, c in enumerate(cycles)}
    held: list[list[tuple[Piece, int]]] = [[]]
    rows_of: list[dict[Piece, tuple[int, int]]] = [{}]
    for t in range(1, W):                             # what we hold each round, in global-position order
        cand = sorted(((p, sender) for o, c, sender in _holdings(kind, W, t, r) for p in geo.pieces[o][c]
                       if kind == "cycles" or geo.needs(r, p)), key=lambda x: x[0].start)
        at, rows = 0, {}
        for p, _ in cand:
            rows[p] = (at, at + p.rows[1] - p.rows[0])
            at = rows[p][1]
        held.append(cand)
        rows_of.append(rows)
    rounds = []
    for t in range(1, W):
        tasks = _coalesce([Task(x.q_start, x.q_stop, x.k_start + rows_of[t][p][0], x.k_stop + rows_of[t][p][0],
                                x.mask) for p, _ in held[t] for x in geo.tasks(r, p)])
        kv_in = [Hop(sender, r, p, dst_rows=rows_of[t][p]) for p, sender in held[t]]
        if kind == "direct":
            kv_out = [Hop(r, d, p, src_rows=p.rows, from_own=True) for d in range(W) if d != r
                      for p in geo.pieces[r][topology.direct_subchunk(r, d, t, W)] if geo.needs(d, p)]
            grad_out = [Hop(r, p.origin, p, src_rows=rows_of[t][p], home=True) for p, _ in held[t]]
            grad_in = [Hop(h, r, p, dst_rows=p.rows, home=True) for h in range(W) if h != r
                       for p in geo.pieces[r][topology.direct_subchunk(r, h, t, W)] if geo.needs(h, p)]
        else:
            src = [(p, p.rows, True) for g in range(W - 1) for p in geo.pieces[r][g]] if t == 1 else \
                  [(p, rows_of[t - 1][p], False) for p, _ in held[t - 1]]
            kv_out = [Hop(r, succ[p.sub], p, src_rows=sr, from_own=own) for p, sr, own in src]
            last = t == W - 1
            grad_out = [Hop(r, succ[p.sub], p, src_rows=rows_of[t][p], home=last) for p, _ in held[t]]
            grad_in = [Hop(pred[g], r, p, dst_rows=p.rows, home=True) for g in range(W - 1)
                       for p in geo.pieces[r][g]] if last else \
                      [Hop(sender, r, p, dst_rows=rows_of[t + 1][p]) for p, sender in held[t + 1]]
        rounds.append(Round(tuple(p for p, _ in held[t]), tuple(rows_of[t][p] for p, _ in held[t]),
                            sum(b - a for a, b in rows_of[t].values()), tasks, _order(kv_in, "src"),
                            _order(kv_out, "dst"), _order(grad_in, "src"), _order(grad_out, "dst")))
    early, late = split_own(geo.segs[r], rule, front_first=False)
    gathered = None
    if gather and kind == "direct" and W > 2:
        gathered = _gather(geo, r, held, rounds)
    own = plan(geo.segs[r], geo.segs[r], rule)
    return TaspPlan(W, kind, own, early, late, tuple(rounds), gathered)


def gathers(seq_len: int, world: int, row_bytes: int | None = None) -> bool:
    """Whether both passes gather their rounds (Note [TASP forward at short chunks]): at most ``GATHER_MAX_ROWS``
    local rows, where holding every round costs little, and - given ``row_bytes``, one local row's K and V across the
    batch as the gathered backward holds them (``held_row_bytes``) - the other ranks' rows of it within
    ``GATHER_BYTES``."""
    rows = seq_len // world
    return rows <= GATHER_MAX_ROWS and (row_bytes is None or (world - 1) * rows * row_bytes <= GATHER_BYTES)


def held_row_bytes(batch: int, kv_heads: int, dk: int, dv: int, dtype: torch.dtype) -> int:
    """Bytes the gathered backward holds per received row (Note [TASP backward at short chunks]): the row of K and
    V, every call's partials of it, their sum and what comes home, each counted in the inputs' dtype. Exact links
    hold no sum (their partials go as they are: Note [TASP K and V apart]), so there it is a bound; a link that is
    not exact holds the last two in the wire's dtype (twice the bytes in bf16) - the count kept since the limit
    (``GATHER_BYTES``) was set."""
    return batch * kv_heads * (dk + dv) * 4 * (torch.finfo(dtype).bits // 8)


GATHER_BYTES = 2 << 30
"""The most the gathered backward holds for the other ranks' rows (``held_row_bytes``); past it the rounds' backward,
which holds two rounds at a time, runs: MHA (32 heads of 128) in bf16 gathers to 4K tokens per rank over 8 and 8K
over 4, GQA 8 to ``GATHER_MAX_ROWS``."""


GATHER_MAX_ROWS = 8192
"""Local rows up to which TASP's passes gather their rounds, and its backward holds the partials that come home a
round buffer each (Notes [TASP forward at short chunks], [TASP sums])."""


GATHER_ROWS = 8192
"""Keys per call of a gathered class: its keys run in (keys // GATHER_ROWS) calls (one at least, one a round at
most), split where rounds end (Note [TASP forward at short chunks])."""


def _gather(geo: _Geometry, r: int, held: list, rounds: list[Round]) -> Gathered:
    """Rank r's pass over one buffer (Note [TASP forward at short chunks]): pieces every task of which is a full
    block are grouped by the query rows that see them (a class), each class's pieces laid out round after round, and
    a class's keys run in (keys // ``GATHER_ROWS``) groups (one at least, one a round at most), a group closing at the
    first round by which its share of the keys has arrived, one call per query range; other pieces keep their
    round's calls."""
    n = len(rounds)

    def cls(p: Piece):
        ts = geo.tasks(r, p)
        keys = (0, p.rows[1] - p.rows[0])
        if ts and all(isinstance(x.mask, Band) and x.mask.is_full and (x.k_start, x.k_stop) == keys for x in ts):
            return tuple((x.q_start, x.q_stop) for x in ts)
        return None

    classes: dict = {}                            # class -> [(t, piece)], in round and position order
    rest: list[list[Piece]] = [[] for _ in range(n)]
    for t in range(1, n + 1):
        for p, _ in held[t]:
            c = cls(p)
            if c is None:
                rest[t - 1].append(p)
            else:
                classes.setdefault(c, []).append((t, p))
    at, where = 0, {}
    tasks: list[list[Task]] = [[] for _ in range(n)]
    for c, items in classes.items():
        start = at
        per_round = [0] * (n + 1)
        for t, p in items:
            where[(t, p)] = (at, at + p.rows[1] - p.rows[0])
            at = where[(t, p)][1]
            per_round[t] += p.rows[1] - p.rows[0]
        total = at - start
        groups = max(1, min(sum(1 for x in per_round if x), total // GATHER_ROWS))
        lo, done, k = start, 0, 1             # consecutive rounds; group k closes once k / groups of the keys came
        for t in range(1, n + 1):
            done += per_round[t]
            if per_round[t] and (done * groups >= total * k or done == total):
                hi = start + done
                tasks[t - 1] += [Task(qa, qb, lo, hi, Band()) for qa, qb in c]
                lo, k = hi, k + 1
    for t in range(1, n + 1):
        placed = []
        for p in rest[t - 1]:
            where[(t, p)] = (at, at + p.rows[1] - p.rows[0])
            placed += [Task(x.q_start, x.q_stop, x.k_start + at, x.k_stop + at, x.mask) for x in geo.tasks(r, p)]
            at = where[(t, p)][1]
        tasks[t - 1] += list(_coalesce(placed))
    kv_rows = tuple(tuple(where[(t, h.piece)] for h in rounds[t - 1].kv_in) for t in range(1, n + 1))
    out = _order([Hop(r, h.src, h.piece, src_rows=where[(t, h.piece)], home=True)
                  for t in range(1, n + 1) for h in rounds[t - 1].kv_in], "dst")
    came = _order([h for rd in rounds for h in rd.grad_in], "src")
    return Gathered(at, kv_rows, tuple(tuple(ts) for ts in tasks),
                    tuple((h.dst, h.src_rows, geo.tasks(r, h.piece)) for h in out),
                    tuple((h.src, h.dst_rows, geo.tasks(h.src, h.piece)) for h in came))


KV = tuple[torch.Tensor, torch.Tensor]
"""K and V, sequence-major ``(L, B, Hkv, D)`` and ``(L, B, Hkv, Dv)``: a piece is a row range of each, two messages."""


def _rows_of(k: torch.Tensor, v: torch.Tensor) -> KV:
    """Our K and V as sequence-major rows (Note [TASP K and V apart]): views of the inputs where those already are
    contiguous rows (a batch of one) - pieces are only sent from them, nothing is received into them - else copies."""
    return tuple(x if x.is_contiguous() else x.contiguous() for x in (k.transpose(0, 1), v.transpose(0, 1)))


def _rows_like(kv: KV, rows: int | None = None) -> KV:
    """Receive buffers shaped like ``kv`` (``rows`` rows: default the same)."""
    return tuple(x.new_empty((x.shape[0] if rows is None else rows, *x.shape[1:])) for x in kv)


def _packed_shape(kv: KV) -> tuple[int, ...]:
    """The shape of dK and dV side by side, ``(L, B, Hkv, D + Dv)``: the backward's partials travel as one message."""
    k, v = kv
    return (*k.shape[:-1], k.shape[-1] + v.shape[-1])


class Tasp:
    """One planned call's TASP engine part (Note [TASP rounds]) on the runtime's ``run_steps``: step 0 is
    the own block (round 1's pieces already in flight), step t computes round t while round t+1's pieces and
    round t-1's dK/dV partials move."""

    def __init__(self, groups, tp: TaspPlan, runner: TaskRunner, grad_dtype: torch.dtype):
        self.groups, self.tp, self.runner, self.grad_dtype = groups, tp, runner, grad_dtype
        self._exact: dict = {}                    # the gathered backward's exact links (``_links``)

    @property
    def group(self):
        return self.groups.group

    def _round(self, t: int) -> Round:
        return self.tp.rounds[t - 1]

    def _post_kv(self, ex: Exchange, t: int, own: KV, prev: KV, nxt: KV) -> None:
        """Queue the hops that fill round t's buffers ``nxt`` (from own KV or the previous round's ``prev``)."""
        rd = self._round(t)
        for h in rd.kv_out:
            for x in own if h.from_own else prev:
                ex.send(x[h.src_rows[0]:h.src_rows[1]], h.dst)
        for h in rd.kv_in:
            for x in nxt:
                ex.recv(x[h.dst_rows[0]:h.dst_rows[1]], h.src)

    def _post_gathered(self, ex: Exchange, t: int, g: Gathered, own: KV, whole: KV) -> None:
        """Queue round t's pieces from our own KV, and their receipt into the gathered buffers ``whole``."""
        rd = self._round(t)
        for h in rd.kv_out:
            for x in own:
                ex.send(x[h.src_rows[0]:h.src_rows[1]], h.dst)
        for h, (a, b) in zip(rd.kv_in, g.kv_rows[t - 1]):
            for x in whole:
                ex.recv(x[a:b], h.src)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, L, H, Dv) in q.dtype, lse (B, H, L) fp32)``."""
        tp, runner, W = self.tp, self.runner, self.tp.world
        acc = Accumulator(q, v.shape[-1], defer=True)
        if W == 1:
            for t in runner.prepare(tp.own, q, k):
                acc.add(t.q, *runner.forward(q, k, v, t), t.covered)
            return acc.result(q.dtype)
        own = _rows_of(k, v)
        g = tp.gathered
        if g is not None:                     # every round into one buffer (Note [TASP forward at short chunks])
            whole = _rows_like(own, g.rows)
            kw, vw = (bshd(x) for x in whole)
        else:
            bufs = [_rows_like(own), _rows_like(own)]

        def post(s: int):                     # round s+1's pieces, from own KV or the round-s buffer
            if s + 1 >= W:
                return None
            ex = Exchange(self.group)
            if g is None:
                self._post_kv(ex, s + 1, own, bufs[s % 2], bufs[(s + 1) % 2])
            else:
                self._post_gathered(ex, s + 1, g, own, whole)
            return ex

        def compute(s: int) -> None:
            if s == 0:
                tasks, kb, vb = tp.own, k, v
            elif g is not None:
                tasks, kb, vb = g.tasks[s - 1], kw, vw
            else:
                kb, vb = (bshd(x) for x in bufs[s % 2])
                tasks = self._round(s).tasks
            for t in runner.prepare(tasks, q, kb):
                acc.add(t.q, *runner.forward(q, kb, vb, t), t.covered)

        run_steps(W, post=post, compute=compute)
        return acc.result(q.dtype)

    def backward(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """TASP backward (ALGORITHMS.md §8.5; Note [TASP rounds]): dQ local, dK/dV partials routed home, one round
        behind their pieces; every running sum fp32, cast into the wire buffer only."""
        tp, runner, W, d = self.tp, self.runner, self.tp.world, q.shape[-1]
        acc = acc_dtype(q.dtype)
        dq = RowSum(q.shape, acc, q.device)       # fresh partials, summed once (Note [TASP sums])
        dk_sum, dv_sum = RowSum(k.shape, acc, q.device), RowSum(v.shape, acc, q.device)   # and our own dK, dV

        def grads(tasks, kb, vb):
            for t in runner.prepare(tasks, q, kb):
                gq, gk, gv = runner.backward(rows, q, kb, vb, lse, t)
                dq.add(t.q, gq, t.covered)
                yield t, gk, gv

        def run_own(tasks) -> None:
            for t, gk, gv in grads(tasks, k, v):
                dk_sum.add(t.k, gk)
                dv_sum.add(t.k, gv)

        def round_sums(tasks, kb, vb, dkv) -> None:
            """A round's dK/dV written once into its (fp32) buffer rows: no zeroing, no adds."""
            parts = [(t.k, gk, gv) for t, gk, gv in grads(tasks, kb, vb)]
            for view, i in zip((bshd(x) for x in unpack_kv(dkv, d)), (1, 2)):
                combine.sum_parts([(p[0], p[i]) for p in parts], tuple(view.shape), acc, out=view)

        if W == 1:
            run_own(tp.own)
            return dq.result(q.dtype), dk_sum.result(k.dtype), dv_sum.result(v.dtype)
        own = _rows_of(k, v)
        wire = wire_dtype(self.grad_dtype, q.dtype)
        if tp.gathered is not None:
            self._backward_gathered(q, k, v, own, wire, grads, run_own, dk_sum, dv_sum)
            return dq.result(q.dtype), dk_sum.result(k.dtype), dv_sum.result(v.dtype)
        bufs = [_rows_like(own), _rows_like(own)]
        packed = _packed_shape(own)                # dK/dV travel in one buffer (Note [One KV message] in ``_shared``)
        sums = [torch.empty(packed, dtype=acc, device=q.device) for _ in range(2)]   # round t's dK/dV, fp32
        send = torch.empty(packed, dtype=wire, device=q.device) if wire != acc else None
        gin = torch.empty(packed, dtype=wire, device=q.device)          # relayed partials (cycles)
        came: dict[int, torch.Tensor] = {}                                 # round t's partials home, held
        hold = k.shape[1] <= GATHER_MAX_ROWS      # longer: they land in gin and are folded at once (Note [TASP sums])

        def post_grads(ex: Exchange, t: int) -> None:
            """Round t's partials to their next holder or origin, and the receipt of ours."""
            rd, src = self._round(t), sums[t % 2]
            if send is not None:
                send.copy_(src)                # fp32 sums cast only into the wire buffer
                src = send
            for h in rd.grad_out:
                ex.send(src[h.src_rows[0]:h.src_rows[1]], h.dst)
            if any(h.home for h in rd.grad_in):
                came[t] = torch.empty(packed, dtype=wire, device=q.device) if hold else gin
            for h in rd.grad_in:
                ex.recv((came[t] if h.home else gin)[h.dst_rows[0]:h.dst_rows[1]], h.src)

        def apply_grads(t: int) -> None:
            """Round t's arrivals: relayed ones added into round t+1's sums, home ones held for our dK/dV's one sum
            (each run of adjacent rows one partial: Note [TASP sums])."""
            rd = self._round(t)
            for h in rd.grad_in:
                if not h.home:
                    a, b = h.dst_rows
                    sums[(t + 1) % 2][a:b] += gin[a:b]
            if t in came:
                gk, gv = (bshd(x) for x in unpack_kv(came.pop(t), d))
                for a, b in _runs([h.dst_rows for h in rd.grad_in if h.home]):
                    dk_sum.add(slice(a, b), gk[:, a:b])
                    dv_sum.add(slice(a, b), gv[:, a:b])
                if not hold:                # gin takes the next round's arrivals
                    dk_sum.fold()
                    dv_sum.fold()

        def post(s: int):
            ex = Exchange(self.group)
            if s + 1 < W:
                self._post_kv(ex, s + 1, own, bufs[s % 2], bufs[(s + 1) % 2])
            if s >= 2:
                post_grads(ex, s - 1)
            return ex

        def compute(s: int) -> None:
            if s == 0:
                run_own(tp.early)
                return
            kb, vb = (bshd(x) for x in bufs[s % 2])
            round_sums(self._round(s).tasks, kb, vb, sums[s % 2][: self._round(s).rows])

        def land(s: int) -> None:
            if s >= 2:
                apply_grads(s - 1)

        with Loop() as loop:
            run_steps(W, post=post, compute=compute, land=land, loop=loop)
            ex = Exchange(self.group)             # the last partials go home, behind the own block's rest
            post_grads(ex, W - 1)
            handles = loop.post(ex)
            run_own(tp.late)
            loop.wait(handles)
            apply_grads(W - 1)
        return dq.result(q.dtype), dk_sum.result(k.dtype), dv_sum.result(v.dtype)

    def _links(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[dict[int, bool], dict[int, bool]]:
        """Which links of the gathered backward are exact, ``(to each origin, from each sender)``: every piece on the
        link exact in the inputs' dtype (``exact_partial`` on the holder's prepared tasks of the piece: no key row in
        two of them, kernels that return the inputs' dtype). Both ends decide from the same tasks (``Gathered.grad_out``
        / ``grad_in``); decided on the first backward and kept."""
        key = (q.shape[2], k.shape[2], q.dtype)
        got = self._exact.get(key)
        if got is None:
            g, dv = self.tp.gathered, v.shape[-1]

            def exact(ts) -> bool:
                pre = self.runner.prepare(ts, q, k)
                return bool(pre) and exact_partial(self.runner, pre, [(t.k_start, t.k_stop) for t in pre], q, k, dv)

            def links(entries) -> dict[int, bool]:
                return {peer: all(exact(ts) for p, _, ts in entries if p == peer) for peer, _, _ in entries}

            got = self._exact[key] = (links(g.grad_out), links(g.grad_in))
        return got

    def _backward_gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, own: KV,
                           wire: torch.dtype, grads, run_own, dk_sum: RowSum, dv_sum: RowSum) -> None:
        """The backward at short chunks (Note [TASP backward at short chunks]): every round's pieces into one buffer,
        a class's rounds one call per group (the forward's ``Gathered``), every piece's partial sent home in one
        exchange behind the own block's rest: on an exact link (``_links``) the calls' own dK and dV rows of it
        (``_piece_grads``, Note [TASP K and V apart]), else summed once into one buffer in the wire's dtype."""
        tp, W, g, d = self.tp, self.tp.world, self.tp.gathered, q.shape[-1]
        to, frm = self._links(q, k, v)
        whole = _rows_like(own, g.rows)
        kw, vw = (bshd(x) for x in whole)
        packed = _packed_shape(own)
        parts: list = []                                   # (key rows, dK, dV) of every call on the buffer

        def post(s: int):
            if s + 1 >= W:
                return None
            ex = Exchange(self.group)
            self._post_gathered(ex, s + 1, g, own, whole)
            return ex

        def compute(s: int) -> None:
            if s == 0:
                run_own(tp.early)
            else:
                parts.extend((t.k, gk, gv) for t, gk, gv in grads(g.tasks[s - 1], kw, vw))

        with Loop() as loop:
            run_steps(W, post=post, compute=compute, loop=loop)
            if not all(to.values()):                          # some link is not exact: its partials sum first
                sums = torch.empty((g.rows, *packed[1:]), dtype=wire, device=k.device)
                for view, i in zip((bshd(x) for x in unpack_kv(sums, d)), (1, 2)):
                    combine.sum_parts([(p[0], p[i]) for p in parts], tuple(view.shape), wire, out=view)
            ex = Exchange(self.group)
            for dst, (a, b), _ in g.grad_out:
                if to[dst]:                                   # exact: the kernels' own dK and dV of the piece
                    for x in _piece_grads(parts, a, b):
                        ex.send(x.transpose(0, 1).contiguous(), dst)
                else:
                    ex.send(sums[a:b], dst)
            came: dict[int, tuple[torch.Tensor, ...]] = {}   # per sender: its pieces of ours, at their rows
            for src, (a, b), _ in g.grad_in:
                bufs = came.get(src)
                if bufs is None:
                    bufs = came[src] = _rows_like(own) if frm[src] else \
                        (torch.empty(packed, dtype=wire, device=k.device),)
                for x in bufs:
                    ex.recv(x[a:b], src)
            handles = loop.post(ex)
            run_own(tp.late)
            loop.wait(handles)
        for src, bufs in came.items():
            gk, gv = (bshd(x) for x in (bufs if len(bufs) == 2 else unpack_kv(bufs[0], d)))
            for a, b in _runs([rows for s, rows, _ in g.grad_in if s == src]):
                dk_sum.add(slice(a, b), gk[:, a:b])
                dv_sum.add(slice(a, b), gv[:, a:b])


def _piece_grads(parts: list, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV ``(B, b - a, H, D)`` of rows ``[a, b)`` of the gathered buffer, on an exact link (no row in two calls):
    a slice of the one call that covers them, else the rows assembled from the calls that touch them (rows none
    touches are 0)."""
    over = [(r, gk, gv) for r, gk, gv in parts if r.start < b and a < r.stop]
    if len(over) == 1 and over[0][0].start <= a and b <= over[0][0].stop:
        r, gk, gv = over[0]
        return gk[:, a - r.start:b - r.start], gv[:, a - r.start:b - r.start]
    out = []
    for i in (1, 2):
        touch = []
        for r, *g in over:
            lo, hi = max(r.start, a), min(r.stop, b)
            touch.append((slice(lo - a, hi - a), g[i - 1][:, lo - r.start:hi - r.start]))
        like = parts[0][i]
        out.append(combine.sum_parts(touch, (like.shape[0], b - a, *like.shape[2:]), like.dtype))
    return out[0], out[1]
