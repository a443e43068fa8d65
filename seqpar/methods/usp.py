"""USP: Ulysses inside, ring across (ALGORITHMS.md §6), on a 2D mesh with dims "ulysses" and "ring".

W = U * R ranks; SP index ``rho * U + u`` for ring rank rho and Ulysses rank u, whichever way the mesh
places its axes (contiguous Ulysses groups keep the all-to-all inside a node; strided ones are supported
and tested too). Token placement is ``layouts.Nested``: the ring layout (contiguous, zigzag or stripe over
R) gives ring rank rho its S/R tokens, cut into U consecutive pieces; piece u lives on (rho, u)::

    W = 8, U = 4, R = 2, zigzag over R (chunks c0..c3 of S/4):
        ring rank 0 holds [c0 | c3] -> pieces on u = 0..3: c0[:half], c0[half:], c3[:half], c3[half:]
        ring rank 1 holds [c1 | c2] -> likewise

After the Ulysses all-to-all (q, k, v packed, ``seqpar.comm.all_to_all``) ring rank rho holds exactly its
ring-layout shard with H/U heads, so the pass-KV ring (``_passkv``, any layout, windows, documents,
padding) runs unchanged over the ring group; the reverse all-to-all returns out and lse. Backward:
dO (and dlse) to head-sharded, the ring backward, dq/dk/dv back with KV replica sums.

``head_chunks=c`` (or "auto") pipelines c head groups through the sandwich: group i+1's all-to-all runs
behind group i's ring, group i-1's output all-to-all too (Note [Head-group pipeline] in ``_ulysses``); the
ring's fp32 buffers shrink c-fold as a side effect. Each group must keep the slot rules over U.

Degenerate meshes take the short paths: R == 1 is plain Ulysses and never enters the ring engine (one
local full-sequence computation, no fp32 merge); U == 1 is a plain ring (no all-to-all). GQA follows
Ulysses' rule (U divides H; U divides Hkv or Hkv divides U); replicated KV heads also travel the ring, so
prefer U <= Hkv.
"""

from __future__ import annotations

import functools

import torch

from ..comm.ring import Ring
from ..config import AttentionConfig
from ..groups import SeqParallelGroups
from ..kernels.executor import TaskRunner
from ..layouts import Layout, Nested, make_layout
from ..types import AttnOutput
from . import _passkv, _ulysses
from ._autograd import differentiable

NAME = "usp"
LAYOUTS = ("contiguous", "zigzag", "stripe")
MESH_DIMS = 2
OPTIONS: dict[str, object] = {"head_chunks": 1}
FEATURES = frozenset({"window", "varlen", "padding", "lse_grad"})


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """``layout`` over the R ring ranks, each ring rank's tokens split contiguously over its U ranks."""
    outer = make_layout(layout, groups.ring_size)
    return Nested(groups.world, outer=outer, inner=groups.ulysses_size), groups.index


def check(q: torch.Tensor, k: torch.Tensor, cfg: AttentionConfig, groups: SeqParallelGroups) -> int:
    """Head-count rules for the Ulysses axis, checked before any collective (the same error on every rank);
    returns the number of head groups ``head_chunks`` resolves to."""
    U = groups.ulysses_size
    _ulysses.check_heads(q.shape[2], k.shape[2], U, world=groups.world)
    return _ulysses.resolve_head_chunks(cfg.option("head_chunks", 1), q.shape[2], k.shape[2], U)


class _RingEngine:
    """The pass-KV ring over the ring group on head-sharded tensors ``(B, S/R, h, D)``."""

    def __init__(self, cfg: AttentionConfig, groups: SeqParallelGroups, seq_len: int, head_dim: int):
        outer = make_layout(cfg.layout, groups.ring_size)
        rho = groups.index // groups.ulysses_size
        self.cfg, self.scale = cfg, cfg.scale(head_dim)
        self.sched = _passkv.schedule(outer, rho, seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        self.ring = Ring(groups.ring)

    def _runner(self, needs_delta: bool = False) -> TaskRunner:
        return TaskRunner(self.cfg.kernel, self.scale, deterministic=self.cfg.deterministic,
                          needs_delta=needs_delta)

    def forward(self, q, k, v):
        return _passkv.forward(q, k, v, self.ring, self.sched, self._runner())

    def backward(self, do, q, k, v, out, lse, delta):
        return _passkv.backward(do, q, k, v, out, lse, self.ring, self.sched, self._runner(delta is not None),
                                self.cfg.grad_dtype, delta, result_dtype=_ulysses.acc_dtype(q.dtype))


def _engine(cfg: AttentionConfig, groups: SeqParallelGroups, seq_len: int, head_dim: int) -> _ulysses.Engine:
    if groups.ring_size == 1:     # plain Ulysses: never the ring engine (yunchang defect 13)
        return _ulysses.LocalEngine(cfg, seq_len, head_dim)
    return _RingEngine(cfg, groups, seq_len, head_dim)


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups, chunks: int):
    engine = _engine(cfg, groups, q.shape[1] * groups.world, q.shape[-1])
    if chunks == 1:
        return _ulysses.forward(q, k, v, groups.ulysses, engine)
    return _ulysses.forward_pipelined(q, k, v, groups.ulysses, engine, chunks)


def _backward(do, dlse, saved, kv_heads: int, cfg: AttentionConfig, groups: SeqParallelGroups, chunks: int):
    engine = _engine(cfg, groups, do.shape[1] * groups.world, do.shape[-1])
    if chunks == 1:
        return _ulysses.backward(do, dlse, saved, kv_heads, groups.ulysses, engine, cfg.grad_dtype)
    return _ulysses.backward_pipelined(do, dlse, saved, kv_heads, groups.ulysses, engine, cfg.grad_dtype, chunks)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """USP attention on local shards ``(B, L, H, D)`` in the ``Nested`` placement; differentiable in q, k, v
    (and through lse)."""
    chunks = check(q, k, cfg, groups)
    return differentiable(q, k, v, cfg, groups, functools.partial(_forward, chunks=chunks),
                          functools.partial(_backward, chunks=chunks), saving=True)
