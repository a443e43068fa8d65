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
``transport="copy_engine"`` moves the all-to-alls on copy engines through torch's symmetric memory instead of NCCL
(one host, CUDA: Note [Copy-engine all-to-all] in ``seqpar.comm.symmetric``); on four H100s it ran 0.03-0.11 slower
than NCCL, so no cost model covers it and ``method="auto"`` never picks it.
"""

from __future__ import annotations

from ..comm import symmetric
from ..cost import model
from ..layouts import Contiguous, Layout
from . import _ulysses
from .base import LONG_CONTEXT, Call, Method

__all__ = ["METHOD"]


def _placement(layout: str, groups, documents=None, rule=None) -> tuple[Layout, int]:
    """Tokens in global order (the all-to-all concatenates pieces): rank ``groups.index`` holds piece index."""
    return Contiguous(groups.world), groups.index


def _chunks(call: Call) -> int:
    """Head-count rules, checked before any collective (the same error on every rank); the number of head
    groups ``head_chunks`` resolves to."""
    H, Hkv, W = call.q_shape[2], call.k_shape[2], call.groups.world
    _ulysses.check_heads(H, Hkv, W)
    chunks = _ulysses.resolve_head_chunks(call.cfg.option("head_chunks", 1), H, Hkv, W)
    symmetric.check(call.cfg.option("transport", "nccl"), call.groups.group, call.device)
    return chunks


def _engine(call: Call) -> _ulysses.Sandwich:
    return _ulysses.Sandwich(call, "group", _ulysses.LocalEngine(call), _chunks(call),
                             call.cfg.option("transport", "nccl"))


def _saved_meta(q_shape, k_shape, v_shape, dtype, groups, options) -> list:
    chunks = _ulysses.resolve_head_chunks(dict(options).get("head_chunks", 1), q_shape[2], k_shape[2], groups.world)
    return _ulysses.saved_meta(q_shape, k_shape, v_shape, dtype, groups.world, chunks)


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """All-to-all to head-sharded full sequences, one local call, all-to-all back (ALGORITHMS.md §5); every
    rank runs the whole sequence, so documents never unbalance it (Note [Packed batches])."""
    U, L = p.world, p.seq_len / p.world
    chunks = model.head_chunks(p, c, U)
    blk = model.whole(p)
    if chunks == 1:
        f, b = model.tallies(m, "ulysses")
        model.a2a_in(p, m, U, L, f, b)
        f.step(m.kernel_ms(p, blk, p.heads / U))
        b.step(m.kernel_ms(p, blk, p.heads / U, "bwd"))
    else:                                                                 # [head-group pipeline]
        eng_f, eng_b = model.tallies(m, "ulysses")
        eng_f.step(m.kernel_ms(p, blk, p.heads / (U * chunks)))
        eng_b.step(m.kernel_ms(p, blk, p.heads / (U * chunks), "bwd"))
        f, b = model.head_pipeline(p, m, U, L, chunks, eng_f, eng_b)
    fb, bb = model.base_mem(p)
    fm, bm = model.ulysses_mem(p, U, L)
    cost = model.Cost(f, b, fb + fm, bb + bm)
    if p.kv_heads % U:
        cost.notes.append(f"kv_heads={p.kv_heads} < degree {U}: each KV head goes to {U // p.kv_heads} ranks "
                          f"(on the wire only)")
    if chunks == 1:
        cost.notes.append("no overlap: both all-to-alls are exposed; bytes shrink as 1/W")
    else:
        cost.notes.append(f"{chunks} head groups pipelined: 1/{chunks} of each all-to-all direction exposed")
    return cost.prediction()


def _why_not(p: model.Problem, c: model.Candidate) -> list[str]:
    return model.ulysses_why_not(p, p.world, c.option("head_chunks", 1))


def _bench_specs(preset, world: int) -> list:
    """The plain sandwich (``head_chunks`` is opt-in: measured slower on NVSwitch) where W divides the heads; where
    the default group could move it on copy engines (NCCL on CUDA), that way too."""
    if preset.seq_len >= LONG_CONTEXT or preset.heads % world:
        return []
    copy = [("contiguous", (("transport", "copy_engine"),), None)] if symmetric.usable() else []
    return [("contiguous", (), None), *copy]


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    return [dict(layout="contiguous")]


METHOD = Method(
    name="ulysses",
    summary="all-to-all sequence <-> heads (q, k, v packed in one)",
    layouts=("contiguous",),
    options={"head_chunks": 1, "transport": "nccl"},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "mask"}),
    placement=_placement,
    check=_chunks,
    engine=_engine,
    cost=_cost,
    why_not=_why_not,
    bench_specs=_bench_specs,
    demo_cases=_demo_cases,
    saved_meta=_saved_meta,
)
