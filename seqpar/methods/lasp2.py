"""LASP-2 (ALGORITHMS.md §10): linear attention over ranks by ONE all-gather of state summaries.

Each rank's tokens are one or two slots (contiguous / zigzag pieces; Note [Slot summaries] in ``_linear``).
A slot's effect on the running state is a small summary ``[M | P]``; every rank gathers all summaries
and scans them in fp32 to get the state entering its own slots - no dependent chain of hops (that is
LASP-1, ``methods/lasp1.py``). Documents reset the state (``P = 0``), padding passes it through.

Note [LASP-2 schedule]
    Forward::

        1. [M_c | P_c] for own slots (one GEMM on decayed K each)
        2. post the all-gather of the summaries                    (seqpar.comm.states)
        3. local chunked pass of every segment at zero state        overlaps 2
        4. wait; exclusive prefix scan in fp32, slots in position order:  S <- Diag(P_s) S + M_s
        5. o_f += (Q_f * e^{G}) S_in(c)                             (Note [Closed-form corrections])
        saved: q, k, v, g, S_in and S_out of own slots, every slot's P (no per-chunk states)

    Backward::

        1. dM_c = (Q_f * e^{G})^T dO_f for own slots (+ this rank's final-state gradient)
        2. post the all-gather of dM (``grad_dtype`` on the wire)
        3. local backward of the zero-state pass (autograd of the chunked form)   overlaps 2
        4. wait; suffix scan in fp32:  D <- dM_t + Diag(P_t) D  from the last slot down -> dS_out(c)
        5. closed-form corrections for dq, dk, dv and the gates

    Non-causal (no decay): every token sees its whole document, ``o = Q S_doc``. Without documents
    ``S = all_reduce(sum_r K_r^T V_r)`` (fewer bytes than gathering W summaries; with ``deterministic`` an
    all-gather summed in rank order, since NCCL's all-reduce order is not fixed); with documents each slot
    contributes the sums of its first and last segments through one all-gather (only those can share a
    document with another slot). Backward is the same with ``dS = Q^T dO``.

Gradients of replicated inputs follow the rule for replicated parameters: each rank returns its share and
the sum over the group is the total. ``initial_state`` is read on the rank holding position 0 (its value on
other ranks is not used) and its whole gradient is returned there (zeros elsewhere); a constant decay
``(H,)`` gets each rank's partial; the final state is returned on every rank and the gradients arriving
on every rank are summed.
"""

from __future__ import annotations

import torch

from ..comm.states import all_reduce_states, gather_states
from ..groups import SeqParallelGroups
from ..kernels.linear import LinearCall, select_linear
from ..layouts import Layout, make_layout
from ..numerics import acc_dtype
from . import _linear
from ._linear import LinearConfig, LinearPlan

NAME = "lasp2"
LAYOUTS = ("contiguous", "zigzag")
MESH_DIMS = 1
OPTIONS: dict[str, object] = {}
FEATURES = frozenset({"noncausal", "varlen", "padding", "initial_state", "final_state"})


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """Tokens follow ``layout`` over the whole group; this rank holds piece ``groups.index``."""
    return make_layout(layout, groups.world), groups.index


def _setup(q: torch.Tensor, g: torch.Tensor | None, cfg: LinearConfig, groups: SeqParallelGroups):
    layout, index = placement(cfg.layout, groups)
    plan = _linear.linear_plan(layout, q.shape[1] * groups.world, cfg.cu_seqlens, cfg.valid_len, cfg.has_initial_state)
    return plan, index, select_linear(cfg.kernel, LinearCall.of(q, g))


def _prefix(plan: LinearPlan, rank: int, every: torch.Tensor, to_end: bool):
    """States entering own slots (local order) and, with ``to_end``, the state after the last slot."""
    own = plan.own(rank)
    stop = len(plan.slots) if to_end else max(plan.order(s) for s in own) + 1
    S = every.new_zeros((*every.shape[1:-1], every.shape[-1] - 1))
    entering = {}
    for slot in plan.slots[:stop]:
        if slot.owner == rank:
            entering[slot.piece] = S.clone()
        row = every[plan.row(slot)]
        S.mul_(row[..., -1:]).add_(row[..., :-1])                 # Diag(P) S + M in place, sequential fp32
    return [entering[s.piece] for s in own], (S if to_end else None)


