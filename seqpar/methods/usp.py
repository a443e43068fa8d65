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

``transport="copy_engine"`` moves the ring's hops on copy engines through torch's symmetric memory (one host, CUDA;
Note [Copy-engine ring] in ``seqpar.comm.symmetric``); the all-to-alls stay on NCCL, which on four H100s ran them
faster than pulls did (USP forward 0.02-0.04 faster so, forward+backward the same:
``benchmarks/results/2026-11-27-4xh100-copy-engine-a2a/``). The cost model prices those hops as the ring's on copy
engines, so ``method="auto", transport="copy_engine"`` weighs USP that way too. With no ring (R == 1) it moves the
all-to-alls, as Ulysses' option does (Note [Copy-engine all-to-all]), which no model predicts.

Degenerate meshes take the short paths: R == 1 is plain Ulysses and never enters the ring engine (one
local full-sequence computation, no fp32 merge); U == 1 is a plain ring (no all-to-all). GQA follows
Ulysses' rule (U divides H; U divides Hkv or Hkv divides U); replicated KV heads also travel the ring, so
prefer U <= Hkv.
"""

from __future__ import annotations

from ..comm import symmetric
from ..comm.ring import Ring
from ..cost import model
from ..kernels.executor import TaskRunner
from ..layouts import Layout, Nested, make_layout
from ..numerics import acc_dtype
from . import _passkv, _ulysses
from .base import LONG_CONTEXT, Call, Method

__all__ = ["METHOD"]


def _placement(layout: str, groups, documents=None, rule=None) -> tuple[Layout, int]:
    """``layout`` over the R ring ranks, each ring rank's tokens split contiguously over its U ranks."""
    outer = make_layout(layout, groups.ring_size, documents, rule)
    return Nested(groups.world, outer=outer, inner=groups.ulysses_size), groups.index


def _chunks(call: Call) -> int:
    """Head-count rules for the Ulysses axis, checked before any collective (the same error on every rank);
    the number of head groups ``head_chunks`` resolves to."""
    U = call.groups.ulysses_size
    _ulysses.check_heads(call.q_shape[2], call.k_shape[2], U, world=call.groups.world)
    chunks = _ulysses.resolve_head_chunks(call.cfg.option("head_chunks", 1), call.q_shape[2], call.k_shape[2], U)
    moved = call.groups.ring if call.groups.ring_size > 1 else call.groups.ulysses     # what the option moves
    symmetric.check(call.cfg.option("transport", "nccl"), moved, call.device)
    return chunks


class _RingInner:
    """The pass-KV ring over the ring group on head-sharded tensors ``(B, S/R, h, D)``."""

    def __init__(self, call: Call):
        cfg, groups = call.cfg, call.groups
        outer = make_layout(cfg.layout, groups.ring_size, cfg.cu_seqlens, cfg.balance_rule)
        rho = groups.index // groups.ulysses_size
        sched = _passkv.schedule(outer, rho, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        runner = TaskRunner.of(call)
        self.ring = _passkv.PassKV(Ring(groups.ring, cfg.option("transport", "nccl")), sched, runner, cfg.grad_dtype)

    def forward(self, q, k, v):
        return self.ring.forward(q, k, v)

    def backward(self, rows, q, k, v, lse):
        return self.ring.backward(rows, q, k, v, lse, result_dtype=acc_dtype(q.dtype))


def _engine(call: Call) -> _ulysses.Sandwich:
    transport = call.cfg.option("transport", "nccl")
    if call.groups.ring_size == 1:          # plain Ulysses: never the ring engine (yunchang defect 13)
        return _ulysses.Sandwich(call, "ulysses", _ulysses.LocalEngine(call), _chunks(call), transport)
    return _ulysses.Sandwich(call, "ulysses", _RingInner(call), _chunks(call))   # all-to-alls on NCCL (see above)


def _saved_meta(q_shape, k_shape, v_shape, dtype, groups, options) -> list:
    U = groups.ulysses_size
    chunks = _ulysses.resolve_head_chunks(dict(options).get("head_chunks", 1), q_shape[2], k_shape[2], U)
    return _ulysses.saved_meta(q_shape, k_shape, v_shape, dtype, U, chunks)


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """Ulysses over U (inside a node) x pass-KV ring over R = W/U (ALGORITHMS.md §6); documents unbalance
    the ring over R ranks only (Note [Packed batches])."""
    U, R = c.ulysses, p.world // c.ulysses
    L = p.seq_len / p.world
    hw = model.kv_wire_heads(p.kv_heads, U)
    pattern = "ring_copy" if c.option("transport") == "copy_engine" else "ring"    # the ring's hops only
    chunks = model.head_chunks(p, c, U)
    if chunks > 1:                      # [head-group pipeline]: the ring runs per group, a2a's beside it
        hwc = model.kv_wire_heads(p.kv_heads // chunks, U)
        cost = model.passkv(p, m, c.layout, R, p.heads / (U * chunks), hwc / U, model.Group(R, U), "usp", pattern)
        cost.fwd, cost.bwd = model.head_pipeline(p, m, U, L, chunks, cost.fwd, cost.bwd)
        cost.notes.append(f"{chunks} head groups pipelined: the ring of one group hides the next group's "
                          f"all-to-all")
    else:
        cost = model.passkv(p, m, c.layout, R, p.heads / U, hw / U, model.Group(R, U), "usp", pattern)
        pre_f, pre_b = model.Tally(m), model.Tally(m)
        model.a2a_in(p, m, U, L, pre_f, pre_b)
        cost.fwd.absorb(pre_f)
        cost.bwd.absorb(pre_b)
    fm, bm = model.ulysses_mem(p, U, L)
    cost.fwd_mem += fm
    cost.bwd_mem += bm
    if hw > p.kv_heads:
        cost.notes.append(f"KV replicated {U // p.kv_heads}x for Ulysses also travels the ring")
    return model.note_ccr(cost, p, m, R).prediction()


def _why_not(p: model.Problem, c: model.Candidate) -> list[str]:
    why = model.ulysses_why_not(p, c.ulysses, c.option("head_chunks", 1))
    if c.option("transport") == "copy_engine" and c.ulysses == p.world:
        why.append("transport='copy_engine' with no ring moves the all-to-alls, which the cost model does not predict")
    return why


def _bench_specs(preset, world: int) -> list:
    """Ulysses 2 x ring W/2 on the balanced layout, from 4 ranks; where the default group could move it on copy
    engines (NCCL on CUDA), that way too."""
    if preset.seq_len >= LONG_CONTEXT or world < 4 or world % 2:
        return []
    lay = "zigzag" if preset.causal else "contiguous"
    copy = [(lay, (("transport", "copy_engine"),), 2)] if symmetric.usable() else []
    return [(lay, (), 2), *copy]


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    if world % 2 or world <= 2:
        return []
    return [dict(layout=lay, ulysses=2) for lay in ("contiguous", "zigzag", "stripe")]


METHOD = Method(
    name="usp",
    summary="Ulysses inside, ring across",
    layouts=("contiguous", "zigzag", "stripe", "balanced", "doc_zigzag", "doc_contiguous"),
    mesh_dims=2,
    options={"head_chunks": 1, "transport": "nccl"},
    modelled_transports=("nccl", "copy_engine"),
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "mask",
                        "document_layouts"}),
    placement=_placement,
    check=_chunks,
    engine=_engine,
    cost=_cost,
    why_not=_why_not,
    bench_specs=_bench_specs,
    demo_cases=_demo_cases,
    saved_meta=_saved_meta,
)
