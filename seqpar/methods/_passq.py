"""The pass-Q engine behind ``tokenring`` (ALGORITHMS.md §7.2, §7.4): K and V stay, queries travel.

Private: the host-side schedule (``schedule``, cached) and the forward/backward loops.

Note [Pass-Q schedule]
    Q moves one hop per step towards rank r-1, so at step s rank r hosts the queries of owner
    ``i = (r + s) mod W`` and computes them against its own K, V - the tasks are the block planner's answer
    for (owner i's positions, rank r's positions), so layouts, causal or not, windows, documents and
    padding all come from ``seqpar.layouts.blocks.plan``. The partial (out, lse) - or in backward the
    partial dQ - of step s goes straight back to owner i at step s+1, over the link r -> r+s, overlapped
    with step s+1's compute, and is merged there in fp32. The last return overlaps the second half of
    the owner's diagonal block (Note [Hiding the tail] in ``_shared``).

    Halves after the wrap: a Q needs, on the hop after step s, only the rows that the tasks of the steps
    still ahead of it touch. The schedule computes that row range from the plans once (``q_rows``) and
    sends just it. For zigzag causal this is TokenRing's rule: Q first visits lower ranks (all rows see
    their front chunk); after the wrap only the back half sees anything, so only the back half travels
    and half-size partials come back (3/4 of the ring's rows over a pass). For contiguous causal a Q stops
    travelling after the wrap; under windows and documents hops and returns that carry nothing are
    skipped, and the pass ends after the last step any rank needs (``n_steps``).

    Backward (§7.4) moves the bundle (Q, dO, lse, Delta) the same way - or (Q, dO, O, lse) when the
    kernel cannot take a precomputed Delta - accumulates dK, dV in place in fp32 (they never travel) and
    returns dQ partials in ``grad_dtype``, summed by the owner in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..comm.ring import Exchange, Ring
from ..kernels.base import mask_kind
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator, merge_
from ..layouts.base import Layout
from ..layouts.blocks import Rule, Task, plan
from ._shared import Rows, acc_dtype, bhs, bshd, hull, own_accumulator, row_hull, seq_major, split_own, wire_dtype

__all__ = ["PassQPlan", "backward", "forward", "schedule"]


@dataclass(frozen=True)
class PassQPlan:
    """The whole group's pass-Q schedule (every rank computes the same plan from positions alone).

    Attributes:
        world: W.
        n_steps: steps every rank runs (1 + the last step at which any rank has work).
        early, late: ``[r]`` rank r's own-block tasks at step 0 / after the last return is posted.
        steps: ``[r][s]`` rank r's tasks at step s >= 1 on the queries of owner ``(r + s) % W`` (query
            rows in the owner's local rows, key rows in r's); ``steps[r][0]`` is empty.
        res_rows: ``[i][s]`` the query rows of owner i computed at step s (a partial's rows), or None.
        q_rows: ``[i][s]`` the rows of owner i's bundle sent on the hop after step s, or None.
        kinds: the mask kinds of all tasks (``seqpar.kernels.base.mask_kind``), to ask kernels about Delta.
    """

    world: int
    n_steps: int
    early: tuple[tuple[Task, ...], ...]
    late: tuple[tuple[Task, ...], ...]
    steps: tuple[tuple[tuple[Task, ...], ...], ...]
    res_rows: tuple[tuple[Rows, ...], ...]
    q_rows: tuple[tuple[Rows, ...], ...]
    kinds: frozenset[str]


@functools.lru_cache(maxsize=64)
def schedule(layout: Layout, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
             valid_len: int | None) -> PassQPlan:
    """The pass-Q schedule over ``layout`` (Note [Pass-Q schedule])."""
    W = layout.world
    segs = [layout.segments(j, seq_len).cut(doc_bounds, valid_len) for j in range(W)]
    raw = [[() if s == 0 else plan(segs[(r + s) % W], segs[r], rule) for s in range(W)] for r in range(W)]
    n = 1 + max((s for r in range(W) for s in range(W) if raw[r][s]), default=0)
    steps = tuple(tuple(raw[r][:n]) for r in range(W))
    res = tuple(tuple(row_hull(steps[(i - s) % W][s]) for s in range(n)) for i in range(W))
    q_rows = []
    for i in range(W):
        ahead: list[Rows] = [None] * n
        for s in range(n - 2, -1, -1):
            ahead[s] = hull(ahead[s + 1], res[i][s + 1])
        q_rows.append(tuple(ahead))
    own = [split_own(segs[r], rule, back_first=True) for r in range(W)]
    kinds = frozenset(mask_kind(t.mask) for r in range(W) for ts in (*own[r], *steps[r]) for t in ts)
    return PassQPlan(W, n, tuple(o[0] for o in own), tuple(o[1] for o in own), steps, res, tuple(q_rows), kinds)


def _post_hop(ex: Exchange, ring: Ring, sp: PassQPlan, s: int, cur: list[torch.Tensor],
              nxt: list[torch.Tensor]) -> None:
    """Queue the bundle hop after step s: my guest's rows to r-1, the next guest's rows from r+1."""
    r, W = ring.rank, sp.world
    out_rows, in_rows = sp.q_rows[(r + s) % W][s], sp.q_rows[(r + 1 + s) % W][s]
    if out_rows is not None:
        for x in cur:
            ex.send(x[out_rows[0]:out_rows[1]], ring.peer(-1))
    if in_rows is not None:
        for x in nxt:
            ex.recv(x[in_rows[0]:in_rows[1]], ring.peer(1))


def _post_return(ex: Exchange, ring: Ring, sp: PassQPlan, t: int, res: list[torch.Tensor],
                 got: list[torch.Tensor]) -> Rows:
    """Queue the return of step t's partial to its owner r+t and the receipt of mine from r-t."""
    r, W = ring.rank, sp.world
    out_rows, in_rows = sp.res_rows[(r + t) % W][t], sp.res_rows[r][t]
    if out_rows is not None:
        for x in res:
            ex.send(x[out_rows[0]:out_rows[1]], ring.peer(t))
    if in_rows is not None:
        for x in got:
            ex.recv(x[in_rows[0]:in_rows[1]], ring.peer(-t))
    return in_rows


def _guest_forward(q_SBHD, k, v, tasks, rows, runner: TaskRunner, res_o, res_l, scratch) -> None:
    """A visiting Q's partial (out, lse) over ``rows`` into the wire buffers ``res_o``, ``res_l``."""
    if rows is None:
        return
    qv = bshd(q_SBHD)
    tasks = runner.prepare(tasks, qv, k)
    a, b = rows
    if len(tasks) == 1 and (tasks[0].q_start, tasks[0].q_stop) == rows:
        o, lse = runner.forward(qv, k, v, tasks[0])
        res_o[a:b].copy_(o.transpose(0, 1))
        res_l[a:b].copy_(lse.permute(2, 0, 1))
        return
    so, sl = scratch                                  # merge several tasks in fp32, then cast once
    so[a:b].zero_()
    sl[a:b].fill_(float("-inf"))
    for t in tasks:
        o, lse = runner.forward(qv, k, v, t)
        merge_(bshd(so)[:, t.q], bhs(sl)[:, :, t.q], o, lse)
    res_o[a:b].copy_(so[a:b])
    res_l[a:b].copy_(sl[a:b])


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, sp: PassQPlan,
            runner: TaskRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass-Q forward: ``(out (B, L, H, D) in q.dtype, lse (B, H, L) fp32)``.

    Partial outputs travel in q's dtype (the bytes of ALGORITHMS.md §7.1, and what GPU kernels return);
    lse travels in fp32; the owner merges in fp32.
    """
    r, n = ring.rank, sp.n_steps
    acc = Accumulator(q)
    for t in runner.prepare(sp.early[r], q, k):
        acc.add(t.q, *runner.forward(q, k, v, t))
    if n > 1:
        own_accumulator(acc, q)
        B, L, H, D = q.shape
        lse_dt = acc.acc_dtype
        cur, nxt = seq_major(q), torch.empty(L, B, H, D, dtype=q.dtype, device=q.device)
        res = [(torch.empty_like(nxt), torch.empty(L, B, H, dtype=lse_dt, device=q.device)) for _ in range(2)]
        got = [torch.empty_like(nxt), torch.empty(L, B, H, dtype=lse_dt, device=q.device)]
        scratch = None
        if any(len(ts) > 1 for ts in sp.steps[r]):
            scratch = (torch.empty(L, B, H, D, dtype=lse_dt, device=q.device), torch.empty_like(got[1]))
        for s in range(n):
            ex = Exchange(ring.group)
            if s + 1 < n:
                _post_hop(ex, ring, sp, s, [cur], [nxt])
            mine = _post_return(ex, ring, sp, s - 1, list(res[(s - 1) % 2]), got) if s >= 2 else None
            ex.commit()
            if s >= 1:
                _guest_forward(cur, k, v, sp.steps[r][s], sp.res_rows[(r + s) % sp.world][s], runner,
                               *res[s % 2], scratch)
            ex.wait()
            if mine is not None:
                acc.add(slice(*mine), bshd(got[0])[:, mine[0]:mine[1]], bhs(got[1])[:, :, mine[0]:mine[1]])
            cur, nxt = nxt, cur
        ex = Exchange(ring.group)
        mine = _post_return(ex, ring, sp, n - 1, list(res[(n - 1) % 2]), got)
        ex.commit()
    for t in runner.prepare(sp.late[r], q, k):      # overlaps the last return (Note [Hiding the tail])
        acc.add(t.q, *runner.forward(q, k, v, t))
    if n > 1:
        ex.wait()
        if mine is not None:
            acc.add(slice(*mine), bshd(got[0])[:, mine[0]:mine[1]], bhs(got[1])[:, :, mine[0]:mine[1]])
    return acc.result(q.dtype)


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, ring: Ring, sp: PassQPlan, runner: TaskRunner, grad_dtype: torch.dtype,
             delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pass-Q backward (ALGORITHMS.md §7.4): the bundle travels, dK/dV stay, dQ partials return.

    With ``delta`` (B, H, L) the bundle is (Q, dO | lse, Delta); without, (Q, dO, O | lse).
    """
    r, n = ring.rank, sp.n_steps
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)

    def run(tasks, qv, dov, outv, lsev, deltav, dq_BSHD):
        for t in runner.prepare(tasks, qv, k):
            gq, gk, gv = runner.backward(dov, qv, k, v, outv, lsev, t, deltav)
            dq_BSHD[:, t.q] += gq
            dk[:, t.k] += gk
            dv[:, t.k] += gv

    run(sp.early[r], q, do, None if delta is not None else out, lse, delta, dq)
    if n > 1:
        rows_in = [q, do] if delta is not None else [q, do, out]
        stats = [lse] if delta is None else [lse, delta.to(lse.dtype)]
        cur = [torch.stack([seq_major(x) for x in rows_in], 1), torch.stack([x.permute(2, 0, 1) for x in stats], 1)]
        nxt = [torch.empty_like(x) for x in cur]
        wire = wire_dtype(grad_dtype, q.dtype)
        res = [torch.empty(q.shape[1], q.shape[0], *q.shape[2:], dtype=wire, device=q.device) for _ in range(2)]
        got = torch.empty_like(res[0])
        for s in range(n):
            ex = Exchange(ring.group)
            if s + 1 < n:
                _post_hop(ex, ring, sp, s, cur, nxt)
            mine = _post_return(ex, ring, sp, s - 1, [res[(s - 1) % 2]], [got]) if s >= 2 else None
            ex.commit()
            rows = sp.res_rows[(r + s) % sp.world][s] if s >= 1 else None
            if rows is not None:
                qd, st = cur
                res[s % 2][rows[0]:rows[1]].zero_()
                run(sp.steps[r][s], bshd(qd[:, 0]), bshd(qd[:, 1]), None if delta is not None else bshd(qd[:, 2]),
                    bhs(st[:, 0]), bhs(st[:, 1]) if delta is not None else None, bshd(res[s % 2]))
            ex.wait()
            if mine is not None:
                dq[:, mine[0]:mine[1]] += bshd(got[mine[0]:mine[1]])
            cur, nxt = nxt, cur
        ex = Exchange(ring.group)
        mine = _post_return(ex, ring, sp, n - 1, [res[(n - 1) % 2]], [got])
        ex.commit()
    run(sp.late[r], q, do, None if delta is not None else out, lse, delta, dq)
    if n > 1:
        ex.wait()
        if mine is not None:
            dq[:, mine[0]:mine[1]] += bshd(got[mine[0]:mine[1]])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