def _suffix(plan: LinearPlan, rank: int, dM: torch.Tensor, P: torch.Tensor, seed: torch.Tensor | None):
    """Gradients of the states leaving own slots (local order), from the slots after each."""
    own = plan.own(rank)
    first = min(plan.order(s) for s in own)
    D = torch.zeros_like(dM[0]) if seed is None else seed.clone()
    leaving = {}
    for i in range(len(plan.slots) - 1, first - 1, -1):
        slot = plan.slots[i]
        if slot.owner == rank:
            leaving[slot.piece] = D.clone()
        if i > first:
            r = plan.row(slot)
            D.mul_(P[r].unsqueeze(-1)).add_(dM[r])                # dM + Diag(P) D in place, sequential fp32
    return [leaving[s.piece] for s in own]


def _forward(q, k, v, g, h0, cfg: LinearConfig, groups: SeqParallelGroups):
    plan, rank, kern = _setup(q, g, cfg, groups)
    own = plan.own(rank)
    fold = (plan.slots[0], h0) if h0 is not None and plan.slots[0].owner == rank else None
    send, Ms, Ps = _linear.summaries(k, v, g, own, fold)
    pending = gather_states(send, groups.group)                   # posted before the local pass ...
    o = _linear.local_forward(kern, q, k, v, g, own, cfg.chunk_size)      # ... which hides it
    every = pending.wait().flatten(0, 1)                          # (W * pieces, B, H, K, V + 1) fp32
    S_in, final = _prefix(plan, rank, every, cfg.output_final_state)
    S_out = []
    for i, slot in enumerate(own):
        if fold is not None and slot == fold[0]:
            S_in[i] = h0.to(every.dtype)
        if slot.receives:
            _linear.add_state_output(o, q, g, slot, S_in[i])
        S_out.append(Ps[i].unsqueeze(-1) * S_in[i] + Ms[i])
    P_all = every[..., -1].clone()                                # keep the P's, free the gather buffer
    return o.to(q.dtype), final, (torch.stack(S_in), torch.stack(S_out), P_all)


def _backward(do, dfinal, q, k, v, g, h0, S_in, S_out, P_all, cfg: LinearConfig, groups: SeqParallelGroups):
    plan, rank, kern = _setup(q, g, cfg, groups)
    own = plan.own(rank)
    acc = acc_dtype(q.dtype)
    wire = acc if cfg.grad_dtype == torch.float32 else cfg.grad_dtype
    dM = [_linear.state_grad(q, g, do, s, acc) if s.receives else None for s in own]
    send = S_in.new_zeros(len(own) + cfg.output_final_state, *S_in.shape[1:], dtype=wire)
    for i, d in enumerate(dM):
        if d is not None:
            send[i] = d
    if cfg.output_final_state and dfinal is not None:
        send[-1] = dfinal
    pending = gather_states(send, groups.group)                   # posted before the local backward ...
    grads = _linear.local_backward(kern, do, q, k, v, g, own, cfg.chunk_size)   # ... which hides it
    every = pending.wait().to(acc)                                # (W, pieces [+1], B, H, K, V)
    seed = every[:, -1].sum(0) if cfg.output_final_state else None
    dS_out = _suffix(plan, rank, every[:, :len(own)].flatten(0, 1), P_all, seed)
    for i, slot in enumerate(own):
        _linear.add_state_grads(grads, q, k, v, g, do, slot, S_in[i], dS_out[i], S_out[i])
    dh0 = None
    if h0 is not None:
        dh0 = torch.zeros_like(h0)
        first = plan.slots[0]
        if first.owner == rank:
            i = own.index(first)
            dh0 = (dM[i] + P_all[plan.row(first)].unsqueeze(-1) * dS_out[i]).to(h0.dtype)
    dq, dk, dv, dg = grads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None if g is None else dg.to(g.dtype), dh0


