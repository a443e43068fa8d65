"""A method is its declaration: a toy registered from this file reaches every reader of the registry.

``TOY`` gathers q, k, v (and dO in backward) on every rank and attends the whole sequence densely, keeping its
own rows: trivially correct, and written only against the public declaration (``seqpar.methods.Method``), the
engine contract (Note [Engines]) and the planner's model (``seqpar.cost.model``). Registered, it must be in
``seqpar.methods.available()``, ranked by ``seqpar.plan``, picked by ``method="auto"`` (its model claims to be
the fastest), timed by the benchmark (``method_specs``), run by the demo (``demo_cases``), and match the dense
oracle through ``seqpar.attention(method="toy")`` at W = 2; unregistered, it is gone from all of them.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import assert_all_ok

import seqpar
from seqpar import methods
from seqpar.bench.presets import PRESETS, method_specs
from seqpar.cost import model
from seqpar.demo import demo_cases
from seqpar.methods import BackwardInputs, Call, Method
from seqpar.numerics import acc_dtype
from seqpar.planner import choose, plan
from seqpar.testing import Case, check_case, run_case


class _GatherAll:
    """Every rank attends the whole gathered sequence; rows of rank r are ``[r L, (r+1) L)`` of the gather."""

    saves = False

    def __init__(self, call: Call):
        W, S = call.groups.world, call.seq_len
        self.group, self.index, self.L = call.groups.group, call.index, call.q_shape[1]
        self.causal, self.scale = call.cfg.causal, call.scale
        self.pos = torch.cat([call.layout.positions(r, S) for r in range(W)])     # (S,) in gather order

    def _gather(self, x_BLHD: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x_BLHD) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, x_BLHD.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def _dense(self, q_BSHD, k_BSHD, v_BSHD):
        """``(out (B, S, H, Dv), lse (B, H, S))`` in the accumulation dtype."""
        acc = acc_dtype(q_BSHD.dtype)
        G = q_BSHD.shape[2] // k_BSHD.shape[2]
        q, k, v = (t.to(acc).transpose(1, 2) for t in (q_BSHD, k_BSHD.repeat_interleave(G, 2),
                                                       v_BSHD.repeat_interleave(G, 2)))
        s_BHSS = q @ k.transpose(-1, -2) * self.scale
        if self.causal:
            s_BHSS = s_BHSS.masked_fill(self.pos[None, :] > self.pos[:, None], float("-inf"))
        lse_BHS = torch.logsumexp(s_BHSS, dim=-1)
        return (torch.softmax(s_BHSS, dim=-1) @ v).transpose(1, 2), lse_BHS

    def _mine(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x.narrow(dim, self.index * self.L, self.L)

    def forward(self, q, k, v):
        out, lse = self._dense(self._gather(q), self._gather(k), self._gather(v))
        return self._mine(out).to(q.dtype).contiguous(), self._mine(lse, 2).contiguous()

    def backward(self, b: BackwardInputs):
        full = [self._gather(t).detach().requires_grad_() for t in (b.q, b.k, b.v)]
        with torch.enable_grad():
            out, lse = self._dense(*full)
            outputs, grads = [out], [self._gather(b.rows.do).to(out.dtype)]
            if b.dlse is not None:
                outputs.append(lse)
                grads.append(self._gather(b.dlse.transpose(1, 2)).transpose(1, 2).to(lse.dtype))
            dq, dk, dv = torch.autograd.grad(outputs, full, grads)
        return tuple(self._mine(g).to(t.dtype).contiguous() for g, t in zip((dq, dk, dv), (b.q, b.k, b.v)))


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """A model that claims the toy is nearly free, so ``method="auto"`` must pick it while it is registered."""
    return model.Prediction(fwd_ms=1e-6, fwd_bwd_ms=2e-6, peak_mem_bytes=1, comm_bytes=0, exposed_comm_ms=0.0,
                            notes=("toy: a model that claims to be free",))


TOY = Method(
    name="toy", summary="all-gather q, k, v; every rank attends the whole sequence densely",
    layouts=("zigzag", "contiguous"), features=frozenset({"lse_grad"}), engine=_GatherAll, cost=_cost,
    bench_specs=lambda preset, world: [("zigzag", (), None)],
    demo_cases=lambda world, seq_len, documents: [dict(layout="zigzag"), dict(layout="contiguous", causal=False)])


@pytest.fixture
def toy():
    methods.register(TOY)
    yield TOY
    methods.unregister("toy")


def _toy_case(case: Case) -> dict:
    """Worker side: the toy is registered only while this rank runs ``case``."""
    methods.register(TOY)
    try:
        return run_case(case)
    finally:
        methods.unregister("toy")


def test_every_reader_sees_a_registered_method(toy):
    assert "toy" in methods.available()
    r = plan(seq_len=16384, heads=32, kv_heads=8, world=4)
    toys = [e for e in r.entries if e.candidate.method == "toy"]
    assert {e.label for e in toys} == {"toy/zigzag", "toy/contiguous"} and all(e.ok for e in toys)
    assert r.best is not None and r.best.candidate.method == "toy"
    assert seqpar.plan is plan
    assert choose((1, 4096, 32, 128), 8, True, (-1, -1), 4, 1, "zigzag")[0] == "toy"
    assert choose((1, 4096, 32, 128), 8, True, (-1, -1), 4, 1, "stripe")[0] == "ring"     # the toy has no stripe
    assert "toy/zigzag" in [s.label for s in method_specs(PRESETS["tiny-causal"], 4, methods.available())]
    rows = [c for c in demo_cases(4, "cpu") if c.method == "toy"]
    assert [(c.layout, c.causal) for c in rows] == [("zigzag", True), ("contiguous", False)]


def test_unregistered_method_is_gone_everywhere():
    methods.register(TOY)
    assert choose((1, 4096, 32, 128), 8, True, (-1, -1), 4, 1, "zigzag")[0] == "toy"
    methods.unregister("toy")
    assert "toy" not in methods.available()
    assert choose((1, 4096, 32, 128), 8, True, (-1, -1), 4, 1, "zigzag")[0] != "toy"      # no stale cache
    assert not any(e.candidate.method == "toy" for e in plan(seq_len=16384, heads=32, world=4).entries)
    assert not any(s.method == "toy" for s in method_specs(PRESETS["tiny-causal"], 4, methods.available()))
    assert not any(c.method == "toy" for c in demo_cases(4, "cpu"))
    with pytest.raises(ValueError, match="method must be one of"):
        methods.get("toy")


def test_toy_matches_the_oracle(pools):
    cases = [Case(method="toy", layout="zigzag", causal=True, seq_len=32, heads=4, kv_heads=2, head_dim=8),
             Case(method="toy", layout="contiguous", causal=False, seq_len=24, heads=4, kv_heads=1, head_dim=8,
                  lse_grad=True, dtype="float64")]
    assert_all_ok([check_case(c, pools(2).run(_toy_case, c)) for c in cases])
