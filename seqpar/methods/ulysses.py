"""Ulysses all-to-all attention (ALGORITHMS.md §5): sequence-sharded in, head-sharded compute, back.

Rank u of U holds tokens ``[u L, (u+1) L)`` with all heads. One all-to-all (q, k, v packed) gives every
rank the FULL sequence for H/U query heads; it runs the block planner's tasks of the whole sequence against
itself (causal, windows, global ``cu_seqlens`` documents and padding exactly as on one device, no merge, no
causal imbalance); a second all-to-all returns out and lse. Backward: dO (and dlse) go to head-sharded, the
local block backward runs with the final out/lse, dq/dk/dv come back in one collective.

GQA/MQA (Note [GQA head slots] in ``seqpar.comm.all_to_all``): each rank receives exactly the KV heads its
query heads use; when Hkv < U each KV head goes to U/Hkv ranks (on the wire only) and its gradient partials
are summed on the way back. Valid when U divides H, and U divides Hkv or Hkv divides U; anything else
raises before any collective, naming the valid degrees.

Communication per rank, forward and again backward: ``(U-1)/U * B L D e * (2 H + 2 Hkv_wire)`` bytes,
shrinking as U grows. By default the three phases are sequential; ``head_chunks=c`` (or "auto") pipelines
c head groups so each group's transfers run behind its neighbours' kernels (Note [Head-group pipeline] in
``_ulysses``): ``head_chunks`` must divide H and Hkv with every group keeping the slot rules above.
"""

from __future__ import annotations

import functools

import torch

from ..config import AttentionConfig
from ..groups import SeqParallelGroups
from ..layouts import Contiguous, Layout
from ..types import AttnOutput
from . import _ulysses
from ._autograd import differentiable

NAME = "ulysses"
LAYOUTS = ("contiguous",)
MESH_DIMS = 1
OPTIONS: dict[str, object] = {"head_chunks": 1}
FEATURES = frozenset({"window", "varlen", "padding", "lse_grad"})


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """Tokens in global order (the all-to-all concatenates pieces): rank ``groups.index`` holds piece index."""
    return Contiguous(groups.world), groups.index


def check(q: torch.Tensor, k: torch.Tensor, cfg: AttentionConfig, groups: SeqParallelGroups) -> int:
    """Head-count rules, checked before any collective (the same error on every rank); returns the number
    of head groups ``head_chunks`` resolves to."""
    _ulysses.check_heads(q.shape[2], k.shape[2], groups.world)
    return _ulysses.resolve_head_chunks(cfg.option("head_chunks", 1), q.shape[2], k.shape[2], groups.world)


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups, chunks: int):
    engine = _ulysses.LocalEngine(cfg, q.shape[1] * groups.world, q.shape[-1])
    if chunks == 1:
        return _ulysses.forward(q, k, v, groups.group, engine)
    return _ulysses.forward_pipelined(q, k, v, groups.group, engine, chunks)


def _backward(do, dlse, saved, kv_heads: int, cfg: AttentionConfig, groups: SeqParallelGroups, chunks: int):
    q_h = saved[0]                                      # (B, S, h, D): the whole sequence
    engine = _ulysses.LocalEngine(cfg, q_h.shape[1], q_h.shape[-1])
    if chunks == 1:
        return _ulysses.backward(do, dlse, saved, kv_heads, groups.group, engine, cfg.grad_dtype)
    return _ulysses.backward_pipelined(do, dlse, saved, kv_heads, groups.group, engine, cfg.grad_dtype, chunks)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """Ulysses attention on local shards ``(B, L, H, D)``; differentiable in q, k, v (and through lse)."""
    chunks = check(q, k, cfg, groups)
    return differentiable(q, k, v, cfg, groups, functools.partial(_forward, chunks=chunks),
                          functools.partial(_backward, chunks=chunks), saving=True)
