"""Ring attention, pass-KV (ALGORITHMS.md §3): contiguous, zigzag and stripe layouts.

Q stays; K and V rotate around the group one hop per step, the next hop posted before the step's compute
(double-buffered, ``seqpar.comm.ring``). Each step computes what the block planner says rank r's queries
see of the visiting block (Note [Zigzag load balance], Note [Block planning]) and merges it in fp32.
Backward sends dK/dV one step behind their KV and accumulates them in fp32 (``grad_dtype`` on the wire).

GQA/MQA: K and V travel with their own Hkv heads; kernels map query heads to KV heads. Never replicated.
``head_chunks=c`` runs the ring c times, each on Hkv/c KV heads and their query heads, so every fp32
buffer (output accumulator, dq, travelling dK/dV) shrinks c-fold: how 1M-token sequences stay near the
minimum memory. Transfers per step shrink c-fold too, so use it only where steps stay compute-bound.
Windows and documents: the planner skips blocks nobody sees and ends the ring early when a window is
shorter than the ring (Note [Ring truncation] in ``_passkv``).
"""

from __future__ import annotations

import torch

from ..comm.ring import Ring
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..kernels.executor import TaskRunner
from ..layouts import Layout, make_layout
from ..types import AttnOutput
from . import _passkv
from ._autograd import differentiable

NAME = "ring"
LAYOUTS = ("contiguous", "zigzag", "stripe")
MESH_DIMS = 1
OPTIONS: dict[str, object] = {"head_chunks": 1}
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


def _head_groups(q: torch.Tensor, k: torch.Tensor, cfg: AttentionConfig) -> list[tuple[slice, slice]]:
    """(query heads, KV heads) of each pass; query heads h use KV head h // G, so groups stay aligned."""
    c = cfg.option("head_chunks", 1)
    hq, hk = q.shape[2] // c, k.shape[2] // c
    return [(slice(i * hq, (i + 1) * hq), slice(i * hk, (i + 1) * hk)) for i in range(c)]


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups):
    ring, sched, runner = _setup(q, cfg, groups)
    parts = _head_groups(q, k, cfg)
    if len(parts) == 1:
        return _passkv.forward(q, k, v, ring, sched, runner)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float64 if q.dtype == torch.float64
                      else torch.float32, device=q.device)
    for hq, hk in parts:
        o, l = _passkv.forward(q[:, :, hq], k[:, :, hk], v[:, :, hk], ring, sched, runner)
        out[:, :, hq], lse[:, hq] = o, l
    return out, lse


def _backward(do, q, k, v, out, lse, dlse, cfg: AttentionConfig, groups: SeqParallelGroups):
    delta = None
    if dlse is not None:       # d lse_i / d s_ij = P_ij: a gradient on lse shifts Delta by -dlse
        acc = lse.dtype
        delta = (do.to(acc) * out.to(acc)).sum(-1).transpose(1, 2) - dlse.to(acc)
    ring, sched, runner = _setup(q, cfg, groups, needs_delta=delta is not None)
    parts = _head_groups(q, k, cfg)
    if len(parts) == 1:
        return _passkv.backward(do, q, k, v, out, lse, ring, sched, runner, cfg.grad_dtype, delta)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for hq, hk in parts:
        g = _passkv.backward(do[:, :, hq], q[:, :, hq], k[:, :, hk], v[:, :, hk], out[:, :, hq], lse[:, hq], ring,
                             sched, runner, cfg.grad_dtype, None if delta is None else delta[:, hq])
        dq[:, :, hq], dk[:, :, hk], dv[:, :, hk] = g
    return dq, dk, dv


def check(k: torch.Tensor, cfg: AttentionConfig) -> None:
    c = cfg.option("head_chunks", 1)
    if not isinstance(c, int) or c < 1 or k.shape[2] % c:
        raise ValueError(f"head_chunks must be a positive int dividing kv heads ({k.shape[2]}), got {c!r}"
                         f"{rank_suffix()}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """Ring attention on local shards ``(B, L, H, D)``; differentiable in q, k, v (and through lse)."""
    check(k, cfg)
    return differentiable(q, k, v, cfg, groups, _forward, _backward)
