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

    Backward (§7.4) moves the bundle (Q, dO | lse, Delta) the same way - or (Q, dO', O' | lse) when the
    kernels recompute Delta from O (the lse gradient folded in, Note [Folding the lse gradient]) - which of
    the two is a property of the plan's kernels, the same on every rank; it accumulates dK, dV in place in
    fp32 (they never travel) and returns dQ partials in ``grad_dtype``, summed by the owner in fp32.

    Every step posts its transfers before it computes, step 0 included: the hop that carries Q to rank r-1
    is in flight while the own block's first half runs.

Note [Pass-Q sums]
    The backward's gradient partials are fresh tensors, so they are held and summed once (``RowSum``, Note [One
    merge per call] in ``seqpar.kernels.combine``): dK and dV over every task of every step, dQ over the own
    blocks' partials and the returns that come home (each return lands in a buffer of its own), each written once
    in its dtype. A guest step's dQ rows go home in the inputs' dtype where that is exact (``exact_partial`` in
    ``_shared``: no row in two of its tasks, kernels that return that dtype) - one task's own output as it is when
    it covers them and the batch is 1 - else summed into a buffer of the wire's dtype (one pass, fp32 inside, rows
    no task covers zero); the ring's partials travel the same way (Note [Partials home] in ``_passkv``).
    Before, every task added into fp32 accumulators and every step zeroed,
    added and copied its return: at 2K tokens per rank over 8 (emulated, H100) those element-wise passes took
    about 1.0 ms of a 3.5 ms forward+backward (``benchmarks/gpu/probe_host.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.loop import Double, Loop, run_steps
from ..comm.ring import Exchange, Ring
from ..kernels import combine
from ..kernels.base import mask_kind
from ..kernels.executor import GROUP_AT, TaskRunner
from ..kernels.merge import Accumulator, RowSum
from ..layouts.base import Layout
from ..layouts.blocks import Rule, Task, plan
from ..memo import batch_memo
from ..numerics import GradRows, acc_dtype, wire_dtype
from ._shared import Rows, bhs, bshd, exact_partial, hull, row_hull, split_own

__all__ = ["PassQ", "PassQPlan", "schedule"]


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


@batch_memo(64)
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
    own = [split_own(segs[r], rule, front_first=True) for r in range(W)]
    lists = [ts for r in range(W) for ts in (*own[r], *steps[r])]
    kinds = frozenset(mask_kind(t.mask) for ts in lists for t in ts) \
        | ({"varlen"} if any(len(ts) >= GROUP_AT for ts in lists) else set())   # packed by TaskRunner.prepare
    return PassQPlan(W, n, tuple(o[0] for o in own), tuple(o[1] for o in own), steps, res, tuple(q_rows), kinds)


class PassQ:
    """One planned call's pass-Q engine part: queries travel over ``ring``, results come home."""

    def __init__(self, ring: Ring, sp: PassQPlan, runner: TaskRunner, grad_dtype: torch.dtype):
        self.ring, self.sp, self.runner, self.grad_dtype = ring, sp, runner, grad_dtype
        self._exact: dict[tuple, bool] = {}

    def _exact_home(self, guest: int, s: int, q: torch.Tensor, k: torch.Tensor, dv: int) -> bool:
        """Whether guest rank ``guest``'s dQ rows of step s go home exact in the inputs' dtype (Note [Pass-Q sums]);
        decided on the first call and kept (a planned call's shapes are fixed)."""
        key = (guest, s, q.shape[2], k.shape[2], q.dtype)
        if key not in self._exact:
            ts = self.runner.prepare(self.sp.steps[guest][s], q, k)
            self._exact[key] = exact_partial(self.runner, ts, [(t.q_start, t.q_stop) for t in ts], q, k, dv)
        return self._exact[key]

    def _hop(self, ex: Exchange, s: int, bufs: list[Double]) -> None:
        """Queue the bundle hop after step s: my guest's rows to r-1, the next guest's rows from r+1."""
        r, W, ring = self.ring.rank, self.sp.world, self.ring
        out_rows, in_rows = self.sp.q_rows[(r + s) % W][s], self.sp.q_rows[(r + 1 + s) % W][s]
        for b in bufs:
            if out_rows is not None:
                ex.send(b.cur[out_rows[0]:out_rows[1]], ring.peer(-1))
            if in_rows is not None:
                ex.recv(b.nxt[in_rows[0]:in_rows[1]], ring.peer(1))

    def _return(self, ex: Exchange, t: int, res: list[torch.Tensor], got: list[torch.Tensor]) -> Rows:
        """Queue the return of step t's partial to its owner r+t (``res``: exactly the rows that go home,
        ``res_rows``) and the receipt of mine from r-t."""
        r, W, ring = self.ring.rank, self.sp.world, self.ring
        out_rows, in_rows = self.sp.res_rows[(r + t) % W][t], self.sp.res_rows[r][t]
        if out_rows is not None:
            for x in res:
                ex.send(x, ring.peer(t))
        if in_rows is not None:
            for x in got:
                ex.recv(x[in_rows[0]:in_rows[1]], ring.peer(-t))
        return in_rows

    def _run(self, n: int, bufs: list[Double], compute, post_return, land_return, late) -> None:
        """The pass-Q schedule on the runtime: step s posts the hop after s (every buffer of the travelling
        bundle) and the return of step s-1's partial, computes, waits, merges what came home."""
        mine: list[Rows] = [None]

        def post(s: int) -> Exchange:
            ex = Exchange(self.ring.group)
            if s + 1 < n:
                self._hop(ex, s, bufs)
            mine[0] = post_return(ex, s - 1) if s >= 2 else None
            return ex

        def land(s: int) -> None:
            if mine[0] is not None:
                land_return(mine[0])
            for b in bufs:
                b.swap()

        with Loop() as loop:
            run_steps(n, post=post, compute=compute, land=land, loop=loop)
            if n > 1:
                ex = Exchange(self.ring.group)
                last = post_return(ex, n - 1)
                handles = loop.post(ex)
            late()                            # overlaps the last return (Note [Hiding the tail])
            if n > 1:
                loop.wait(handles)
                if last is not None:
                    land_return(last)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, L, H, Dv) in q.dtype, lse (B, H, L) fp32)``.

        Partial outputs travel in q's dtype (the bytes of ALGORITHMS.md §7.1, and what GPU kernels return);
        lse travels in fp32; the owner merges in fp32.
        """
        r, n, sp, runner = self.ring.rank, self.sp.n_steps, self.sp, self.runner
        B, L, H, _ = q.shape
        Dv = v.shape[-1]
        # every partial is a fresh tensor (kernel outputs; returns land in a buffer of their own), so the
        # accumulator holds them and merges once (Note [One merge per call] in seqpar.kernels.combine)
        acc = Accumulator(q, Dv, defer=True)
        lse_dt = acc.acc_dtype
        cur = Double.starting(q.transpose(0, 1)) if n > 1 else None   # sequence-major, borrowed where it lies
        res = [(q.new_empty(L, B, H, Dv), torch.empty(L, B, H, dtype=lse_dt, device=q.device)) for _ in range(2)]
        sent: list[list[torch.Tensor]] = [[], []]   # per step parity: the rows a guest step sends home
        landing: list[list[torch.Tensor]] = []      # the receive buffers of the return in flight

        def post_return(ex: Exchange, t: int) -> Rows:
            landing[:] = [q.new_empty(L, B, H, Dv), torch.empty(L, B, H, dtype=lse_dt, device=q.device)]
            return self._return(ex, t, sent[t % 2], landing)

        def own(tasks) -> None:
            for t in runner.prepare(tasks, q, k):
                acc.add(t.q, *runner.forward(q, k, v, t), t.covered)

        def guest(s: int) -> None:
            rows = sp.res_rows[(r + s) % sp.world][s]
            if rows is None:
                return
            qv = bshd(cur.cur)
            tasks = runner.prepare(sp.steps[r][s], qv, k)
            res_o, res_l = res[s % 2]
            a, b = rows
            if len(tasks) == 1 and (tasks[0].q_start, tasks[0].q_stop) == rows:
                o, lse = runner.forward(qv, k, v, tasks[0])
            else:                             # several tasks: their partials merged in one pass, cast once
                parts = [(slice(t.q_start - a, t.q_stop - a), *runner.forward(qv, k, v, t), t.covered)
                         for t in tasks]
                o, lse = combine.merge_parts(parts, (B, b - a, H, Dv), q.dtype)
            res_l[a:b].copy_(lse.permute(2, 0, 1))
            if B == 1 and o.dtype == q.dtype and o.is_contiguous():   # (1, n, H, Dv) is (n, 1, H, Dv): sent as it is
                sent[s % 2] = [o.view(b - a, 1, H, Dv), res_l[a:b]]
            else:
                res_o[a:b].copy_(o.transpose(0, 1))
                sent[s % 2] = [res_o[a:b], res_l[a:b]]

        def land_return(m: Rows) -> None:
            acc.add(slice(*m), bshd(landing[0])[:, m[0]:m[1]], bhs(landing[1])[:, :, m[0]:m[1]])

        if n == 1:
            own(sp.early[r])
            own(sp.late[r])
            return acc.result(q.dtype)
        self._run(n, [cur], lambda s: own(sp.early[r]) if s == 0 else guest(s), post_return, land_return,
                  lambda: own(sp.late[r]))
        return acc.result(q.dtype)

    def backward(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pass-Q backward (ALGORITHMS.md §7.4): the bundle travels, dK/dV stay, dQ partials return."""
        r, n, sp, runner = self.ring.rank, self.sp.n_steps, self.sp, self.runner
        Dv = v.shape[-1]
        acc = acc_dtype(q.dtype)
        delta = runner.takes_delta(q, k, sp.kinds, Dv)   # the plan's kernels decide the bundle: same on every rank
        # Note [Pass-Q sums]: every gradient partial is a fresh tensor, held and summed once
        dq, dk, dv = (RowSum(x.shape, acc, q.device) for x in (q, k, v))

        def grads(tasks, qv, g: GradRows, lsev):
            for t in runner.prepare(tasks, qv, k):
                gq, gk, gv = runner.backward(g, qv, k, v, lsev, t)
                dk.add(t.k, gk)
                dv.add(t.k, gv)
                yield t, gq

        def own(tasks) -> None:
            for t, gq in grads(tasks, q, rows, lse):
                dq.add(t.q, gq, t.covered)

        if n == 1:
            own(sp.early[r])
            own(sp.late[r])
            return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)
        if delta:                              # (Q, dO | lse, Delta)
            parts, stats = [q, rows.do], [lse, rows.delta.to(lse.dtype)]
        else:                                  # (Q, dO', O' | lse)
            parts, stats = [q, *rows.folded], [lse]
        bundle = [Double.starting(x.transpose(0, 1)) for x in parts]   # each part a message of the hop
        st = Double(torch.stack([x.permute(2, 0, 1) for x in stats], -1))
        wire = wire_dtype(self.grad_dtype, q.dtype)
        sent: list[torch.Tensor | None] = [None, None]   # step s's rows that go home (seq-major), by s % 2
        res: dict[torch.dtype, list[torch.Tensor]] = {}    # the double buffer of the rows summed to go home, by dtype
        landing: list[torch.Tensor] = []       # the receive buffer of the return in flight (a fresh one each)

        def home_dtype(guest_rank: int, s: int) -> torch.dtype:
            """The dtype a guest step's dQ rows travel in (Note [Pass-Q sums]): the inputs' where exact."""
            return q.dtype if self._exact_home(guest_rank, s, q, k, Dv) else wire

        def guest(s: int) -> None:
            rr = sp.res_rows[(r + s) % sp.world][s]
            if rr is None:
                return
            b_, s_ = [bshd(b.cur) for b in bundle], st.cur
            qv, dov = b_[0], b_[1]
            g = GradRows.given(dov, delta=bhs(s_[..., 1])) if delta else GradRows.given(dov, folded=(dov, b_[2]))
            a, b = rr
            part = [(slice(t.q_start - a, t.q_stop - a), gq, t.covered)
                    for t, gq in grads(sp.steps[r][s], qv, g, bhs(s_[..., 0]))]
            dtype = home_dtype(r, s)
            if len(part) == 1 and dtype == part[0][1].dtype and part[0][0] == slice(0, b - a):
                rows_ = part[0][1].transpose(0, 1)
                if rows_.is_contiguous():                   # the kernel's own rows, as they are (batch 1)
                    sent[s % 2] = rows_
                    return
            if dtype not in res:
                res[dtype] = [torch.empty(q.shape[1], q.shape[0], *q.shape[2:], dtype=dtype, device=q.device)
                              for _ in range(2)]
            target = bshd(res[dtype][s % 2])[:, a:b]
            combine.sum_parts(part, tuple(target.shape), dtype, out=target)    # fp32 inside
            sent[s % 2] = res[dtype][s % 2][a:b]

        def post_return(ex: Exchange, t: int) -> Rows:
            came = sp.res_rows[r][t]
            dtype = home_dtype((r - t) % sp.world, t) if came is not None else wire
            landing[:] = [torch.empty(q.shape[1], q.shape[0], *q.shape[2:], dtype=dtype, device=q.device)]
            rr = sp.res_rows[(r + t) % sp.world][t]
            return self._return(ex, t, [sent[t % 2]] if rr is not None else [], landing)

        def land_return(m: Rows) -> None:
            dq.add(slice(*m), bshd(landing[0])[:, m[0]:m[1]])

        self._run(n, [*bundle, st], lambda s: own(sp.early[r]) if s == 0 else guest(s), post_return, land_return,
                  lambda: own(sp.late[r]))
        return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)
