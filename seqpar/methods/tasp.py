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

from ..comm import topology
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..kernels.executor import TaskRunner
from ..layouts import Layout, make_layout
from ..layouts.subchunks import Subchunked
from . import _tasp
from .base import BackwardInputs, Call, Method

__all__ = ["METHOD", "SCHEDULES", "resolve_schedule"]

SCHEDULES = ("auto", "cycles", "direct")


def _placement(layout: str, groups, documents=None) -> tuple[Layout, int]:
    """``layout`` over the group with every per-rank piece cut into W-1 sub-chunks (same token placement)."""
    W = groups.world
    return Subchunked(W, base=make_layout(layout, W), parts=max(W - 1, 1)), groups.index


def resolve_schedule(cfg: AttentionConfig, world: int) -> str:
    """The schedule this call runs ("cycles" or "direct"); raises for input TASP cannot serve."""
    name = cfg.option("schedule", "auto")
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)} for method='tasp', got {name!r}{rank_suffix()}")
    if name == "cycles" and not topology.has_cycles(world):
        raise ValueError(f"schedule='cycles' needs a group size with a Hamiltonian decomposition (every size "
                         f"except 4 and 6), got {world} ranks; use schedule='direct'{rank_suffix()}")
    return "direct" if name == "auto" else name


class _Engine:
    saves = False

    def __init__(self, call: Call):
        cfg = call.cfg
        kind = resolve_schedule(cfg, call.groups.world)
        tp = _tasp.schedule(call.layout, call.index, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len, kind)
        runner = TaskRunner(cfg.kernel, call.scale, deterministic=cfg.deterministic, softcap=cfg.softcap)
        self.tasp = _tasp.Tasp(call.groups, tp, runner, cfg.grad_dtype)

    def forward(self, q, k, v):
        return self.tasp.forward(q, k, v)

    def backward(self, b: BackwardInputs):
        return self.tasp.backward(b.rows, b.q, b.k, b.v, b.lse)


METHOD = Method(
    name="tasp",
    summary="KV split over W-1 links per round (Hamiltonian cycles or staggered direct all-to-all)",
    layouts=("zigzag", "contiguous"),
    causal_layouts=("zigzag",),        # sub-chunked zigzag keeps every round balanced (ALGORITHMS.md §8.2)
    options={"schedule": "auto"},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap"}),
    placement=_placement,
    check=lambda call: resolve_schedule(call.cfg, call.groups.world) and None,
    engine=_Engine,
)