def _doc_totals(sums, shape, plan: LinearPlan, rank: int, cfg: LinearConfig, groups: SeqParallelGroups,
                acc: torch.dtype, wire: torch.dtype, device: torch.device):
    """Per own segment, its document's total of ``sums`` over all ranks (Note [LASP-2 schedule], non-causal).

    A rank without valid tokens contributes zeros (it still joins the collective).
    """
    if cfg.cu_seqlens is None:                                    # one document: an all-reduce
        local = torch.zeros(shape, dtype=acc, device=device)
        for t in (t for per in sums for t in per):
            local += t
        if cfg.deterministic:     # a fixed order: every rank's sum, added in rank order (NCCL's is not fixed)
            total = gather_states(local.to(wire), groups.group).wait().to(acc).sum(0)
        else:
            total = all_reduce_states(local.to(wire), groups.group).wait().to(acc)
        return [[total] * len(per) for per in sums]
    send = torch.zeros(len(sums), 2, *shape, dtype=wire, device=device)
    for i, per in enumerate(sums):
        if per:
            send[i, 0] = per[0]
        if len(per) > 1:
            send[i, 1] = per[-1]
    every = gather_states(send, groups.group).wait().to(acc).flatten(0, 2)   # (W * pieces * 2, B, H, K, V)
    srcs = _linear.noncausal_sources(plan, rank)
    return [[t if src is None else sum(every[r] for r in src) for t, src in zip(per, srcs[i])]
            for i, per in enumerate(sums)]


def _forward_noncausal(q, k, v, cfg: LinearConfig, groups: SeqParallelGroups):
    plan, rank, _ = _setup(q, None, cfg, groups)
    own = plan.own(rank)
    acc = acc_dtype(q.dtype)
    shape = (q.shape[0], q.shape[2], q.shape[3], v.shape[-1])
    totals = _doc_totals(_linear.segment_sums(k, v, own, acc), shape, plan, rank, cfg, groups, acc, acc, q.device)
    o = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=acc)
    for slot, per in zip(own, totals):
        for s, S in zip(slot.segs, per):
            o[:, s.rows] = torch.einsum("bnhk,bhkv->bnhv", q[:, s.rows].to(acc), S)
    flat = [S for per in totals for S in per]
    return o.to(q.dtype), None, (torch.stack(flat) if flat else o.new_zeros(0, *shape, dtype=acc),)


def _backward_noncausal(do, q, k, v, totals, cfg: LinearConfig, groups: SeqParallelGroups):
    plan, rank, _ = _setup(q, None, cfg, groups)
    own = plan.own(rank)
    acc = acc_dtype(q.dtype)
    wire = acc if cfg.grad_dtype == torch.float32 else cfg.grad_dtype
    shape = (q.shape[0], q.shape[2], q.shape[3], v.shape[-1])
    dtotals = _doc_totals(_linear.segment_sums(q, do, own, acc), shape, plan, rank, cfg, groups, acc, wire, q.device)
    dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
    n = 0
    for slot, per in zip(own, dtotals):
        for s, dS in zip(slot.segs, per):
            S = totals[n]
            n += 1
            dq[:, s.rows] = torch.einsum("bnhv,bhkv->bnhk", do[:, s.rows].to(acc), S)
            dk[:, s.rows] = torch.einsum("bnhv,bhkv->bnhk", v[:, s.rows].to(acc), dS)
            dv[:, s.rows] = torch.einsum("bnhk,bhkv->bnhv", k[:, s.rows].to(acc), dS)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class _LASP2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, h0, cfg: LinearConfig, groups: SeqParallelGroups):
        if cfg.causal:
            o, final, saved = _forward(q, k, v, g, h0, cfg, groups)
        else:
            o, final, saved = _forward_noncausal(q, k, v, cfg, groups)
        ctx.save_for_backward(q, k, v, g, h0, *saved)
        ctx.cfg, ctx.groups = cfg, groups
        ctx.set_materialize_grads(False)
        return (o, final) if cfg.output_final_state else o

    @staticmethod
    def backward(ctx, do, dfinal=None):
        q, k, v, g, h0, *saved = ctx.saved_tensors
        cfg = ctx.cfg
        if do is None:
            do = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=v.dtype)
        if cfg.causal:
            grads = _backward(do, dfinal, q, k, v, g, h0, *saved, cfg, ctx.groups)
        else:
            grads = _backward_noncausal(do, q, k, v, saved[0], cfg, ctx.groups)
        return (*grads, None, None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, h0: torch.Tensor | None,
              cfg: LinearConfig, groups: SeqParallelGroups) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LASP-2 on local shards; q scaled and feature-mapped, g None | ``(B, L, H)`` | ``(B, L, H, K)`` (log, <= 0).

    Returns ``(o (B, L, H, V) in q's dtype, final_state (B, H, K, V) fp32 or None)``; differentiable in
    q, k, v, g and h0 (and through the final state).
    """
    res = _LASP2.apply(q, k, v, g, h0, cfg, groups)
    return res if cfg.output_final_state else (res, None)
