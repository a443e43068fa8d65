"""TASP (ALGORITHMS.md §8): every rank's KV in W-1 sub-chunks moving on W-1 links at once, every round.

A ring uses one of a rank's W-1 links per step; on a full point-to-point mesh (MI300X xGMI, PCIe
switches, one NIC per GPU) TASP keeps all of them busy: each round is an all-to-all in which every
ordered pair carries one sub-chunk (‖KV‖ / (W-1)), so the bytes equal the ring's and the step time can
drop by up to W-1 (Note [TASP rounds] in ``_tasp``).

Options:
    schedule: "cycles" - TASP's arc-disjoint Hamiltonian cycles, store and forward (every W except 4 and
        6, ``seqpar.comm.topology``); "direct" - the staggered direct all-to-all (§8.4, any W: no
        forwarding, so rounds never wait on each other, and pieces the receiver does not need are not
        sent); "auto" (default) - "direct". Within one host every pair of GPUs has its own link (or a
        switch), where the direct form moves the same bytes without forwarding (§8.4, §8.6); the
        cycles pay off across nodes (§8.3, each chunk crosses the node boundary once), which this
        single-group method does not model, so "auto" never picks them.

Layouts: zigzag (causal and not) and contiguous (non-causal only: causal work would be unbalanced);
every piece of a rank is cut into W-1 sub-chunks, so the local length must be a multiple of 2(W-1)
(zigzag) or W-1 (contiguous). GQA/MQA: KV travels with its own Hkv heads.
"""

from __future__ import annotations

import torch

from ..comm import topology
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..kernels.executor import TaskRunner
from ..layouts import Layout, make_layout
from ..layouts.subchunks import Subchunked
from ..types import AttnOutput
from . import _tasp
from ._autograd import differentiable
from ._shared import delta_of

NAME = "tasp"
LAYOUTS = ("zigzag", "contiguous")
CAUSAL_LAYOUTS = ("zigzag",)          # sub-chunked zigzag keeps every round balanced (ALGORITHMS.md §8.2)
MESH_DIMS = 1
OPTIONS: dict[str, object] = {"schedule": "auto"}
FEATURES = frozenset({"window", "varlen", "padding", "lse_grad"})
SCHEDULES = ("auto", "cycles", "direct")


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """``layout`` over the group with every per-rank piece cut into W-1 sub-chunks (same token placement)."""
    W = groups.world
    return Subchunked(W, base=make_layout(layout, W), parts=max(W - 1, 1)), groups.index


def resolve_schedule(cfg: AttentionConfig, world: int) -> str:
    """The schedule this call runs ("cycles" or "direct"); raises for input TASP cannot serve."""
    name = cfg.option("schedule", OPTIONS["schedule"])
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)} for method='tasp', got {name!r}{rank_suffix()}")
    if name == "cycles" and not topology.has_cycles(world):
        raise ValueError(f"schedule='cycles' needs a group size with a Hamiltonian decomposition (every size "
                         f"except 4 and 6), got {world} ranks; use schedule='direct'{rank_suffix()}")
    return "direct" if name == "auto" else name


def _setup(q: torch.Tensor, cfg: AttentionConfig, groups: SeqParallelGroups, needs_delta: bool = False):
    layout, index = placement(cfg.layout, groups)
    kind = resolve_schedule(cfg, groups.world)
    tp = _tasp.schedule(layout, index, q.shape[1] * groups.world, cfg.rule, cfg.cu_seqlens, cfg.valid_len, kind)
    runner = TaskRunner(cfg.kernel, cfg.scale(q.shape[-1]), deterministic=cfg.deterministic,
                        needs_delta=needs_delta)
    return tp, runner


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups):
    tp, runner = _setup(q, cfg, groups)
    return _tasp.forward(q, k, v, groups.group, tp, runner)


def _backward(do, q, k, v, out, lse, dlse, cfg: AttentionConfig, groups: SeqParallelGroups):
    delta = None if dlse is None else delta_of(do, out, dlse, lse.dtype)
    tp, runner = _setup(q, cfg, groups, needs_delta=delta is not None)
    return _tasp.backward(do, q, k, v, out, lse, groups.group, tp, runner, cfg.grad_dtype, delta)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """TASP attention on local shards ``(B, L, H, D)``; differentiable in q, k, v (and through lse)."""
    resolve_schedule(cfg, groups.world)               # validate before any communication
    return differentiable(q, k, v, cfg, groups, _forward, _backward)
