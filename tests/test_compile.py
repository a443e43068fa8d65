"""torch.compile: a model that calls ``seqpar.attention`` compiles with ``fullgraph=True`` - zero graph breaks - and
gives the eager results, for every method (Note [Tracing seqpar.attention] in ``seqpar.runtime.op``).

Each case compiles a small block (a projection, attention, a loss) on W = 4 gloo ranks, counts graph breaks
with ``torch._dynamo.explain``, and compares the loss and every gradient with the same block run eagerly. New
packed batches (new ``cu_seqlens`` tensors) compile at most twice: new boundaries never recompile; a new number of
documents recompiles once, after which that dim is dynamic.
"""

from __future__ import annotations

import pytest
from reliability_methods import SOFTMAX, softmax_setup

W = 4


def compiled_vs_eager(method: str, layout: str, ulysses: int | None, options: tuple, features: dict) -> dict:
    """Worker: graph breaks, recompiles across two batches, and the largest differences to eager."""
    import torch
    import torch._dynamo

    import seqpar

    torch.manual_seed(0)
    mesh = seqpar.make_mesh(ulysses=ulysses, device_type="cpu") if ulysses else None
    dv = features.get("value_dim", 4)
    heads = 4

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, heads * (8 + dv))
            self.sinks = torch.nn.Parameter(torch.randn(heads)) if features.get("sinks") else None

        def forward(self, x, cu):
            q, k, v = self.proj(x).unflatten(-1, (heads, 8 + dv)).split([4, 4, dv], -1)
            o = seqpar.attention(q, k, v, mesh=mesh, method=method, layout=layout, cu_seqlens=cu,
                                 softcap=features.get("softcap", 0.0), sinks=self.sinks, **dict(options))
            return (o.float() ** 2).sum()

    L = 24
    x = torch.randn(1, L, 16)
    # new boundaries, same count: no recompile; another count: one more graph (the dim turns dynamic), then none
    bounds = ([0, 10, L * W], [0, 31, L * W], [0, 3, 40, L * W], [0, 5, 9, 60, L * W])
    batches = [torch.tensor(c, dtype=torch.int32) for c in bounds]
    model = Block()

    def grads(fn, cu):
        model.zero_grad()
        loss = fn(x, cu)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    compiled = torch.compile(model, fullgraph=True, backend=features.get("backend", "aot_eager"))
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    worst = 0.0
    for cu in batches:
        le, ge = grads(model, cu)
        lc, gc = grads(compiled, cu)
        worst = max(worst, float((le - lc).abs() / le.abs()),
                    *(float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)) for a, b in zip(ge, gc)))
    frames = counts["stats"]["unique_graphs"]
    breaks = torch._dynamo.explain(model)(x, batches[0]).graph_break_count
    return {"breaks": breaks, "graphs": frames, "worst": worst}


CASES = [(m, {}) for m in SOFTMAX] + [
    ("ring", {"value_dim": 8, "sinks": True, "softcap": 20.0}),
    ("ulysses", {"sinks": True, "value_dim": 8}),
    ("ring", {"backend": "inductor"}),
]


@pytest.mark.parametrize("method,features", CASES, ids=[f"{m}-{'-'.join(f) or 'plain'}" for m, f in CASES])
def test_fullgraph_compile_matches_eager(pools, method, features):
    s = softmax_setup(method, W)
    res = pools(W).run(compiled_vs_eager, method, s.layout, s.ulysses, s.options, features)
    for r, got in enumerate(res):
        assert got["breaks"] == 0, f"rank {r}: {got['breaks']} graph breaks"
        assert got["graphs"] <= 2, f"rank {r}: new packed batches recompiled ({got['graphs']} graphs for 4 batches)"
        assert got["worst"] < 1e-5, f"rank {r}: compiled differs from eager by {got['worst']:.2e}"
