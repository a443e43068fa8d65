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

from ..layouts import Contiguous, Layout
from . import _ulysses
from .base import Call, Method

__all__ = ["METHOD"]


def _placement(layout: str, groups, documents=None) -> tuple[Layout, int]:
    """Tokens in global order (the all-to-all concatenates pieces): rank ``groups.index`` holds piece index."""
    return Contiguous(groups.world), groups.index


def _chunks(call: Call) -> int:
    """Head-count rules, checked before any collective (the same error on every rank); the number of head
    groups ``head_chunks`` resolves to."""
    H, Hkv, W = call.q_shape[2], call.k_shape[2], call.groups.world
    _ulysses.check_heads(H, Hkv, W)
    return _ulysses.resolve_head_chunks(call.cfg.option("head_chunks", 1), H, Hkv, W)


def _engine(call: Call) -> _ulysses.Sandwich:
    return _ulysses.Sandwich(call, "group", _ulysses.LocalEngine(call), _chunks(call))


def _saved_meta(q_shape, k_shape, v_shape, dtype, groups, options) -> list:
    chunks = _ulysses.resolve_head_chunks(dict(options).get("head_chunks", 1), q_shape[2], k_shape[2], groups.world)
    return _ulysses.saved_meta(q_shape, k_shape, v_shape, dtype, groups.world, chunks)


METHOD = Method(
    name="ulysses",
    summary="all-to-all sequence <-> heads (q, k, v packed in one)",
    layouts=("contiguous",),
    options={"head_chunks": 1},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap"}),
    placement=_placement,
    check=_chunks,
    engine=_engine,
    saved_meta=_saved_meta,
)
