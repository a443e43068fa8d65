"""Double ring (ALGORITHMS.md §9): an inner ring inside each node, an outer ring across nodes.

The SP group of W ranks is read as W_o nodes ("windows") of ``node_size`` = w ranks: group rank
``R = t * w + p`` is position p of window t. Nodes are only a reading of group ranks, so one host can test
any node size. ``node_size`` defaults to torchrun's ``LOCAL_WORLD_SIZE`` when it divides the group.

The inner and outer rings talk on two process groups of their own over the same ranks (created once per
group, on first use, among its members only), so on NCCL an inner hop never queues behind an inter-node
transfer on one communicator.

Note [Double ring]
    Forward. At outer step j rank (t, p) starts an inner pass with ``cur``, the KV that began the
    sequence at rank (t - j, p); during the pass the blocks of window t circulate on the inner ring, so
    at inner step s it computes against the block of rank ``((t - j) mod W_o) w + (p - s) mod w``
    (tasks from the block planner: zigzag over the whole group). The hand-off of ``cur`` to (t + 1, p)
    is posted at the start of the pass and has the whole pass (w steps) to complete: inter-node
    transfers hide while ``T_nic(‖KV‖) <= w * T_step`` (§12.2). Buffers: cur, the outer receive, and the
    inner double buffer (about 4 ‖KV‖).

    Backward. KV recirculates the same way and dQ accumulates locally in fp32. Inside a pass dK/dV
    follow their KV one step behind (as in the ring), starting from zero, so at the end of pass j rank
    (t, p) holds the pass's contributions to the block that began the pass at (t, p + 1). The same rank
    position holds that block's end-of-pass sums in every window, so its running total from earlier
    windows comes from (t - 1, p) over the outer link - posted at the start of the pass, added at its
    end (the inter-node gradient transfer hides behind the pass too) - and goes on to (t + 1, p). After
    the last pass the total has visited every window and takes one final hop home, to
    ((t + 1) mod W_o, (p + 1) mod w). With W_o = 1 this is exactly the ring. At short chunks the partials go
    to the pass's first holder instead (Note [Double-ring partials home]).

Note [Double-ring partials home]
    While the partials fit (``_passkv.partials_home``, the ring's rule: Note [Partials home]), dK/dV do not
    follow their KV around the inner ring as running sums: at inner step s of pass j, rank (t, p)'s partial for
    the block it holds goes straight to (t, p - s), the rank that began the pass with that block, posted with the
    next inner hop (in bf16 where exact, ``exact_partial``). That rank holds its block's w partials and, at the
    pass's end, sums them once with the running total that came over the outer link from (t - 1, p) - which
    began the previous pass with the same block - into the total it sends on to (t + 1, p); after the last pass
    the total goes home to (t + 1, p), the block's owner, in the inputs' dtype (rounded once, where the owner
    used to receive fp32 and cast). So the inter-node traffic is the running-sum path's
    (one total per pass over the outer link) and the partials stay inside the node; what goes is an fp32 pass over
    the whole block at every inner step (read the sum, read the partial, write the sum) and the add of each pass's
    sum into the total: probed at 2K tokens per rank over 8 in nodes of 2 (MHA, emulated on an H200), a
    forward+backward's sums and adds took 0.59 ms of GPU time where the ring's took 0.16
    (``benchmarks/results/2026-11-26-double-ring-home/probe-h200``). The cost: the last step's partial of each
    pass crosses one intra-node hop exposed (none at w = 1), and a rank holds its block's partials until the pass
    ends.

    Where a pass's w partials in the inputs' dtype weigh no more than the total in the wire's dtype they replace
    on the outer link (``_straight_home``: nodes of 1 or 2 with bf16 inputs and the default fp32 wire), even the
    per-pass sums go: every step's partial goes straight to its block's owner (``computer`` is ``source``'s
    inverse: whose partial comes home at each step), one step later, and the owner sums its W partials once - the
    ring's backward (Note [Partials home]) on the double ring's KV movement, with no more bytes crossing nodes
    than the totals carried. The choice rests on facts every rank shares (w and dtypes, not a partial's
    exactness, which is per rank); a partial that is not exact travels in the wire's dtype.

Note [Double ring in a node]
    Nodes are a reading of group ranks, so one host can run a double ring too, and the planner offers one for
    every divisor of W when the group fits in one node. On four H200s (NVLink all-to-all, 2026-11-26, two runs)
    the forward with ``node_size=2`` beat the ring by 6-48% at 2-4K tokens per GPU (GQA 16K: 0.697 / 0.653
    against 0.616 / 0.624; MHA 16K: 0.497 / 0.456 against 0.335 / 0.338; ``benchmarks/results/2026-11-26-4xh200-
    real-run2/``). Not because two peers or two communicators move bytes faster: a step's transfer split that way
    ran no faster on that host (``2026-11-26-4xh200-p2p/``); the cost model credits the outer hop hidden behind
    the inner pass. It is chosen only where the model ranks it first (the GQA forward at W = 4 here); its
    forward+backward lost to Ulysses in every real row.

Note [Double-ring sums]
    The backward's dQ partials are fresh kernel outputs, held and summed once (``RowSum``, Note [One merge per
    call] in ``seqpar.kernels.combine``); at each inner step the running dK/dV that arrived and the step's partials
    are summed in one pass into the fp32 buffer (``sum_parts(out=)``), in the order the adds ran before - the
    arrival first, then the tasks - so the sums are the same bits, where a copy and an add per task each read and
    wrote the buffer (TokenRing's same change: Note [Pass-Q sums] in ``_passq``).

Note [Double-ring buffers]
    On an fp32 wire (``grad_dtype`` fp32, the default) the running sums live in the wire buffers themselves, as in
    the ring (``_passkv``): an inner step sums into the dK/dV that arrived and sends that buffer; a pass's end adds
    its sum into the total that arrived over the outer link (the first pass hands its buffer over) and the next
    pass sends it. Before, every inner hop and every pass copied an fp32 buffer into its wire buffer, and each pass
    also copied its sum into a total: the GPU time of a forward+backward at 2K tokens per rank over 8 (nodes of 2,
    MHA, emulated on an H100) fell from 3.52 to 3.13 ms, at 4K over 4 from 5.09 to 4.69 ms
    (``benchmarks/results/2026-11-26-h100-emulated-auto``). Same sums, same order, same bits. A narrower wire keeps
    fp32 sums and casts into it before each send.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.loop import Double, Loop, run_steps
from ..comm.ring import Exchange
from ..config import AttentionConfig
from ..cost import model
from ..errors import rank_suffix
from ..kernels import combine
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator, RowSum
from ..layouts import Layout
from ..layouts.blocks import Rule, Task, plan
from ..memo import batch_memo
from ..numerics import acc_dtype, wire_dtype
from . import _passkv
from ._shared import (
    backward_parts,
    exact_partial,
    hold_own,
    home_partial,
    key_hull,
    land_home,
    pack_kv,
    swap_partial,
    unpack_kv,
)
from .base import LONG_CONTEXT, BackwardInputs, Call, Method

__all__ = ["METHOD", "Peers", "computer", "home_schedule", "node_size_of", "peers", "schedule", "source"]


@dataclass(frozen=True)
class Peers:
    """One rank's neighbours (group ranks)."""

    inner_next: int
    inner_prev: int
    outer_next: int
    outer_prev: int
    home_to: int
    home_from: int


