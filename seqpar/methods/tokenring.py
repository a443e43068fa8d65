"""TokenRing, pass-Q (ALGORITHMS.md §7): K and V stay on their owner; queries travel, results come home.

Q moves one hop per step; each step's partial (out, lse) goes straight back to the query's owner over
another link, overlapped with the next step's compute, and is merged there in fp32. After the zigzag
wrap only the half of Q that is still needed travels (Note [Pass-Q schedule] in ``_passq``). Backward
moves (Q, dO, lse, Delta) the same way, keeps dK/dV in place (fp32) and returns dQ partials in
``grad_dtype``. Whether pass-Q pays against the ring (pass-KV) is ``seqpar.choose_pass``: in bytes,
pass-Q is never cheaper for self-attention under GQA and breaks even for MHA; its advantages are the
halves after the wrap and spreading Q and O over two links.

Every layout works (the block planner decides what each step computes); causal balance needs zigzag.
GQA/MQA: K and V never move and are never replicated.
"""

from __future__ import annotations

import dataclasses

import torch

from ..comm.ring import Ring
from ..config import AttentionConfig
from ..groups import SeqParallelGroups
from ..kernels.base import KernelCall, select
from ..kernels.executor import TaskRunner
from ..layouts import Layout, make_layout
from ..types import AttnOutput
from . import _passq
from ._autograd import differentiable
from ._shared import delta_of

NAME = "tokenring"
LAYOUTS = ("zigzag", "contiguous", "stripe")
MESH_DIMS = 1
OPTIONS: dict[str, object] = {}
FEATURES = frozenset({"window", "varlen", "padding", "lse_grad"})


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """Tokens follow ``layout`` over the whole group; this rank holds piece ``groups.index``."""
    return make_layout(layout, groups.world), groups.index


def _plan(q: torch.Tensor, cfg: AttentionConfig, groups: SeqParallelGroups) -> _passq.PassQPlan:
    layout, _ = placement(cfg.layout, groups)
    return _passq.schedule(layout, q.shape[1] * groups.world, cfg.rule, cfg.cu_seqlens, cfg.valid_len)


def _runner(q: torch.Tensor, cfg: AttentionConfig, needs_delta: bool = False) -> TaskRunner:
    return TaskRunner(cfg.kernel, cfg.scale(q.shape[-1]), deterministic=cfg.deterministic, needs_delta=needs_delta)


def _kernels_take_delta(sp: _passq.PassQPlan, cfg: AttentionConfig, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel serving every task of the schedule accepts a precomputed Delta.

    Decided from the whole group's plan, so every rank sends the same bundle (Delta or O).
    """
    for kind in sorted(sp.kinds):
        call = KernelCall(q.device.type, q.dtype, q.shape[-1], q.shape[2], k.shape[2], kind, cfg.deterministic)
        if select(cfg.kernel, call).not_supported_reasons(dataclasses.replace(call, needs_delta=True)):
            return False
    return True


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups):
    return _passq.forward(q, k, v, Ring(groups.group), _plan(q, cfg, groups), _runner(q, cfg))


def _backward(do, q, k, v, out, lse, dlse, cfg: AttentionConfig, groups: SeqParallelGroups):
    sp = _plan(q, cfg, groups)
    # Delta (fp32, B*H*L) travels instead of O (B*L*H*D) where the kernel accepts it; a gradient on lse
    # can only be expressed through Delta, so it asks for such a kernel (as the ring does).
    use_delta = dlse is not None or _kernels_take_delta(sp, cfg, q, k)
    delta = delta_of(do, out, dlse, lse.dtype) if use_delta else None
    return _passq.backward(do, q, k, v, out, lse, Ring(groups.group), sp, _runner(q, cfg, use_delta),
                           cfg.grad_dtype, delta)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """TokenRing attention on local shards ``(B, L, H, D)``; differentiable in q, k, v (and through lse)."""
    return differentiable(q, k, v, cfg, groups, _forward, _backward)
