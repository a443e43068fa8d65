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

from ..comm.ring import Ring
from ..kernels.executor import TaskRunner
from ..layouts import Layout, Nested, make_layout
from ..numerics import acc_dtype
from . import _passkv, _ulysses
from .base import Call, Method

__all__ = ["METHOD"]


def _placement(layout: str, groups, documents=None) -> tuple[Layout, int]:
    """``layout`` over the R ring ranks, each ring rank's tokens split contiguously over its U ranks."""
    outer = make_layout(layout, groups.ring_size, documents)
    return Nested(groups.world, outer=outer, inner=groups.ulysses_size), groups.index


def _chunks(call: Call) -> int:
    """Head-count rules for the Ulysses axis, checked before any collective (the same error on every rank);
    the number of head groups ``head_chunks`` resolves to."""
    U = call.groups.ulysses_size
    _ulysses.check_heads(call.q_shape[2], call.k_shape[2], U, world=call.groups.world)
    return _ulysses.resolve_head_chunks(call.cfg.option("head_chunks", 1), call.q_shape[2], call.k_shape[2], U)


class _RingInner:
    """The pass-KV ring over the ring group on head-sharded tensors ``(B, S/R, h, D)``."""

    def __init__(self, call: Call):
        cfg, groups = call.cfg, call.groups
        outer = make_layout(cfg.layout, groups.ring_size, cfg.cu_seqlens)
        rho = groups.index // groups.ulysses_size
        sched = _passkv.schedule(outer, rho, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        runner = TaskRunner(cfg.kernel, call.scale, deterministic=cfg.deterministic, softcap=cfg.softcap)
        self.ring = _passkv.PassKV(Ring(groups.ring), sched, runner, cfg.grad_dtype)

    def forward(self, q, k, v):
        return self.ring.forward(q, k, v)

    def backward(self, rows, q, k, v, lse):
        return self.ring.backward(rows, q, k, v, lse, result_dtype=acc_dtype(q.dtype))


def _engine(call: Call) -> _ulysses.Sandwich:
    if call.groups.ring_size == 1:          # plain Ulysses: never the ring engine (yunchang defect 13)
        inner = _ulysses.LocalEngine(call)
    else:
        inner = _RingInner(call)
    return _ulysses.Sandwich(call, "ulysses", inner, _chunks(call))


def _saved_meta(q_shape, k_shape, v_shape, dtype, groups, options) -> list:
    U = groups.ulysses_size
    chunks = _ulysses.resolve_head_chunks(dict(options).get("head_chunks", 1), q_shape[2], k_shape[2], U)
    return _ulysses.saved_meta(q_shape, k_shape, v_shape, dtype, U, chunks)


METHOD = Method(
    name="usp",
    summary="Ulysses inside, ring across",
    layouts=("contiguous", "zigzag", "stripe", "balanced", "doc_zigzag", "doc_contiguous"),
    mesh_dims=2,
    options={"head_chunks": 1},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap",
                        "document_layouts"}),
    placement=_placement,
    check=_chunks,
    engine=_engine,
    saved_meta=_saved_meta,
)
