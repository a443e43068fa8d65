"""The pass-KV ring engine shared by ``ring`` and ``usp`` (ALGORITHMS.md §3).

Private: methods never import each other, so what two methods share lives here. Q, O and lse stay on
their rank; K and V travel one hop per step as two messages of one exchange, the first hop sending the caller's
tensors as they lie (``_Rotating``; Note [K and V apart] in ``seqpar.methods.allgather``), their dK/dV in one packed
message (Note [One KV message] in ``_shared``) or, at short chunks, as partials straight home (Note [Partials
home]);
at step s rank r holds the KV that started on rank ``(r - s) mod W``. Which part of that block rank r
computes is the block planner's answer (Note [Block planning] in ``seqpar.layouts.blocks``), so every
layout, causal or not, windows, documents and padding run through one loop - the runtime's
``run_steps`` (post the next hop, compute, wait; dK/dV one step behind).

Note [Ring truncation]
    A step at which no rank has work (a sliding window shorter than the ring, documents that end before
    the ring does) ends the ring early for everyone: ``n_steps`` is the last step any rank needs, plus one,
    computed identically on every rank from the layout. In backward the dK/dV accumulator of block j then
    sits on rank ``j + n_steps - 1`` and goes home in one direct transfer (one hop on NVSwitch).

Note [Partials home]
    While the partials a rank would hold fit ``HOME_BYTES`` (``partials_home``), dK/dV do not travel as running
    sums: at step s rank r's partial for block r - s goes straight to its owner (s ranks upstream) one step later,
    posted with the next KV hop as pass-Q's returns are (``_passq``), and each rank sums its own block's partials
    once, at the end (``RowSum``). A running sum costs every step an fp32 pass over the whole block - read the sum,
    read the partial, write the sum - which at 2K tokens per rank over 8 (MHA, emulated on an H100) took 0.59 ms of
    a forward+backward's 3.0 ms of GPU time, half of what its kernels beyond attention took; one sum of bf16
    partials reads each once. A partial covers the hull of its step's key rows (what both ends plan:
    ``Schedule.home`` is the sender's tasks against the receiver's block), and travels in the inputs' dtype when
    that is exact - no key row in two of the step's tasks and kernels that return gradients in the inputs' dtype:
    the kernel's own output, sent as it is, in half the bytes of the fp32 running sum - else summed in fp32 into a
    buffer of the wire's dtype (``grad_dtype``). The sums are of the same bf16 partials in fp32 as the running sums
    were, in another order. The cost is memory: a rank holds its block's partials until the end, so the rule is
    their bytes - a step's partial of the block, in the wire's dtype where it is wider (the partials that are not
    exact), times the steps - at most ``HOME_BYTES`` (the ``DEFER_BYTES`` at which ``RowSum`` would fold them
    anyway; the running sums hold two or three blocks of their own). The limit was 8192 local rows, which kept
    packed rows at 16K tokens per rank over 8 on the running sums although they hold under 1 GiB of partials (GQA
    8), and there the passes are not small next to the kernels: FA2 varlen calls over documents do less work per
    row, and the running sums' fp32 adds took 1.1 ms of a 17.1 ms forward+backward
    (``benchmarks/results/2026-11-26-h100-packed-probe``). MHA at W = 8 keeps its 8K rows. The sends go s ranks away
    rather than to the neighbour: one hop on NVSwitch, a permutation of the ranks on any network.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.loop import Double, Loop, run_steps
from ..comm.ring import Exchange, Ring
from ..comm.symmetric import region_view
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator, RowSum
from ..layouts.base import Layout
from ..layouts.blocks import Rule, Task, any_visible, plan
from ..memo import BATCH_ENTRIES, batch_memo
from ..numerics import GradRows, acc_dtype, wire_dtype
from ._shared import (
    backward_parts,
    exact_partial,
    head_groups,
    hold_own,
    home_partial,
    key_hull,
    land_home,
    receipt,
    swap_partial,
    unpack_kv,
)

__all__ = ["BATCH_SCHEDULES", "COPY_HOME_BYTES", "HOME_BYTES", "HeadChunks", "OneRank", "PassKV", "Schedule", "build",
           "partials_home", "schedule"]


@dataclass(frozen=True)
class Schedule:
    """Per-step tasks of one rank, and the number of ring steps every rank runs; ``home[s]``: the tasks rank
    ``rank + s`` runs at its step s against this rank's block (what comes home at step s: Note [Partials home])."""

    steps: tuple[tuple[Task, ...], ...]
    n_steps: int
    home: tuple[tuple[Task, ...], ...]


