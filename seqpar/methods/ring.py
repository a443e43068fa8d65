"""Ring attention, pass-KV (ALGORITHMS.md §3): contiguous, zigzag and stripe layouts.

Q stays; K and V rotate around the group one hop per step, the next hop posted before the step's compute
(double-buffered, ``seqpar.comm.ring``). Each step computes what the block planner says rank r's queries
see of the visiting block (Note [Zigzag load balance], Note [Block planning]) and merges it in fp32.
Backward sends dK/dV one step behind their KV and accumulates them in fp32 (``grad_dtype`` on the wire).

GQA/MQA: K and V travel with their own Hkv heads; kernels map query heads to KV heads. Never replicated.
Windows and documents: the planner skips blocks nobody sees and ends the ring early when a window is
shorter than the ring (Note [Ring truncation] in ``_passkv``).
"""

from __future__ import annotations

import torch

from ..comm.ring import Ring
from ..config import AttentionConfig
from ..groups import SeqParallelGroups
from ..kernels.executor import TaskRunner
from ..layouts import Layout, make_layout
from ..types import AttnOutput
from . import _passkv

NAME = "ring"
LAYOUTS = ("contiguous", "zigzag", "stripe")
MESH_DIMS = 1
OPTIONS: dict[str, object] = {}
FEATURES = frozenset({"window", "varlen", "padding", "lse_grad"})


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """Tokens follow ``layout`` over the whole group; this rank holds piece ``groups.index``."""
    return make_layout(layout, groups.world), groups.index


def _setup(q: torch.Tensor, cfg: AttentionConfig, groups: SeqParallelGroups, needs_delta: bool = False):
    layout, index = placement(cfg.layout, groups)
    seq_len = q.shape[1] * groups.world
    sched = _passkv.schedule(layout, index, seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
    runner = TaskRunner(cfg.kernel, cfg.scale(q.shape[-1]), deterministic=cfg.deterministic,
                        needs_delta=needs_delta)
    return Ring(groups.group), sched, runner


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups):
    ring, sched, runner = _setup(q, cfg, groups)
    return _passkv.forward(q, k, v, ring, sched, runner)


def _backward(do, q, k, v, out, lse, dlse, cfg: AttentionConfig, groups: SeqParallelGroups):
    delta = None
    if dlse is not None:       # d lse_i / d s_ij = P_ij: a gradient on lse shifts Delta by -dlse
        acc = lse.dtype
        delta = (do.to(acc) * out.to(acc)).sum(-1).transpose(1, 2) - dlse.to(acc)
    ring, sched, runner = _setup(q, cfg, groups, needs_delta=delta is not None)
    return _passkv.backward(do, q, k, v, out, lse, ring, sched, runner, cfg.grad_dtype, delta)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, groups):
        out, lse = _forward(q, k, v, cfg, groups)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.groups = cfg, groups
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(dout, q, k, v, out, lse, dlse, ctx.cfg, ctx.groups)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """Ring attention on local shards ``(B, L, H, D)``; differentiable in q, k, v (and through lse)."""
    return AttnOutput(*_RingAttention.apply(q, k, v, cfg, groups))
