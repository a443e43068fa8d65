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
from ..kernels.executor import TaskRunner
from . import _passq
from .base import BackwardInputs, Call, Method

__all__ = ["METHOD"]


class _Engine:
    saves = False

    def __init__(self, call: Call):
        cfg = call.cfg
        sp = _passq.schedule(call.layout, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        runner = TaskRunner(cfg.kernel, call.scale, deterministic=cfg.deterministic, softcap=cfg.softcap)
        self.passq = _passq.PassQ(Ring(call.groups.group), sp, runner, cfg.grad_dtype)

    def forward(self, q, k, v):
        return self.passq.forward(q, k, v)

    def backward(self, b: BackwardInputs):
        return self.passq.backward(b.rows, b.q, b.k, b.v, b.lse)


METHOD = Method(
    name="tokenring",
    summary="Q travels (pass-Q), partial outputs return directly",
    layouts=("zigzag", "contiguous", "stripe", "balanced", "doc_zigzag", "doc_contiguous"),
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap",
                        "document_layouts"}),
    engine=_Engine,
)