BATCH_SCHEDULES = BATCH_ENTRIES
"""Schedules kept of ring layouts with per-batch facts (documents, a valid length): Note [Per-batch memos]."""


@batch_memo()
def schedule(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
             valid_len: int | None) -> Schedule:
    """Rank ``rank``'s tasks at every step of a pass-KV ring over ``layout`` (Note [Ring truncation]); cached,
    per-batch ones apart (Note [Per-batch memos]): a packed batch's schedule is never asked for after its step."""
    W = layout.world
    segs = [layout.segments(j, seq_len).cut(doc_bounds, valid_len) for j in range(W)]
    mine = tuple(plan(segs[rank], segs[(rank - s) % W], rule) for s in range(W))
    last = next((s for s in range(W - 1, 0, -1) if any(any_visible(segs[r], segs[(r - s) % W], rule)
                                                       for r in range(W))), 0)
    home = tuple(plan(segs[(rank + s) % W], segs[rank], rule) for s in range(last + 1))
    return Schedule(mine[: last + 1], last + 1, home)


def build(call) -> PassKV:
    """The pass-KV ring of a planned ``call`` (``methods.base.Call``): its layout, rule, documents and kernel."""
    cfg = call.cfg
    sched = schedule(call.layout, call.index, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
    runner = TaskRunner.of(call)
    return PassKV(Ring(call.groups.group, cfg.option("transport", "nccl")), sched, runner, cfg.grad_dtype)


class HeadChunks:
    """A pass-KV engine run once per head group: ``chunks`` passes, each on Hkv/chunks KV heads and their query
    heads, so every buffer sized by the heads - the fp32 accumulators, the travelling dK/dV and the kernel's own
    backward workspace (FA2's fp32 dq, its per-query-head dK/dV under GQA) - shrinks ``chunks``-fold. Results
    are written into whole-head outputs (one copy per chunk); one chunk is the plain engine."""

    saves = False

    def __init__(self, call, chunks: int):
        self.ring = build(call)
        self.parts = head_groups(call.q_shape[2], call.k_shape[2], chunks)

    def direct(self, call):
        return self.ring.direct(call) if len(self.parts) == 1 else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.parts) == 1:
            return self.ring.forward(q, k, v)
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=acc_dtype(q.dtype), device=q.device)
        for hq, hk in self.parts:
            o, l = self.ring.forward(q[:, :, hq], k[:, :, hk], v[:, :, hk])
            out[:, :, hq], lse[:, hq] = o, l
        return out, lse

    def backward(self, b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, r = b.q, b.k, b.v, b.rows
        if len(self.parts) == 1:
            return self.ring.backward(r, q, k, v, b.lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for hq, hk in self.parts:
            rows = GradRows(r.do[:, :, hq], r.out[:, :, hq], None if r.dlse is None else r.dlse[:, hq])
            dq[:, :, hq], dk[:, :, hk], dv[:, :, hk] = self.ring.backward(rows, q[:, :, hq], k[:, :, hk],
                                                                          v[:, :, hk], b.lse[:, hq])
        return dq, dk, dv


class OneRank(HeadChunks):
    """Any pass-KV-family method on one rank: every key is local, so the call is the ring's single step.

    A method whose exchange is the identity at W = 1 (the all-gather) runs this instead of its own engine:
    no gather buffers, copies or fp32 dK/dV accumulator, and the direct path when the call is one block.
    ``kv_heads_per_chunk`` (the all-gather's ``heads_k_stride``) still bounds memory here: the kernel runs on
    that many KV heads at a time (``HeadChunks``).
    """

    def __init__(self, call, kv_heads_per_chunk: int | None = None):
        super().__init__(call, call.k_shape[2] // (kv_heads_per_chunk or call.k_shape[2]))


class _Rotating:
    """K and V rotating around the ring as two messages of one exchange, ``cur`` computed on while ``nxt``
    receives; the first hop sends the caller's tensors as they lie, with no pack (Note [K and V apart] in
    ``seqpar.methods.allgather``). On a copy-engine ring they receive into the ring's own buffers (Note
    [Copy-engine ring] in ``seqpar.comm.symmetric``)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, ring: Ring):
        bufs = ring.buffers([(tuple(k.shape), k.dtype)] * 2 + [(tuple(v.shape), v.dtype)] * 2, k.device,
                            "kv") if ring.copies else None
        self.k = Double.starting(k, None if bufs is None else bufs[:2])
        self.v = Double.starting(v, None if bufs is None else bufs[2:])

    @property
    def cur(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.cur, self.v.cur

    def post(self, ring: Ring, exchange: Exchange | None = None):
        """Queue the hop: ``cur`` downstream, ``nxt`` from upstream, one exchange (``exchange``, else a new one)."""
        first = ring.send_recv(self.k.cur, self.k.nxt, exchange=exchange)
        return ring.send_recv(self.v.cur, self.v.nxt, exchange=first)

    def swap(self) -> None:
        self.k.swap()
        self.v.swap()


def _packed_shape(k: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``pack_kv(k, v)`` (the travelling dK/dV: Note [One KV message] in ``_shared``)."""
    if k.shape[-1] == v.shape[-1]:
        return (2, *k.shape)
    return (*k.shape[:-1], k.shape[-1] + v.shape[-1])


class PassKV:
    """The ring over ``ring`` with ``sched``'s tasks, run by ``runner`` (one planned call's engine part).

    ``grad_dtype``: dK/dV partials on the wire; running sums stay fp32 (fp64 for fp64) and are cast only
    into the wire buffer.
    """

    def __init__(self, ring: Ring, sched: Schedule, runner: TaskRunner, grad_dtype: torch.dtype):
        self.ring, self.sched, self.runner, self.grad_dtype = ring, sched, runner, grad_dtype
        self._partials: dict[tuple, tuple[tuple[int, int], bool] | None] = {}

    def direct(self, call):
        """The whole call as one kernel call through PyTorch's autograd, when the ring has one step (W = 1)."""
        if self.sched.n_steps != 1:
            return None
        return self.runner.direct(self.sched.steps[0], call.q_shape, call.k_shape, call.v_shape, call.dtype,
                                  call.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, L, H, Dv) in q.dtype, lse (B, H, L) fp32)``."""
        acc = Accumulator(q, v.shape[-1], defer=True)          # fresh kernel outputs: one merge (Note [One merge
        runner, steps = self.runner, self.sched.steps                    # per call] in seqpar.kernels.combine)
        n = self.sched.n_steps
        if n == 1:                     # one rank, or a window that needs no other rank's keys
            for t in runner.prepare(steps[0], q, k):
                acc.add(t.q, *runner.forward(q, k, v, t), t.covered)
            return acc.result(q.dtype)
        kv = _Rotating(k, v, self.ring)

        def compute(s: int) -> None:
            kc, vc = kv.cur
            for t in runner.prepare(steps[s], q, kc):
                acc.add(t.q, *runner.forward(q, kc, vc, t), t.covered)

        run_steps(n, post=lambda s: kv.post(self.ring) if s + 1 < n else None,
                  compute=compute, land=lambda s: kv.swap())
        return acc.result(q.dtype)

    def backward(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                 result_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ring backward (ALGORITHMS.md §3.2): dK/dV travel one step behind their KV, or while the partials fit
        ``HOME_BYTES`` each step's partials go straight home (Note [Partials home]).

        ``result_dtype``: dtype of the returned gradients (default: the inputs'); USP asks for fp32 when it
        still has to sum replicated KV heads' partials.
        """
        runner, steps, d, n = self.runner, self.sched.steps, q.shape[-1], self.sched.n_steps
        dtypes = (result_dtype or q.dtype, result_dtype or k.dtype, result_dtype or v.dtype)
        if n == 1:
            g = runner.backward_all(rows, q, k, v, lse, steps[0])
            return tuple(x.to(dt) for x, dt in zip(g, dtypes))
        if partials_home(k, v, n, self.grad_dtype):
            return self._backward_home(rows, q, k, v, lse, dtypes)
        acc = acc_dtype(q.dtype)
        wire = wire_dtype(self.grad_dtype, q.dtype)
        dq = RowSum(q.shape, acc, q.device)                     # the steps' dQ partials, summed once
        kv = _Rotating(k, v, self.ring)
        shape = _packed_shape(k, v)
        dkv = Double(torch.empty(shape, dtype=wire, device=q.device))  # send (cur) / receive (nxt)
        # the running sum of the block held: the wire buffer itself when the wire is fp32, else an fp32 one
        # whose sum is cast into the wire buffer once per hop
        dkv_acc = None if wire == acc else torch.empty(shape, dtype=acc, device=q.device)
        grads: list = []

        def compute(s: int) -> None:
            kc, vc = kv.cur
            tasks = runner.prepare(steps[s], q, kc)
            grads[:] = [(t, runner.backward(rows, q, kc, vc, lse, t)) for t in tasks]
            for t, (gq, _, _) in grads:
                dq.add(t.q, gq, t.covered)

        def accumulate(s: int) -> None:
            if dkv_acc is None:                # the running dK/dV of the block now held arrived in nxt
                if s > 0:
                    dkv.swap()
                else:
                    dkv.cur.zero_()
                target = dkv.cur
            else:
                target = dkv_acc.copy_(dkv.nxt) if s > 0 else dkv_acc.zero_()
            dk_, dv_ = unpack_kv(target, d)
            for t, (_, gk, gv) in grads:
                dk_[:, t.k] += gk
                dv_[:, t.k] += gv
            grads.clear()

        def post_after(s: int):
            if dkv_acc is not None:
                dkv.cur.copy_(dkv_acc)         # fp32 sums cast only into the wire buffer
            return self.ring.send_recv(dkv.cur, dkv.nxt) if s + 1 < n else None

        with Loop() as loop:
            run_steps(n, post=lambda s: kv.post(self.ring) if s + 1 < n else None,
                      compute=compute, accumulate=accumulate, post_after=post_after, land=lambda s: kv.swap(),
                      loop=loop)
            home = loop.post(self.ring.send_recv(dkv.cur, dkv.nxt, hops=1 - n))   # block (r - n + 1)'s total
            loop.wait(home)
        dk, dv = unpack_kv(dkv.nxt, d)
        return dq.result(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])

    def _backward_home(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                       dtypes: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward with every step's dK/dV partial sent straight to the block's owner (Note [Partials home])."""
        runner, steps, n, ring = self.runner, self.sched.steps, self.sched.n_steps, self.ring
        acc = acc_dtype(q.dtype)
        wire = wire_dtype(self.grad_dtype, q.dtype)
        dq, dk, dv = (RowSum(x.shape, acc, q.device) for x in (q, k, v))
        kv = _Rotating(k, v, self.ring)
        out: list = [None]                  # step s's partial ((a, b), dk rows, dv rows), sent home at step s + 1
        got: list = [None]                  # the receipt in flight, the same form
        regions = self._home_regions(k, v, wire, n)

        def compute(s: int) -> None:
            parts = backward_parts(runner, rows, q, *kv.cur, lse, steps[s], dq)
            if s == 0:                      # the own block: its partials are the owner's already
                hold_own(parts, dk, dv)
            else:
                shape = self._shape("sent", s, q, k, v)
                out[0] = home_partial(parts, k.dtype, v.dtype, wire, *shape) if parts else None

        def post(s: int) -> Exchange:
            ex = Exchange(ring.group)
            if s + 1 < n:
                kv.post(ring, ex)
            if s >= 2:
                got[0] = self._return(ex, s - 1, out[0], q, k, v, wire, regions)
            return ex

        def land(s: int) -> None:
            kv.swap()
            land_home(got, dk, dv)

        with Loop() as loop:
            run_steps(n, post=post, compute=compute, land=land, loop=loop)
            ex = Exchange(ring.group)
            got[0] = self._return(ex, n - 1, out[0], q, k, v, wire, regions)
            loop.wait(loop.post(ex))
            land_home(got, dk, dv)
        return dq.result(dtypes[0]), dk.result(dtypes[1]), dv.result(dtypes[2])

    def _shape(self, which: str, s: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``((a, b), exact)`` of step s's partial - this rank's own ("sent") or the one that comes home ("home") -
        or None: its prepared tasks' key hull, and whether it is exact in the inputs' dtype (``exact_partial``).
        Decided on the first call and kept: a planned call's shapes are fixed, so no later step decides anything."""
        key = (which, s, q.shape[2], k.shape[2], q.dtype)
        if key not in self._partials:
            tasks = self.runner.prepare((self.sched.steps if which == "sent" else self.sched.home)[s], q, k)
            exact = tasks and exact_partial(self.runner, tasks, [(t.k_start, t.k_stop) for t in tasks], q, k,
                                            v.shape[-1])
            self._partials[key] = (key_hull(tasks), exact) if tasks else None
        return self._partials[key]

    def _return(self, ex: Exchange, t: int, partial, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                wire: torch.dtype, regions: list[torch.Tensor] | None):
        """Queue step t's partial to its block's owner (t ranks upstream) and the receipt of this rank's own from t
        ranks downstream, whose rows and dtypes come from the sender's tasks (the same plan on both ends); returns
        the receipt's ``((a, b), dk buffer, dv buffer)`` or None. With ``regions`` (a copy-engine ring's) the
        partial is pushed into the owner's regions of step t and the receipt is read from this rank's own."""
        theirs = self._shape("home", t, q, k, v)
        if regions is None:
            return swap_partial(ex, partial, self.ring.peer(-t), theirs, self.ring.peer(t), k, v, wire)
        mine = regions[2 * (t - 1): 2 * t]
        if partial is not None:
            for x, region in zip(partial[1:], mine):
                self.ring.push(x, region, -t, ex)
        else:                               # nothing of this rank's comes home at t: its lane's barriers still run
            self.ring.skip(mine[0], ex)
        got = receipt(theirs, k, v, wire)
        if got is None:
            return None
        rows, specs = got
        return rows, *(region_view(r, shape, dtype) for r, (shape, dtype) in zip(mine, specs))

    def _home_regions(self, k: torch.Tensor, v: torch.Tensor, wire: torch.dtype, n: int) -> list[torch.Tensor] | None:
        """On a copy-engine ring whose partials fit ``COPY_HOME_BYTES``: per step t = 1 .. n - 1, a byte region for
        the dK and one for the dV partial that comes home at t, each the whole block in the wider of the inputs' and
        the wire's dtype (every rank's receipts differ in rows; the regions lie at the same offsets everywhere).
        Else None: the partials travel on NCCL (Note [Copy-engine ring] in ``seqpar.comm.symmetric``)."""
        if not self.ring.copies:
            return None
        width = max(k.element_size(), wire.itemsize)
        sizes = [x.numel() * width for x in (k, v)]
        if (n - 1) * sum(sizes) > COPY_HOME_BYTES:
            return None
        return self.ring.buffers([((b,), torch.uint8) for b in sizes] * (n - 1), k.device, "home")

COPY_HOME_BYTES = 1 << 30
"""The most bytes of receive regions a copy-engine ring keeps for the partials that come home (``_home_regions``: the
whole block per step, held for the process); past it they travel on NCCL."""

HOME_BYTES = 2 << 30
"""The most bytes of dK/dV partials a pass-KV backward holds to send each step's straight home (Note [Partials
home]); past it the running sums travel."""


def partials_home(k: torch.Tensor, v: torch.Tensor, steps: int, grad_dtype: torch.dtype) -> bool:
    """Whether a pass-KV backward of ``steps`` steps on local ``k``, ``v`` sends each step's partial home (Note
    [Partials home]): ``steps`` partials of the whole block, each element the wider of the inputs' and the wire's
    dtype, within ``HOME_BYTES``."""
    width = max(k.element_size(), torch.finfo(wire_dtype(grad_dtype, k.dtype)).bits // 8)
    per_row = k.shape[0] * (k.shape[2] * k.shape[3] + v.shape[2] * v.shape[3]) * width
    return steps * k.shape[1] * per_row <= HOME_BYTES

