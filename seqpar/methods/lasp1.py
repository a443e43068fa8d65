"""LASP-1 (ALGORITHMS.md §10.2): the state passed along a chain of ranks - the baseline LASP-2 replaces.

Rank r needs the state after every earlier rank, so the states travel ``0 -> 1 -> ... -> W-1`` one hop
at a time and the last rank waits for W-1 DEPENDENT hops (LASP-2 gathers all summaries at once instead).
Kept as a baseline for benchmarks; same slots, summaries and corrections as LASP-2 (``_linear``), so the
two methods differ only in how S_in and dS_out arrive.

Note [LASP-1 schedule]
    Forward: post the receive of S_in from rank r-1, run the local zero-state pass (it hides the wait),
    wait, send ``S_out = Diag(P) S_in + M`` to rank r+1, then correct the first segment's outputs.
    Backward mirrors it from the last rank down: post the receive of dS_out from r+1, run the local
    backward, wait, send ``dS_in = dM + Diag(P) dS_out`` to r-1, then apply the corrections. Neighbours are
    group ranks (``seqpar.comm.ring``), never global ranks. Causal, contiguous layout, no final state.
"""

from __future__ import annotations

import torch

from ..comm.loop import Loop
from ..comm.ring import Exchange, Ring
from ..groups import SeqParallelGroups
from ..kernels.linear import LinearCall, select_linear
from ..layouts import Layout, make_layout
from ..numerics import acc_dtype
from . import _linear
from ._linear import LinearConfig

NAME = "lasp1"
LAYOUTS = ("contiguous",)
MESH_DIMS = 1
OPTIONS: dict[str, object] = {}
FEATURES = frozenset({"varlen", "padding", "initial_state"})


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """Tokens follow ``layout`` over the whole group; this rank holds piece ``groups.index``."""
    return make_layout(layout, groups.world), groups.index


def _setup(q: torch.Tensor, g: torch.Tensor | None, cfg: LinearConfig, groups: SeqParallelGroups):
    layout, index = placement(cfg.layout, groups)
    plan = _linear.linear_plan(layout, q.shape[1] * groups.world, cfg.cu_seqlens, cfg.valid_len,
                               cfg.has_initial_state)
    (slot,) = plan.own(index)
    return slot, Ring(groups.group), select_linear(cfg.kernel, LinearCall.of(q, g))


def _forward(q, k, v, g, h0, cfg: LinearConfig, groups: SeqParallelGroups):
    slot, ring, kern = _setup(q, g, cfg, groups)
    first, last = ring.rank == 0, ring.rank == ring.world - 1
    _, (M,), (P,) = _linear.summaries(k, v, g, (slot,))
    S_in = M.new_zeros(M.shape) if h0 is None or not first else h0.to(M.dtype)
    with Loop() as loop:                  # Note [Faults in a schedule]
        recv = [] if first else loop.post(Exchange(ring.group).recv(S_in, ring.peer(-1)))
        o = _linear.local_forward(kern, q, k, v, g, (slot,), cfg.chunk_size)     # hides the wait for S_in
        loop.wait(recv)
        S_out = P.unsqueeze(-1) * S_in + M
        send = [] if last else loop.post(Exchange(ring.group).send(S_out, ring.peer(1)))
        if slot.receives:
            _linear.add_state_output(o, q, g, slot, S_in)
        loop.wait(send)
    return o.to(q.dtype), (S_in, S_out, P)


def _backward(do, q, k, v, g, h0, S_in, S_out, P, cfg: LinearConfig, groups: SeqParallelGroups):
    slot, ring, kern = _setup(q, g, cfg, groups)
    first, last = ring.rank == 0, ring.rank == ring.world - 1
    acc = acc_dtype(q.dtype)
    wire = acc if cfg.grad_dtype == torch.float32 else cfg.grad_dtype
    dS_wire = S_in.new_zeros(S_in.shape, dtype=wire)
    with Loop() as loop:
        recv = [] if last else loop.post(Exchange(ring.group).recv(dS_wire, ring.peer(1)))
        dM = _linear.state_grad(q, g, do, slot, acc) if slot.receives else torch.zeros_like(S_in)
        grads = _linear.local_backward(kern, do, q, k, v, g, (slot,), cfg.chunk_size)   # hides the wait
        loop.wait(recv)
        dS_out = dS_wire.to(acc)
        dS_in = dM + P.unsqueeze(-1) * dS_out
        send = [] if first else loop.post(Exchange(ring.group).send(dS_in.to(wire), ring.peer(-1)))
        _linear.add_state_grads(grads, q, k, v, g, do, slot, S_in, dS_out, S_out)
        loop.wait(send)
    dh0 = None
    if h0 is not None:
        dh0 = dS_in.to(h0.dtype) if first else torch.zeros_like(h0)
    dq, dk, dv, dg = grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if g is None else dg.to(g.dtype), dh0


class _LASP1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0, cfg: LinearConfig, groups: SeqParallelGroups):
        o, saved = _forward(q, k, v, g, h0, cfg, groups)
        ctx.save_for_backward(q, k, v, g, h0, *saved)
        ctx.cfg, ctx.groups = cfg, groups
        ctx.set_materialize_grads(False)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, h0, *saved = ctx.saved_tensors
        if do is None:
            do = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype)
        return (*_backward(do, q, k, v, g, h0, *saved, ctx.cfg, ctx.groups), None, None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor | None,
              cfg: LinearConfig, groups: SeqParallelGroups) -> tuple[torch.Tensor, None]:
    """LASP-1 on local shards (same inputs as ``lasp2.attention``); returns ``(o, None)``."""
    return _LASP1.apply(q, k, v, g, h0, cfg, groups), None
