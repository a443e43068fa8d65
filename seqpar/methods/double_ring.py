"""Double ring (ALGORITHMS.md §9): an inner ring inside each node, an outer ring across nodes.

The SP group of W ranks is read as W_o nodes ("windows") of ``node_size`` = w ranks: group rank
``R = t * w + p`` is position p of window t. Nodes are only a reading of group ranks, so one host can test
any node size; no process groups are created (pure P2P on the group passed in).

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
    ((t + 1) mod W_o, (p + 1) mod w). With W_o = 1 this is exactly the ring.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..comm.ring import Exchange
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator
from ..layouts import Layout, make_layout
from ..layouts.blocks import Rule, Task, plan
from ..types import AttnOutput
from ._autograd import differentiable
from ._shared import acc_dtype, delta_of, wire_dtype

NAME = "double_ring"
LAYOUTS = ("zigzag", "contiguous")
MESH_DIMS = 1
OPTIONS: dict[str, object] = {"node_size": None}
FEATURES = frozenset({"window", "varlen", "padding", "lse_grad"})


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


@functools.lru_cache(maxsize=256)
def schedule(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
             valid_len: int | None, node_size: int) -> tuple[tuple[tuple[Task, ...], ...], ...]:
    """``tasks[j][s]``: rank ``rank``'s kernel calls at outer step j, inner step s."""
    W = layout.world
    segs = [layout.segments(i, seq_len).cut(doc_bounds, valid_len) for i in range(W)]
    return tuple(tuple(plan(segs[rank], segs[source(rank, j, s, W, node_size)], rule) for s in range(node_size))
                 for j in range(W // node_size))


def _p2p(ex: Exchange, me: int, send: torch.Tensor, to: int, recv: torch.Tensor, frm: int) -> None:
    if to == me:
        recv.copy_(send)
    else:
        ex.send(send, to).recv(recv, frm)


def _forward_loop(q, k, v, group, rank: int, tasks, pr: Peers, runner: TaskRunner):
    acc = Accumulator(q)
    n_out, w = len(tasks), len(tasks[0])
    cur = torch.stack((k, v))
    onext = torch.empty_like(cur)
    spare = [torch.empty_like(cur), torch.empty_like(cur)] if w > 1 else []
    oex = Exchange(group).commit()
    for j in range(n_out):
        oex.wait()                                    # the hand-off posted a whole inner pass ago
        if j > 0:
            cur, onext = onext, cur
        oex = Exchange(group)
        if j + 1 < n_out:
            _p2p(oex, rank, cur, pr.outer_next, onext, pr.outer_prev)
        oex.commit()
        x = cur
        for s in range(w):
            if s + 1 < w:
                iex = Exchange(group)
                _p2p(iex, rank, x, pr.inner_next, spare[s % 2], pr.inner_prev)
                iex.commit()
            for t in runner.prepare(tasks[j][s], q, x[0]):
                acc.add(t.q, *runner.forward(q, x[0], x[1], t))
            if s + 1 < w:
                iex.wait()
                x = spare[s % 2]
    return acc.result(q.dtype)


def _backward_loop(do, q, k, v, out, lse, group, rank: int, tasks, pr: Peers, runner: TaskRunner,
                   grad_dtype: torch.dtype, delta):
    n_out, w = len(tasks), len(tasks[0])
    dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
    cur = torch.stack((k, v))
    onext = torch.empty_like(cur)
    spare = [torch.empty_like(cur), torch.empty_like(cur)] if w > 1 else []
    wire = wire_dtype(grad_dtype, q.dtype)
    dkv, dkv_in, tot, tot_in = (torch.empty(cur.shape, dtype=wire, device=q.device) for _ in range(4))
    for j in range(n_out):
        if j > 0:
            cur, onext = onext, cur
        oex = Exchange(group)
        if j + 1 < n_out:
            _p2p(oex, rank, cur, pr.outer_next, onext, pr.outer_prev)
        if j > 0:                                     # the running total of the block we will end with
            _p2p(oex, rank, tot, pr.outer_next, tot_in, pr.outer_prev)
        oex.commit()
        x, dex = cur, None
        dkv.zero_()
        for s in range(w):
            more = s + 1 < w
            if more:
                iex = Exchange(group)
                _p2p(iex, rank, x, pr.inner_next, spare[s % 2], pr.inner_prev)
                iex.commit()
            if dex is not None:
                dex.wait()                            # the running dK/dV of the block now held
                dkv, dkv_in = dkv_in, dkv
            for t in runner.prepare(tasks[j][s], q, x[0]):
                gq, gk, gv = runner.backward(do, q, x[0], x[1], out, lse, t, delta)
                dq[:, t.q] += gq
                dkv[0][:, t.k] += gk
                dkv[1][:, t.k] += gv
            if more:
                dex = Exchange(group)
                _p2p(dex, rank, dkv, pr.inner_next, dkv_in, pr.inner_prev)
                dex.commit()
                iex.wait()
                x = spare[s % 2]
        oex.wait()
        if j > 0:
            torch.add(dkv, tot_in, out=tot)
        else:
            tot.copy_(dkv)
    home = Exchange(group)
    _p2p(home, rank, tot, pr.home_to, tot_in, pr.home_from)
    home.commit()
    home.wait()
    return dq.to(q.dtype), tot_in[0].to(k.dtype), tot_in[1].to(v.dtype)


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """Tokens follow ``layout`` over the whole group; this rank holds piece ``groups.index``."""
    return make_layout(layout, groups.world), groups.index


def node_size_of(cfg: AttentionConfig, world: int) -> int:
    """The validated ``node_size`` option (ranks per node; it must divide the group size)."""
    w = cfg.option("node_size")
    if w is None:
        raise ValueError(f"method='double_ring' needs node_size (ranks per node, dividing the group size {world}), "
                         f"got None{rank_suffix()}")
    if not isinstance(w, int) or isinstance(w, bool) or w < 1 or world % w:
        raise ValueError(f"node_size must be a positive int dividing the group size {world}, got {w!r}"
                         f"{rank_suffix()}")
    return w


def _setup(q, cfg: AttentionConfig, groups: SeqParallelGroups, needs_delta: bool = False):
    w = node_size_of(cfg, groups.world)
    layout, index = placement(cfg.layout, groups)
    tasks = schedule(layout, index, q.shape[1] * groups.world, cfg.rule, cfg.cu_seqlens, cfg.valid_len, w)
    runner = TaskRunner(cfg.kernel, cfg.scale(q.shape[-1]), deterministic=cfg.deterministic,
                        needs_delta=needs_delta)
    return index, tasks, peers(index, groups.world, w), runner


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups):
    index, tasks, pr, runner = _setup(q, cfg, groups)
    return _forward_loop(q, k, v, groups.group, index, tasks, pr, runner)


def _backward(do, q, k, v, out, lse, dlse, cfg: AttentionConfig, groups: SeqParallelGroups):
    delta = None if dlse is None else delta_of(do, out, dlse, lse.dtype)
    index, tasks, pr, runner = _setup(q, cfg, groups, needs_delta=delta is not None)
    return _backward_loop(do, q, k, v, out, lse, groups.group, index, tasks, pr, runner, cfg.grad_dtype, delta)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """Double-ring attention on local shards ``(B, L, H, D)``; differentiable in q, k, v (and through lse)."""
    node_size_of(cfg, groups.world)                   # validate before any communication
    return differentiable(q, k, v, cfg, groups, _forward, _backward)