def source(rank: int, j: int, s: int, world: int, node_size: int) -> int:
    """The rank whose KV ``rank`` computes against at outer step j, inner step s (Note [Double ring])."""
    w, n_out = node_size, world // node_size
    t, p = divmod(rank, w)
    return ((t - j) % n_out) * w + (p - s) % w


def peers(rank: int, world: int, node_size: int) -> Peers:
    w, n_out = node_size, world // node_size
    t, p = divmod(rank, w)

    def at(tt: int, pp: int) -> int:
        return (tt % n_out) * w + pp % w

    return Peers(at(t, p + 1), at(t, p - 1), at(t + 1, p), at(t - 1, p), at(t + 1, p + 1), at(t - 1, p - 1))


@batch_memo()
def schedule(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
             valid_len: int | None, node_size: int) -> tuple[tuple[tuple[Task, ...], ...], ...]:
    """``tasks[j][s]``: rank ``rank``'s kernel calls at outer step j, inner step s."""
    W = layout.world
    segs = [layout.segments(i, seq_len).cut(doc_bounds, valid_len) for i in range(W)]
    return tuple(tuple(plan(segs[rank], segs[source(rank, j, s, W, node_size)], rule) for s in range(node_size))
                 for j in range(W // node_size))


def computer(rank: int, j: int, s: int, world: int, node_size: int) -> int:
    """The rank that computes against ``rank``'s block at outer step j, inner step s (``source``'s inverse)."""
    w, n_out = node_size, world // node_size
    t, p = divmod(rank, w)
    return ((t + j) % n_out) * w + (p + s) % w


@batch_memo()
def home_schedule(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
                  valid_len: int | None, node_size: int, to: str) -> tuple[tuple[tuple[Task, ...], ...], ...]:
    """``home[j][s]``: the tasks whose partials come to ``rank`` = (t, p) at outer step j, inner step s (Note
    [Double-ring partials home]): ``to="starter"``, what (t, p + s) runs against the block that began pass j here;
    ``to="owner"``, what ``computer`` runs against this rank's own block."""
    W, w = layout.world, node_size
    segs = [layout.segments(i, seq_len).cut(doc_bounds, valid_len) for i in range(W)]
    t, p = divmod(rank, w)

    def pair(j: int, s: int) -> tuple[int, int]:
        if to == "owner":
            return computer(rank, j, s, W, w), rank
        return t * w + (p + s) % w, source(rank, j, 0, W, w)

    return tuple(tuple(plan(segs[a], segs[b], rule) for a, b in (pair(j, s) for s in range(w)))
                 for j in range(W // w))


_LINKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # never keeps a group alive


def _timeout(group):
    """``group``'s timeout (the links inherit it, so a fault is bounded the same way), or None."""
    for dev in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(dev)).options._timeout
        except Exception:           # no backend for that device type, or one without options
            continue
    return None


def _links(group) -> tuple:
    """(inner, outer) process groups over ``group``'s ranks: created once per group, among its members only,
    with its timeout."""
    if group not in _LINKS:
        ranks = list(dist.get_process_group_ranks(group))
        kw = {"timeout": t} if (t := _timeout(group)) is not None else {}
        _LINKS[group] = tuple(dist.new_group(ranks, use_local_synchronization=True, **kw) for _ in range(2))
    return _LINKS[group]


def _p2p(ex: Exchange, me: int, send: torch.Tensor, to: int, recv: torch.Tensor, frm: int) -> Exchange:
    if to == me:
        recv.copy_(send)
    else:
        ex.send(send, to).recv(recv, frm)
    return ex


def node_size_of(cfg: AttentionConfig, world: int) -> int:
    """The ``node_size`` option (ranks per node, dividing the group size); default torchrun's
    ``LOCAL_WORLD_SIZE`` when it divides the group."""
    w = cfg.option("node_size")
    if w is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and int(local) >= 1 and world % int(local) == 0:
            return int(local)
        raise ValueError(f"method='double_ring' needs node_size (ranks per node, dividing the group size {world}; "
                         f"the default, torchrun's LOCAL_WORLD_SIZE, is {local or 'unset'}), got None"
                         f"{rank_suffix()}")
    if not isinstance(w, int) or isinstance(w, bool) or w < 1 or world % w:
        raise ValueError(f"node_size must be a positive int dividing the group size {world}, got {w!r}"
                         f"{rank_suffix()}")
    return w


class _Engine:
    """Passes of the inner ring, the outer hand-off posted a whole pass ahead (Note [Double ring])."""

    saves = False

    def __init__(self, call: Call):
        cfg = call.cfg
        self.w = node_size_of(cfg, call.groups.world)
        self.rank, self.groups = call.index, call.groups
        self.tasks = schedule(call.layout, call.index, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len,
                              self.w)
        self.pr = peers(call.index, call.groups.world, self.w)
        self.runner = TaskRunner.of(call)
        self.grad_dtype = cfg.grad_dtype
        self._plan = (call.layout, call.index, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len, self.w)
        self._partials: dict[tuple, tuple[tuple[int, int], bool] | None] = {}

    def _begin_pass(self, outer, j: int, cur: Double) -> Exchange:
        """A backward pass's start: ``cur`` becomes the block that arrived over the outer link (j > 0), and its
        hand-off to (t + 1, p) is queued on an exchange of ``outer`` (not on the last pass), returned uncommitted."""
        if j > 0:
            cur.swap()
        ex = Exchange(outer)
        if j + 1 < len(self.tasks):
            _p2p(ex, self.rank, cur.cur, self.pr.outer_next, cur.nxt, self.pr.outer_prev)
        return ex

    def _groups(self) -> tuple:
        group = self.groups.group
        return _links(group) if dist.get_world_size(group) > 1 else (group, group)

    def forward(self, q, k, v):
        inner, outer = self._groups()
        runner, tasks, pr, me, w, d = self.runner, self.tasks, self.pr, self.rank, self.w, q.shape[-1]
        acc = Accumulator(q, v.shape[-1], defer=True)
        cur = Double(pack_kv(k, v))                      # cur: this pass's start block; nxt: the outer receive
        x = Double(torch.empty_like(cur.cur))            # the inner double buffer
        with Loop() as loop:
            handoff: list = []
            for j in range(len(tasks)):
                loop.wait(handoff)                       # the hand-off posted a whole inner pass ago
                if j > 0:
                    cur.swap()
                handoff = loop.post(_p2p(Exchange(outer), me, cur.cur, pr.outer_next, cur.nxt, pr.outer_prev)
                                    if j + 1 < len(tasks) else None)
                held = [cur.cur]

                def compute(s: int, j=j, held=held) -> None:
                    kc, vc = unpack_kv(held[0], d)
                    for t in runner.prepare(tasks[j][s], q, kc):
                        acc.add(t.q, *runner.forward(q, kc, vc, t), t.covered)

                def post(s: int, held=held):
                    if s + 1 >= w:
                        return None
                    return _p2p(Exchange(inner), me, held[0], pr.inner_next, x.nxt, pr.inner_prev)

                def land(s: int, held=held) -> None:
                    if s + 1 < w:
                        x.swap()
                        held[0] = x.cur

                run_steps(w, post=post, compute=compute, land=land, loop=loop)
        return acc.result(q.dtype)

    def backward(self, b: BackwardInputs):
        if _passkv.partials_home(b.k, b.v, self.groups.world, self.grad_dtype):
            if self._straight_home(b.q, b.k):
                return self._backward_owner(b)
            return self._backward_home(b)
        inner, outer = self._groups()
        q, k, v, rows, lse = b.q, b.k, b.v, b.rows, b.lse
        runner, tasks, pr, me, w, d = self.runner, self.tasks, self.pr, self.rank, self.w, q.shape[-1]
        acc = acc_dtype(q.dtype)
        wire = wire_dtype(self.grad_dtype, q.dtype)
        dq = RowSum(q.shape, acc, q.device)            # Note [Double-ring sums]
        cur = Double(pack_kv(k, v))
        x = Double(torch.empty_like(cur.cur))
        dkv_wire = Double(torch.empty(cur.cur.shape, dtype=wire, device=q.device))
        tot_wire = Double(torch.empty(cur.cur.shape, dtype=wire, device=q.device))
        # the pass's running sum and the block's total over windows: the wire buffers themselves when the wire is
        # fp32 (Note [Double-ring buffers]), else fp32 buffers cast into the wire ones before each send
        apart = wire != acc
        dkv = torch.empty(cur.cur.shape, dtype=acc, device=q.device) if apart else None
        total = torch.empty(cur.cur.shape, dtype=acc, device=q.device) if apart else None
        grads: list = []
        with Loop() as loop:
            for j in range(len(tasks)):
                ex = self._begin_pass(outer, j, cur)
                if j > 0:                                 # the running total of the block we will end with
                    if apart:
                        tot_wire.cur.copy_(total)
                    _p2p(ex, me, tot_wire.cur, pr.outer_next, tot_wire.nxt, pr.outer_prev)
                outer_h = loop.post(ex)
                held = [cur.cur]

                def compute(s: int, j=j, held=held) -> None:
                    kc, vc = unpack_kv(held[0], d)
                    ts = runner.prepare(tasks[j][s], q, kc)
                    grads[:] = [(t, runner.backward(rows, q, kc, vc, lse, t)) for t in ts]
                    for t, (gq, _, _) in grads:
                        dq.add(t.q, gq, t.covered)

                def accumulate(s: int) -> None:
                    """The running dK/dV of the block now held (what arrived, s > 0) plus this step's partials,
                    summed in one pass into the fp32 buffer: on an fp32 wire, the one that arrived."""
                    if apart:
                        target, arrived = dkv, (dkv_wire.nxt if s > 0 else None)
                    else:
                        if s > 0:
                            dkv_wire.swap()
                        target = dkv_wire.cur
                        arrived = target if s > 0 else None
                    prev = unpack_kv(arrived, d) if arrived is not None else (None, None)
                    for i, (view, arr) in enumerate(zip(unpack_kv(target, d), prev)):
                        parts = [(t.k, g[i + 1]) for t, g in grads]
                        if arr is not None:
                            parts.insert(0, (slice(0, view.shape[1]), arr))
                        combine.sum_parts(parts, tuple(view.shape), acc, out=view)
                    grads.clear()

                def post_after(s: int):
                    if s + 1 >= w:
                        return None
                    if apart:
                        dkv_wire.cur.copy_(dkv)           # fp32 sums cast only into the wire buffer
                    return _p2p(Exchange(inner), me, dkv_wire.cur, pr.inner_next, dkv_wire.nxt, pr.inner_prev)

                def post(s: int, held=held):
                    if s + 1 >= w:
                        return None
                    return _p2p(Exchange(inner), me, held[0], pr.inner_next, x.nxt, pr.inner_prev)

                def land(s: int, held=held) -> None:
                    if s + 1 < w:
                        x.swap()
                        held[0] = x.cur

                run_steps(w, post=post, compute=compute, accumulate=accumulate, post_after=post_after, land=land,
                          loop=loop)
                loop.wait(outer_h)
                if apart:
                    if j > 0:
                        torch.add(dkv, tot_wire.nxt, out=total)
                    else:
                        total.copy_(dkv)
                elif j > 0:                               # the total that arrived plus this pass's, in place
                    tot_wire.nxt.add_(dkv_wire.cur)
                    tot_wire.swap()
                else:                                     # the first pass's sum is the total: hand the buffer over
                    tot_wire.cur, dkv_wire.cur = dkv_wire.cur, tot_wire.cur
            if apart:
                tot_wire.cur.copy_(total)
            home = loop.post(_p2p(Exchange(outer), me, tot_wire.cur, pr.home_to, tot_wire.nxt, pr.home_from))
            loop.wait(home)
        dk, dv = unpack_kv(tot_wire.nxt, d)
        return dq.result(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _shape(self, which: str, j: int, s: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``((a, b), exact)`` of pass j, step s's partial - this rank's own ("sent") or the one that comes home
        ("starter", "owner": ``home_schedule``) - or None (``PassKV._shape`` in ``_passkv``, per pass); decided on the
        first call and kept."""
        key = (which, j, s, q.shape[2], k.shape[2], q.dtype)
        if key not in self._partials:
            steps = self.tasks if which == "sent" else home_schedule(*self._plan, which)   # the path's own, once
            tasks = self.runner.prepare(steps[j][s], q, k)
            exact = tasks and exact_partial(self.runner, tasks, [(t.k_start, t.k_stop) for t in tasks], q, k,
                                            v.shape[-1])
            self._partials[key] = (key_hull(tasks), exact) if tasks else None
        return self._partials[key]

    def _backward_home(self, b: BackwardInputs):
        """The backward with each inner step's dK/dV partial sent to the rank that began the pass with its block
        (Note [Double-ring partials home])."""
        inner, outer = self._groups()
        q, k, v, rows, lse = b.q, b.k, b.v, b.rows, b.lse
        runner, tasks, pr, me, w, d = self.runner, self.tasks, self.pr, self.rank, self.w, q.shape[-1]
        acc = acc_dtype(q.dtype)
        wire = wire_dtype(self.grad_dtype, q.dtype)
        t_, p_ = divmod(me, w)
        up = [t_ * w + (p_ - s) % w for s in range(w)]           # whose block this rank computes at step s
        down = [t_ * w + (p_ + s) % w for s in range(w)]         # who computes ours at step s
        dq = RowSum(q.shape, acc, q.device)
        cur = Double(pack_kv(k, v))
        x = Double(torch.empty_like(cur.cur))
        total_in = [torch.empty(y.shape, dtype=wire, device=q.device) for y in (k, v)]
        total: list = [None, None]          # the block's running total over windows (wire dtype), sent on
        with Loop() as loop:
            for j in range(len(tasks)):
                ex = self._begin_pass(outer, j, cur)
                if j > 0:                   # the running total of the block we begin this pass with
                    for tot, into in zip(total, total_in):
                        _p2p(ex, me, tot, pr.outer_next, into, pr.outer_prev)
                outer_h = loop.post(ex)
                held = [cur.cur]
                sums = [RowSum(y.shape, acc, q.device) for y in (k, v)]     # this pass's block: dK, dV
                out: list = [None]          # step s's partial, sent at step s + 1
                got: list = [None]          # the receipt in flight

                def compute(s: int, j=j, held=held, sums=sums, out=out) -> None:
                    parts = backward_parts(runner, rows, q, *unpack_kv(held[0], d), lse, tasks[j][s], dq)
                    if s == 0:              # the block we began the pass with: its partials stay
                        hold_own(parts, *sums)
                    else:
                        shape = self._shape("sent", j, s, q, k, v)
                        out[0] = home_partial(parts, k.dtype, v.dtype, wire, *shape) if parts else None

                def send_home(ex: Exchange, s: int, j=j, out=out, got=got) -> Exchange:
                    """Step s's partial to the rank that began the pass with its block, ours from step s's holder."""
                    got[0] = swap_partial(ex, out[0], up[s], self._shape("starter", j, s, q, k, v), down[s], k, v,
                                          wire)
                    out[0] = None
                    return ex

                def post(s: int, held=held, send_home=send_home) -> Exchange:
                    ex = Exchange(inner)
                    if s + 1 < w:
                        _p2p(ex, me, held[0], pr.inner_next, x.nxt, pr.inner_prev)
                    if s >= 2:
                        send_home(ex, s - 1)
                    return ex

                def land(s: int, held=held, sums=sums, got=got) -> None:
                    if s + 1 < w:
                        x.swap()
                        held[0] = x.cur
                    land_home(got, *sums)

                run_steps(w, post=post, compute=compute, land=land, loop=loop)
                if w > 1:                   # the last step's partial: one exposed hop inside the node
                    loop.wait(loop.post(send_home(Exchange(inner), w - 1)))
                    land_home(got, *sums)
                loop.wait(outer_h)
                if j > 0:
                    for acc_sum, into in zip(sums, total_in):
                        acc_sum.add(slice(0, into.shape[1]), into)
                last = j + 1 == len(tasks)      # the final total goes home in the inputs' dtype: the same rounding
                total = [acc_sum.result(y.dtype if last else wire) for acc_sum, y in zip(sums, (k, v))]
            home = Exchange(outer)          # the total of the block that began the last pass here goes home
            dk, dv = (torch.empty(y.shape, dtype=y.dtype, device=y.device) for y in (k, v))
            for tot, into in zip(total, (dk, dv)):
                _p2p(home, me, tot, pr.outer_next, into, pr.outer_prev)
            loop.wait(loop.post(home))
        return dq.result(q.dtype), dk, dv

    def _straight_home(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether every partial goes straight to its block's owner (Note [Double-ring partials home]): when a
        pass's w partials in the inputs' dtype weigh no more than the one total in the wire's dtype they replace on
        the outer link - nodes of 1 or 2 with bf16 inputs and an fp32 wire. Decided from facts every rank shares
        (a partial's exactness is per rank), so every rank takes the same path."""
        return self.w * k.dtype.itemsize <= wire_dtype(self.grad_dtype, q.dtype).itemsize

    def _backward_owner(self, b: BackwardInputs):
        """The backward with every step's dK/dV partial sent straight to its block's owner and summed there once, as
        the ring's (Note [Double-ring partials home])."""
        inner, outer = self._groups()
        q, k, v, rows, lse = b.q, b.k, b.v, b.rows, b.lse
        runner, tasks, pr, me, w, d = self.runner, self.tasks, self.pr, self.rank, self.w, q.shape[-1]
        W = len(tasks) * w
        acc = acc_dtype(q.dtype)
        wire = wire_dtype(self.grad_dtype, q.dtype)
        dq, dk, dv = (RowSum(x.shape, acc, q.device) for x in (q, k, v))
        cur = Double(pack_kv(k, v))
        x = Double(torch.empty_like(cur.cur))
        out: list = [None]                  # the last step's partial ((a, b), dk rows, dv rows), sent one step later
        got: list = [None]                  # the receipt in flight, the same form
        pending: list = [None]              # (j, s) of the step whose partial goes next

        def send_home() -> Exchange | None:
            """The pending step's partial to its block's owner, and ours from the rank that computed it then."""
            if pending[0] is None:
                return None
            j, s = pending[0]
            ex = Exchange(outer)
            got[0] = swap_partial(ex, out[0], source(me, j, s, W, w), self._shape("owner", j, s, q, k, v),
                                  computer(me, j, s, W, w), k, v, wire)
            out[0] = pending[0] = None
            return ex

        with Loop() as loop:
            for j in range(len(tasks)):
                outer_h = loop.post(self._begin_pass(outer, j, cur))
                held = [cur.cur]

                def compute(s: int, j=j, held=held) -> None:
                    parts = backward_parts(runner, rows, q, *unpack_kv(held[0], d), lse, tasks[j][s], dq)
                    if j == 0 and s == 0:       # the own block
                        hold_own(parts, dk, dv)
                        return
                    shape = self._shape("sent", j, s, q, k, v)
                    out[0] = home_partial(parts, k.dtype, v.dtype, wire, *shape) if parts else None
                    pending[0] = (j, s)

                def post(s: int, held=held) -> list:
                    hs = [send_home()]
                    if s + 1 < w:
                        hs.append(_p2p(Exchange(inner), me, held[0], pr.inner_next, x.nxt, pr.inner_prev))
                    return hs

                def land(s: int, held=held) -> None:
                    if s + 1 < w:
                        x.swap()
                        held[0] = x.cur
                    land_home(got, dk, dv)

                run_steps(w, post=post, compute=compute, land=land, loop=loop)
                loop.wait(outer_h)
            loop.wait(loop.post(send_home()))   # the last step's partial
            land_home(got, dk, dv)
        return dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype)

def _check(call: Call) -> None:
    node_size_of(call.cfg, call.groups.world)


def _steps(p: model.Problem, layout: str, w: int) -> list:
    """The busiest rank's call at outer step j, inner step s, flattened (index ``j w + s``): the ring's
    closed form for one document (the critical step does not depend on the visiting order), else the
    schedule's own pairs (``source``, Note [Packed batches] in ``seqpar.cost.model``)."""
    W = p.world
    if not p.shaped:
        steps = list(model.steps(p, layout, W))
        return steps + [None] * (W - len(steps))
    return list(model.packed_steps(p, layout, W, lambda r, i: source(r, i // w, i % w, W, w), W, trim=False))


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """Inner ring in a node, outer ring across nodes, hidden behind a whole inner pass (ALGORITHMS.md §9)."""
    W, L = p.world, p.seq_len / p.world
    w = c.option("node_size")
    if not isinstance(w, int) or w < 1 or W % w:
        raise ValueError(f"node_size must be a positive int dividing W={W} to predict double_ring (name it: "
                         f"double_ring/n4/zigzag), got {w!r}")
    Wo = W // w
    steps = _steps(p, c.layout, w)
    kv, dkv = p.act(L, 2 * p.kv_heads), p.act(L, 2 * p.kv_heads, p.grad_bytes)
    inner, outer = model.Group(w), model.Group(Wo, w)
    f, b = model.tallies(m, "double_ring")
    for tally, direction in ((f, "fwd"), (b, "bwd")):
        pay = kv if direction == "fwd" else kv + dkv
        t_in, t_out = m.comm_ms("ring", pay, inner), m.comm_ms("ring", pay, outer)
        last_pass = 0.0
        for j in range(Wo):
            if j:
                tally.wait(max(0.0, t_out - last_pass), pay)
            last_pass = 0.0
            for s in range(w):
                blk = steps[j * w + s]
                comp = m.kernel_ms(p, blk, p.heads, direction)
                if direction == "fwd" and (j or s) and blk is not None:
                    comp += m.merge_ms(p, blk.rows, p.heads)
                more = s + 1 < w
                last_pass += tally.step(comp, t_in if more else 0.0, "ring", pay if more else 0.0)
            if direction == "bwd" and w > 1:
                tally.wait(m.comm_ms("ring", dkv, inner), dkv)            # dK/dV back to the pass's first rank
        if direction == "bwd" and Wo > 1:
            tally.wait(m.comm_ms("ring", dkv, outer), dkv)                # the last outer hop home
    fb, bb = model.base_mem(p)
    acc = p.act(L, p.heads, 4) + p.rowstat(L, p.heads)
    dkv32 = p.act(L, 2 * p.kv_heads, 4)
    cost = model.Cost(f, b, fb + 4 * kv + acc + p.act(L, p.heads),           # current, inner next, outer x2
                      bb + 4 * kv + 4 * dkv32 + p.act(L, p.heads, 4) + model.temps(p, L, p.heads, p.kv_heads))
    t_hide = m.comm_ms("ring", kv, outer)
    cost.notes.append(f"outer hop {t_hide:.2f} ms hides behind {w} inner steps")
    if p.shaped:
        cost.balance = model.balance(p, c.layout, W, tuple(steps))
    return cost.prediction()


def _candidates(p: model.Problem, topo, layouts: tuple[str, ...], ulysses: int | None) -> list:
    """The topology's node size when the group spans more than one node; inside one node, every divisor of W
    between 1 and W (two rings of one host's ranks: Note [Double ring in a node])."""
    w = topo.node_size
    if w >= p.world:
        sizes = [d for d in range(2, p.world) if p.world % d == 0]
    elif w > 1 and p.world % w == 0:
        sizes = [w]
    else:
        sizes = []
    return [model.Candidate("double_ring", lay, options=(("node_size", d),)) for d in sizes for lay in layouts]


def _why_not(p: model.Problem, c: model.Candidate) -> list[str]:
    w = c.option("node_size")
    return [f"node_size {w} must divide W={p.world}"] if p.world % w else []


def _bench_specs(preset, world: int) -> list:
    """Nodes of 2 ranks on one host (the schedule, not the NICs, is what one host can time)."""
    if preset.seq_len >= LONG_CONTEXT or world < 4 or world % 2:
        return []
    return [("zigzag", (("node_size", 2),), None)]


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    if world % 2 or world <= 2:
        return []
    return [dict(layout="zigzag", options=(("node_size", 2),))]


METHOD = Method(
    name="double_ring",
    summary="inner ring per node, outer ring across nodes",
    layouts=("zigzag", "contiguous", "balanced", "doc_zigzag", "doc_contiguous"),
    options={"node_size": None},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "mask",
                        "document_layouts"}),
    check=_check,
    engine=_Engine,
    cost=_cost,
    candidates=_candidates,
    why_not=_why_not,
    bench_specs=_bench_specs,
    demo_cases=_demo_cases,
)
