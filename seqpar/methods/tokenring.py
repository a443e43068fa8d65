"""TokenRing, pass-Q (ALGORITHMS.md §7): K and V stay on their owner; queries travel, results come home.

Q moves one hop per step; each step's partial (out, lse) goes straight back to the query's owner over
another link, overlapped with the next step's compute, and is merged there in fp32. After the zigzag
wrap only the half of Q that is still needed travels (Note [Pass-Q schedule] in ``_passq``). Backward
moves (Q, dO, lse, Delta) the same way, keeps dK/dV in place (fp32) and returns dQ partials in
``grad_dtype``. Whether pass-Q pays against the ring (pass-KV) is ``seqpar.choose_pass``: in bytes,
pass-Q is never cheaper for self-attention under GQA and breaks even for MHA; its advantages are the
halves after the wrap and spreading Q and O over two links.

Every layout works (the block planner decides what each step computes); causal balance needs zigzag.
GQA/MQA: K and V never move and are never replicated.
"""

from __future__ import annotations

from ..comm.ring import Ring
from ..cost import model
from ..kernels.executor import TaskRunner
from . import _passq
from .base import LONG_CONTEXT, BackwardInputs, Call, Method

__all__ = ["METHOD"]


class _Engine:
    saves = False

    def __init__(self, call: Call):
        cfg = call.cfg
        sp = _passq.schedule(call.layout, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        runner = TaskRunner.of(call)
        self.passq = _passq.PassQ(Ring(call.groups.group), sp, runner, cfg.grad_dtype)

    def forward(self, q, k, v):
        return self.passq.forward(q, k, v)

    def backward(self, b: BackwardInputs):
        return self.passq.backward(b.rows, b.q, b.k, b.v, b.lse)


#: causal: the share of a pass's Q rows and partials that travel, by layout (Note [Pass-Q schedule]: after the
#: wrap only zigzag's back halves are needed, and contiguous queries stop travelling); 1 for the others
_CAUSAL_SHARE = {"zigzag": 0.75, "doc_zigzag": 0.75, "contiguous": 0.5, "doc_contiguous": 0.5}


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """Q travels; partial outputs return directly to their owner (ALGORITHMS.md §7.2, §7.4). A pass-Q step
    visits the pairs a pass-KV step does, so the busiest rank's calls are the ring's (``model.steps``)."""
    W, L, H = p.world, p.seq_len / p.world, p.heads
    steps = model.steps(p, c.layout, W)
    n = len(steps)
    q = p.act(L, H)
    o = p.act(L, H, model.PASSQ_PARTIAL_BYTES) + p.rowstat(L, H)
    bundle = 2 * p.act(L, H) + 2 * p.rowstat(L, H)                        # Q, dO, lse, Delta
    dq = p.act(L, H, p.grad_bytes)
    share = _CAUSAL_SHARE.get(c.layout, 1.0) if p.causal else 1.0
    f, b = model.tallies(m, "tokenring")
    for s, blk in enumerate(steps):
        link = (q if s + 1 < n else 0.0) + (o if s >= 2 else 0.0)
        merge = m.merge_ms(p, L, H) if s >= 2 else 0.0
        f.step(m.kernel_ms(p, blk, H) + merge, m.comm_ms("ring2", link, model.Group(W)), "ring2", share * link)
    if n > 1:
        f.wait(m.comm_ms("ring", o, model.Group(W)), share * o)
        f.local(m.merge_ms(p, L, H))
    for s, blk in enumerate(steps):
        link = (bundle if s + 1 < n else 0.0) + (dq if s >= 2 else 0.0)
        acc = 0.0 if blk is None else m.hbm_ms(p.act(blk.rows, H, 10) + p.act(blk.cols, 2 * p.kv_heads, 10))
        b.step(m.kernel_ms(p, blk, H, "bwd") + acc, m.comm_ms("ring2", link, model.Group(W)), "ring2", share * link)
    if n > 1:
        b.wait(m.comm_ms("ring", dq, model.Group(W)), share * dq)
    fb, bb = model.base_mem(p)
    fwd_mem = 2 * q + 2 * o + p.act(L, H, 4) + p.rowstat(L, H) + p.act(L, H)
    bwd_mem = 2 * bundle + 2 * dq + p.act(L, H, 4) + p.act(L, 2 * p.kv_heads, 4) + model.temps(p, L, H, p.kv_heads)
    cost = model.Cost(f, b, fb + fwd_mem, bb + bwd_mem)
    ratio = model.pass_bytes(p, "q", "fwd") / model.pass_bytes(p, "kv", "fwd")
    cost.notes.append(f"pass-Q moves {ratio:.2f}x pass-KV's bytes per step (g={p.group_ratio})")
    if p.shaped:
        cost.balance = model.balance(p, c.layout, W, steps)
        cost.notes.append(f"busiest rank {cost.balance[0]:.2f}x the mean work, steps wait for it: "
                          f"{cost.balance[1]:.2f}x")
    return cost.prediction()


def _bench_specs(preset, world: int) -> list:
    if preset.seq_len >= LONG_CONTEXT:
        return []
    return [("zigzag" if preset.causal else "contiguous", (), None)]


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    return [dict(layout="zigzag")]


METHOD = Method(
    name="tokenring",
    summary="Q travels (pass-Q), partial outputs return directly",
    layouts=("zigzag", "contiguous", "stripe", "balanced", "doc_zigzag", "doc_contiguous"),
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "mask",
                        "document_layouts"}),
    engine=_Engine,
    cost=_cost,
    bench_specs=_bench_specs,
    demo_cases=_demo_cases,
)
