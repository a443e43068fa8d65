"""Ring attention, pass-KV (ALGORITHMS.md §3): contiguous, zigzag and stripe layouts.

Q stays; K and V rotate around the group one hop per step, the next hop posted before the step's compute
(double-buffered, the runtime's ``run_steps``). Each step computes what the block planner says rank r's
queries see of the visiting block (Note [Zigzag load balance], Note [Block planning]) and merges it in fp32.
Backward sends dK/dV one step behind their KV and accumulates them in fp32 (``grad_dtype`` on the wire).

GQA/MQA: K and V travel with their own Hkv heads; kernels map query heads to KV heads. Never replicated.
``transport="copy_engine"`` moves the K/V hops on copy engines through torch's symmetric memory instead of NCCL
(one host, CUDA: Note [Copy-engine ring] in ``seqpar.comm.symmetric``). ``head_chunks=c`` runs the ring c times,
each on Hkv/c KV heads and their query heads, so every fp32 buffer (output accumulator, dq, travelling dK/dV)
shrinks c-fold: how 1M-token sequences stay near the minimum memory. Transfers per step shrink c-fold too, so
use it only where steps stay compute-bound. Windows and documents: the planner skips blocks nobody sees and ends
the ring early when a window is shorter than the ring (Note [Ring truncation] in ``_passkv``).
"""

from __future__ import annotations

from ..comm import symmetric
from ..cost import model
from ..errors import rank_suffix
from . import _passkv
from .base import LONG_CONTEXT, Call, Method

__all__ = ["METHOD"]


def _check(call: Call) -> None:
    c = call.cfg.option("head_chunks", 1)
    if isinstance(c, bool) or not isinstance(c, int) or c < 1 or call.k_shape[2] % c:
        raise ValueError(f"head_chunks must be a positive int dividing kv heads ({call.k_shape[2]}), got {c!r}"
                         f"{rank_suffix()}")
    symmetric.check(call.cfg.option("transport", "nccl"), call.groups.group, call.device)


def _engine(call: Call) -> _passkv.HeadChunks:
    return _passkv.HeadChunks(call, call.cfg.option("head_chunks", 1))


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """Pass-KV ring over all W ranks, any layout (ALGORITHMS.md §3, §12.2), its hops on NCCL or on copy engines
    (``transport``); ``head_chunks`` is not modelled (the same bytes and work in c passes)."""
    pattern = "ring_copy" if c.option("transport") == "copy_engine" else "ring"
    cost = model.passkv(p, m, c.layout, p.world, p.heads, p.kv_heads, model.Group(p.world), "ring", pattern)
    return model.note_ccr(cost, p, m, p.world).prediction()


def _bench_specs(preset, world: int) -> list:
    """Every plain layout when causal (contiguous shows the imbalance), contiguous when not; at 1M tokens
    and beyond one KV head per pass (the memory-bounded variant). Where the default group could move hops on copy
    engines (NCCL on CUDA: Note [Copy-engine ring]), the zigzag ring (contiguous when not causal) that way too."""
    if preset.seq_len >= LONG_CONTEXT:
        return [("zigzag", (("head_chunks", preset.kv_heads),), None)]
    lays = ("contiguous", "zigzag", "stripe") if preset.causal else ("contiguous",)
    copy = [("zigzag" if preset.causal else "contiguous", (("transport", "copy_engine"),), None)]
    return [(lay, (), None) for lay in lays] + (copy if symmetric.usable() else [])


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    return [*(dict(layout=lay) for lay in ("contiguous", "zigzag", "stripe")), dict(layout="zigzag", causal=False),
            dict(layout="zigzag", cu_seqlens=documents), dict(layout="contiguous", window=(seq_len // 8, 0))]


METHOD = Method(
    name="ring",
    summary="K, V around a ring (pass-KV), dK/dV one step behind",
    layouts=("contiguous", "zigzag", "stripe", "balanced", "balanced_whole", "doc_zigzag", "doc_contiguous"),
    options={"head_chunks": 1, "transport": "nccl"},
    modelled_transports=("nccl", "copy_engine"),
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "mask",
                        "document_layouts"}),
    check=_check,
    engine=_engine,
    cost=_cost,
    bench_specs=_bench_specs,
    demo_cases=_demo_cases,
)
