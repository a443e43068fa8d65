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

    Received pieces are laid out in the round buffer in global-position order, so the block planner
    covers zigzag causal rounds with at most two kernel calls - (all queries x front pieces of lower
    ranks) and (back queries x everything of higher ranks plus those fronts) - exactly TASP's M/P split,
    derived from positions rather than tables. In "direct" rounds a piece no query of the receiver sees
    (causal: the back pieces of lower ranks) is not sent at all.

    Backward (§8.5): dQ accumulates locally in fp32. "direct": each round's dK/dV partials go straight
    back to their origin one round later (a reverse all-to-all in the next round's exchange) and are
    summed there in fp32. "cycles": the running dK/dV of a piece follows the piece on its cycle one round
    behind (added by each holder after its own compute), and the last holder's successor is the origin,
    so the final hop is home. The last return overlaps the back half of the own block (Note [Hiding the
    tail] in ``_shared``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..comm import topology
from ..comm.ring import Exchange
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator
from ..layouts.blocks import Rule, Segments, Task, plan
from ..layouts.subchunks import Subchunked, slice_rows
from ._shared import acc_dtype, bshd, seq_major, split_own, wire_dtype

__all__ = ["Hop", "Piece", "Round", "TaspPlan", "backward", "forward", "schedule"]


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
    """One message: ``piece`` from ``src`` rows ``src_rows`` (own KV if ``from_own``, else the previous
    round's buffer; for gradients the round's dK/dV buffer) to ``dst`` rows ``dst_rows`` (the round buffer;
    for gradients the origin's own rows if ``home``, else the next round's buffer)."""

    src: int
    dst: int
    piece: Piece
    src_rows: tuple[int, int]
    dst_rows: tuple[int, int]
    from_own: bool = False
    home: bool = False


@dataclass(frozen=True)
class Round:
    """One rank's part of one round t >= 1.

    Attributes:
        held: the pieces in the round buffer, in buffer order (rows ``held_rows``).
        tasks: kernel calls: query rows local, key rows in the round buffer.
        kv_in, kv_out: the hops that fill the round buffer (posted one round earlier).
        grad_out, grad_in: hops that carry this round's dK/dV partials (posted with the next round).
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
class TaspPlan:
    """The whole group's schedule: ``rounds[t - 1][r]`` for t = 1 .. W-1; own block tasks per rank."""

    world: int
    kind: str
    early: tuple[tuple[Task, ...], ...]
    late: tuple[tuple[Task, ...], ...]
    rounds: tuple[tuple[Round, ...], ...]


def _holdings(kind: str, W: int, t: int, r: int) -> list[tuple[int, int, int]]:
    """``(origin, sub-chunk, sender)`` of what rank r holds in round t."""
    if kind == "direct":
        return [(o, topology.direct_subchunk(o, r, t, W), o) for o in range(W) if o != r]
    out = []
    for g, cyc in enumerate(topology.hamiltonian_cycles(W)):
        i = cyc.index(r)
        out.append((cyc[(i - t) % W], g, cyc[(i - 1) % W]))
    return out


def _buffer(pieces: list[Piece], segs: list[Segments], rule: Rule, q: Segments):
    """Buffer rows of the pieces (in the given order) and the planner's tasks on that buffer."""
    rows, at = [], 0
    for p in pieces:
        rows.append((at, at + p.rows[1] - p.rows[0]))
        at = rows[-1][1]
    if not pieces:
        return (), 0, ()
    kseg = Segments.concat([slice_rows(segs[p.origin], *p.rows) for p in pieces])
    return tuple(rows), at, plan(q, kseg, rule)


def _touched(rows: tuple[tuple[int, int], ...], tasks: tuple[Task, ...]) -> list[bool]:
    return [any(t.k_start < b and a < t.k_stop for t in tasks) for a, b in rows]


@functools.lru_cache(maxsize=32)
def schedule(layout: Subchunked, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
             valid_len: int | None, kind: str) -> TaspPlan:
    """The TASP schedule (Note [TASP rounds]); ``kind`` is "cycles" or "direct"."""
    W = layout.world
    segs = [layout.segments(j, seq_len).cut(doc_bounds, valid_len) for j in range(W)]
    prow = layout.piece_rows(segs[0].length)
    pos = [seg.positions() for seg in segs]
    own = [split_own(segs[r], rule, back_first=False) for r in range(W)]
    # pass 1: what every rank holds and computes in every round
    held: dict[tuple[int, int], list[tuple[Piece, int]]] = {}
    layout_of: dict[tuple[int, int], tuple] = {}
    for t in range(1, W):
        for r in range(W):
            cand = sorted(((Piece(o, c, p, prow[c][p], pos[o][prow[c][p][0]]), sender)
                           for o, c, sender in _holdings(kind, W, t, r) for p in range(len(prow[c]))),
                          key=lambda x: x[0].start)
            rows, n, tasks = _buffer([p for p, _ in cand], segs, rule, segs[r])
            if kind == "direct":                     # send only what the receiver's queries see
                cand = [x for x, hit in zip(cand, _touched(rows, tasks)) if hit]
                rows, n, tasks = _buffer([p for p, _ in cand], segs, rule, segs[r])
            held[t, r] = cand
            layout_of[t, r] = (rows, n, tasks)
    where = {(t, r, p): rows for (t, r), cand in held.items()
             for (p, _), rows in zip(cand, layout_of[t, r][0])}
    # pass 2: the hops
    kv_out: dict[tuple[int, int], list[Hop]] = {}
    kv_in: dict[tuple[int, int], list[Hop]] = {}
    g_out: dict[tuple[int, int], list[Hop]] = {}
    g_in: dict[tuple[int, int], list[Hop]] = {}
    touched_by: set[tuple[Piece, int]] = set()           # (piece, t): its dK/dV is non-zero after round t
    for t in range(1, W):
        for r in range(W):
            rows, _, tasks = layout_of[t, r]
            for (p, sender), dst_rows, hit in zip(held[t, r], rows, _touched(rows, tasks)):
                own_src = sender == p.origin
                src_rows = p.rows if own_src else where[t - 1, sender, p]
                hop = Hop(sender, r, p, src_rows, dst_rows, from_own=own_src)
                kv_out.setdefault((t, sender), []).append(hop)
                kv_in.setdefault((t, r), []).append(hop)
                carried = hit or (kind == "cycles" and (p, t - 1) in touched_by)
                if not carried:
                    continue                          # no gradient yet: nothing to return or relay
                touched_by.add((p, t))
                if kind == "direct" or t == W - 1:
                    nxt, dst, home = p.origin, p.rows, True
                else:
                    cyc = topology.hamiltonian_cycles(W)[p.sub]
                    nxt = cyc[(cyc.index(r) + 1) % W]
                    dst, home = where[t + 1, nxt, p], False
                ghop = Hop(r, nxt, p, dst_rows, dst, home=home)
                g_out.setdefault((t, r), []).append(ghop)
                g_in.setdefault((t, nxt), []).append(ghop)

    def order(hops, peer):                            # same order on both ends of every link
        return tuple(sorted(hops, key=lambda h: (getattr(h, peer), h.piece.start)))

    rounds = tuple(tuple(Round(tuple(p for p, _ in held[t, r]), layout_of[t, r][0], layout_of[t, r][1],
                               layout_of[t, r][2], order(kv_in.get((t, r), []), "src"),
                               order(kv_out.get((t, r), []), "dst"), order(g_in.get((t, r), []), "src"),
                               order(g_out.get((t, r), []), "dst"))
                         for r in range(W)) for t in range(1, W))
    return TaspPlan(W, kind, tuple(o[0] for o in own), tuple(o[1] for o in own), rounds)


def _post_kv(ex: Exchange, nxt_round: Round, own: torch.Tensor, prev: torch.Tensor, nxt: torch.Tensor) -> None:
    """Queue the hops that fill the next round's buffer ``nxt`` (from own KV or the current buffer ``prev``)."""
    for h in nxt_round.kv_out:
        src = own if h.from_own else prev
        ex.send(src[h.src_rows[0]:h.src_rows[1]], h.dst)
    for h in nxt_round.kv_in:
        ex.recv(nxt[h.dst_rows[0]:h.dst_rows[1]], h.src)


def _post_grads(ex: Exchange, rd: Round, dkv: torch.Tensor, gin: torch.Tensor) -> None:
    """Queue this round's dK/dV partials to their next holder or origin, and the receipt of ours."""
    for h in rd.grad_out:
        ex.send(dkv[h.src_rows[0]:h.src_rows[1]], h.dst)
    for h in rd.grad_in:
        ex.recv(gin[h.dst_rows[0]:h.dst_rows[1]], h.src)


def _apply_grads(rd: Round, gin: torch.Tensor, own_dkv: torch.Tensor, nxt_dkv: torch.Tensor | None) -> None:
    """Add received partials: home ones into our own dK/dV, relayed ones into the next round's running sums."""
    for h in rd.grad_in:
        a, b = h.dst_rows
        (own_dkv if h.home else nxt_dkv)[a:b] += gin[a:b]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, rank: int, tp: TaspPlan,
            runner: TaskRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """TASP forward: ``(out (B, L, H, D) in q.dtype, lse (B, H, L) fp32)``."""
    acc = Accumulator(q)
    W = tp.world
    if W > 1:
        own = torch.stack((seq_major(k), seq_major(v)), 1)          # (L, 2, B, Hkv, D): pieces are row ranges
        bufs = [torch.empty_like(own), torch.empty_like(own)]
        ex = Exchange(group)
        _post_kv(ex, tp.rounds[0][rank], own, own, bufs[1])
        ex.commit()
    for t in runner.prepare(tp.early[rank] + tp.late[rank], q, k):
        acc.add(t.q, *runner.forward(q, k, v, t))
    for t in range(1, W):
        ex.wait()
        cur = bufs[t % 2]
        if t + 1 < W:                                 # post round t+1 before computing round t
            ex = Exchange(group)
            _post_kv(ex, tp.rounds[t][rank], own, cur, bufs[(t + 1) % 2])
            ex.commit()
        kb, vb = bshd(cur[:, 0]), bshd(cur[:, 1])
        for task in runner.prepare(tp.rounds[t - 1][rank].tasks, q, kb):
            acc.add(task.q, *runner.forward(q, kb, vb, task))
    return acc.result(q.dtype)


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, group, rank: int, tp: TaspPlan, runner: TaskRunner, grad_dtype: torch.dtype,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TASP backward (ALGORITHMS.md §8.5; Note [TASP rounds]): dQ local, dK/dV partials routed home."""
    acc = acc_dtype(q.dtype)
    W = tp.world
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own_dkv = torch.zeros(k.shape[1], 2, k.shape[0], *k.shape[2:], dtype=acc, device=q.device)

    def run(tasks, kb, vb, dkv):
        dkb, dvb = bshd(dkv[:, 0]), bshd(dkv[:, 1])
        for t in runner.prepare(tasks, q, kb):
            gq, gk, gv = runner.backward(do, q, kb, vb, out, lse, t, delta)
            dq[:, t.q] += gq
            dkb[:, t.k] += gk
            dvb[:, t.k] += gv

    if W > 1:
        own = torch.stack((seq_major(k), seq_major(v)), 1)
        bufs = [torch.empty_like(own), torch.empty_like(own)]
        wire = wire_dtype(grad_dtype, q.dtype)
        dkvs = [torch.empty(own.shape, dtype=wire, device=q.device) for _ in range(2)]
        gin = torch.empty_like(dkvs[0])
        ex = Exchange(group)
        _post_kv(ex, tp.rounds[0][rank], own, own, bufs[1])
        ex.commit()

    def R(t: int) -> Round:                           # this rank's part of round t (1 .. W-1)
        return tp.rounds[t - 1][rank]

    run(tp.early[rank], k, v, own_dkv)
    for t in range(1, W):
        ex.wait()                                     # round t's KV; round t-2's partials
        if t >= 3:
            _apply_grads(R(t - 2), gin, own_dkv, dkvs[(t - 1) % 2])
        ex = Exchange(group)
        if t + 1 < W:
            _post_kv(ex, R(t + 1), own, bufs[t % 2], bufs[(t + 1) % 2])
        if t >= 2:
            _post_grads(ex, R(t - 1), dkvs[(t - 1) % 2], gin)
        ex.commit()
        dkv = dkvs[t % 2]
        dkv[:R(t).rows].zero_()
        run(R(t).tasks, bshd(bufs[t % 2][:, 0]), bshd(bufs[t % 2][:, 1]), dkv)
    if W > 1:
        ex.wait()
        if W >= 3:
            _apply_grads(R(W - 2), gin, own_dkv, dkvs[(W - 1) % 2])
        ex = Exchange(group)                          # the last partials go home, behind the own block's rest
        _post_grads(ex, R(W - 1), dkvs[(W - 1) % 2], gin)
        ex.commit()
    run(tp.late[rank], k, v, own_dkv)
    if W > 1:
        ex.wait()
        _apply_grads(R(W - 1), gin, own_dkv, None)
    dk, dv = bshd(own_dkv[:, 0]), bshd(own_dkv[:, 1])
    return dq.to(q.dtype), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()
