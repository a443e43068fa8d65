"""On one GPU (``python -m pytest -m gpu tests/test_gpu_runtime.py``): what only a GPU can show.

* the head dims and directions cuDNN serves on this torch/cuDNN match what ``kernels.sdpa`` declares;
* ``kernel="auto"`` on CUDA never picks the reference kernel, and a gradient through lse stays on the fused
  kernels (the fold of Note [Folding the lse gradient]) with an error within 2x of the plain backward's;
* a steady-state forward+backward with a fixed signature can be captured in a CUDA graph and replayed, on a
  NCCL process group (W = 1), for the direct path (out only) and the engine path (lse returned, sinks);
* ``torch.compile(fullgraph=True)`` on the GPU: zero graph breaks, eager results.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar.kernels import KERNELS, KernelCall, select
from seqpar.kernels.sdpa import cudnn_max_head_dim

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("nccl_group")]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _dense(q, k, v, do, dlse, sinks=None):
    """fp64 autograd truth on BSHD inputs (causal), optionally with sinks and a gradient through lse."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    G = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(G, 2)) * q.shape[-1] ** -0.5
    S = q.shape[1]
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    sd = None
    if sinks is not None:
        sd = sinks.detach().double().requires_grad_()
        s = torch.cat([s, sd.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)[..., :S]
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd.repeat_interleave(G, 2))
    loss = (out * do.double()).sum() + (lse * dlse.double()).sum()
    leaves = (qd, kd, vd) + ((sd,) if sd is not None else ())
    return out, lse, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dqk,dv", [(64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (192, 192), (256, 256),
                                    (192, 128)])
def test_cudnn_declaration_matches_what_it_serves(dqk, dv):
    """The probe as a test: cuDNN runs forward and backward correctly exactly where it is declared to."""
    call = KernelCall("cuda", torch.bfloat16, dqk, 8, 2, "causal", value_dim=0 if dv == dqk else dv)
    declared = not KERNELS["cudnn"].not_supported_reasons(call)
    q = torch.randn(1, 256, 8, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 256, 2, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 256, 2, dv, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(1, 256, 8, dv, device="cuda", dtype=torch.bfloat16)
    try:
        from seqpar.masks import Band

        out, lse = KERNELS["cudnn"].forward(q, k, v, Band(None, 0), dqk ** -0.5)
        grads = KERNELS["cudnn"].backward(do, q, k, v, out, lse, Band(None, 0), dqk ** -0.5)
        want_out, _, want = _dense(q, k, v, do, torch.zeros(1, 8, 256, device="cuda"))
        served = _rel(out, want_out) < 1e-2 and all(_rel(g, w) < 2e-2 for g, w in zip(grads, want))
    except RuntimeError:
        served = False
    assert declared == served, f"cuDNN declared {declared} but serves {served} at ({dqk}, {dv}), max " \
                               f"{cudnn_max_head_dim()}"


def test_auto_never_picks_the_reference_kernel_on_cuda():
    for d in (64, 80, 96, 128, 192, 256):
        for kind in ("full", "causal", "band", "varlen"):
            kern = select("auto", KernelCall("cuda", torch.bfloat16, d, 32, 8, kind))
            assert kern.name != "reference", (d, kind)


@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_lse_gradient_on_the_fused_kernels(d):
    """A loss through lse and out: the fused kernels' backward with the fold, against fp64; error within 2x of
    the same computation without the lse term."""
    torch.manual_seed(d)
    q = torch.randn(1, 512, 8, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 512, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 512, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, 512, 8, d, device="cuda", dtype=torch.bfloat16)
    errs = {}
    for with_lse in (False, True):
        dlse = torch.randn(1, 8, 512, device="cuda") if with_lse else torch.zeros(1, 8, 512, device="cuda")
        out, lse = seqpar.attention(q, k, v, return_lse=True)
        torch.autograd.backward((out, lse), (do, dlse))
        _, _, want = _dense(q, k, v, do, dlse)
        errs[with_lse] = max(_rel(t.grad, w) for t, w in zip((q, k, v), want))
        for t in (q, k, v):
            t.grad = None
    assert errs[True] <= 2 * errs[False] + 1e-3, errs


def _graph_step(q, k, v, do, **kw):
    out = seqpar.attention(q, k, v, check_ranks=False, **kw)
    out = out.out if isinstance(out, tuple) else out
    return torch.autograd.grad(out, (q, k, v), do)


@pytest.mark.parametrize("kw", [{}, {"return_lse": True}], ids=["direct", "engine"])
def test_cuda_graph_capture_and_replay(kw):
    torch.manual_seed(0)
    q = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _graph_step(q, k, v, do, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _graph_step(q, k, v, do, **kw)
    with torch.no_grad():
        for t in (q, k, v):
            t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    eager = _graph_step(q, k, v, do, **kw)
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


def test_compile_fullgraph_on_gpu():
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 3 * 8 * 64, device="cuda", dtype=torch.bfloat16)

    def block(x):
        q, k, v = proj(x).unflatten(-1, (3, 8, 64)).unbind(2)
        return seqpar.attention(q, k, v, return_lse=True).out.float().square().sum()

    x = torch.randn(1, 256, 64, device="cuda", dtype=torch.bfloat16)
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True)(x)
    assert torch._dynamo.explain(block)(x).graph_break_count == 0
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("method,options", [("ring", {}), ("ring", {"head_chunks": 2}), ("ulysses", {}),
                                            ("allgather", {"heads_k_stride": 1})])
def test_graphed_calls_equal_eager(method, options):
    """graphs=True (Note [Graphed calls]): the first call eager, the second captured, later ones replayed - each
    with new inputs copied into the graph's buffers - give the eager call's out, lse and gradients bitwise
    (deterministic kernels: FA2's and cuDNN's default backward sum dQ in a run-dependent order). With a
    gradient through lse the captured call folds it with the plain torch form of the fold (the compiled one
    cannot run inside a capture), which rounds differently: dQ within one bf16 ulp (measured 4.9e-4)."""
    kw = dict(method=method, return_lse=True, deterministic=True, **options)
    for step in range(4):
        torch.manual_seed(step)
        q, k, v = (torch.randn(1, 512, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
        do = torch.randn(1, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
        dlse = torch.randn(1, 8, 512, device="cuda") if step % 2 else None
        res = []
        for graphs in (False, True):
            leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
            out, lse = seqpar.attention(*leaves, graphs=graphs, **kw)
            grads = torch.autograd.grad((out, lse) if dlse is not None else (out,), leaves,
                                        (do, dlse) if dlse is not None else (do,))
            res.append((out, lse, *grads))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
            err = float((a.float() - b.float()).abs().max())
            if dlse is None or name in ("out", "lse"):
                assert torch.equal(a, b), (method, step, name, err)
            else:
                assert err <= 2 ** -8 * float(b.float().abs().max()), (method, step, name, err)


class _SavingEngine:
    """A saving engine of Ulysses' shape on the GPU: its saved tensors are views into one buffer (Ulysses' q, k, v
    into its receive buffer) beside an output of their own."""

    saves = True

    def forward(self, q, k, v):
        recv = torch.cat([q + 1, k * 3])
        return q * 2, q.sum(-1), (recv[: len(q)], recv[len(q):], torch.sin(q - v))

    def backward(self, b):
        a, c, d = b.saved
        return b.rows.do * a, b.rows.do * c, b.rows.do * d


def test_graphed_saving_engine_keeps_every_layer_in_a_slot_of_its_own():
    """Note [Saved slots], captured for real: three layers' forwards in flight, then their backwards, over three
    steps - each forward replays into a slot of its own, each backward reads its slot's saved tensors in place; the
    results equal the eager engine's bitwise, the slots are free after each step and reused."""
    from seqpar.methods.base import BackwardInputs
    from seqpar.numerics import GradRows
    from seqpar.runtime.graphs import Graphed

    engine = _SavingEngine()
    graphed = Graphed(engine, required=True)
    for step in range(3):
        torch.manual_seed(step)
        layers = [[torch.randn(64, 32, device="cuda") for _ in range(4)] for _ in range(3)]
        held = [graphed.forward(q, k, v) for q, k, v, _ in layers]
        for (q, k, v, _), got in zip(layers, held):
            want = engine.forward(q, k, v)
            assert all(torch.equal(x, y) for x, y in zip((*got[:2], *got[2]), (*want[:2], *want[2])))
        for (q, k, v, do), (*_, saved) in reversed(list(zip(layers, held))):
            rows = GradRows(do, None, None)
            got = graphed.backward(BackwardInputs(rows, do.sum(-1), None, None, None, saved, None, False))
            want = engine.backward(BackwardInputs(rows, None, None, None, None, engine.forward(q, k, v)[2], None,
                                                  False))
            assert all(torch.equal(x, y) for x, y in zip(got, want)), step
        del held, saved
        assert len(graphed._slots) == (2 if step == 0 else 3) and all(s.free() for s in graphed._slots), step
    assert "fwd" not in graphed._graphs and all(len(s.bwd) == 1 for s in graphed._slots)
    assert graphed.release() == 7 and not graphed._slots      # + the backward graph of the eager first forward


def test_graphed_saving_engine_in_interleaved_order_equals_eager():
    """Note [Slots and scratch], captured for real: forwards and backwards interleaved as a pipeline's micro-batches
    or a reference model's no-grad forward interleave them - A, B, A's backward, C, a no-grad forward, B's and C's
    backward - over three rounds: every result equals the eager engine's bitwise, no graph replaying over a slot
    captured after it."""
    from seqpar.methods.base import BackwardInputs
    from seqpar.numerics import GradRows
    from seqpar.runtime.graphs import Graphed

    engine = _SavingEngine()
    graphed = Graphed(engine, required=True)

    def bwd(do, saved, eng):
        return eng.backward(BackwardInputs(GradRows(do, None, None), do.sum(-1), None, None, None, saved, None,
                                           False))

    def check(got, want):
        assert all(torch.equal(x, y) for x, y in zip(got, want))

    for rnd in range(3):
        torch.manual_seed(rnd)
        (qa, ka, va, da), (qb, kb, vb, db), (qc, kc, vc, dc), (qn, kn, vn, _) = (
            [torch.randn(64, 32, device="cuda") for _ in range(4)] for _ in range(4))
        a, b = graphed.forward(qa, ka, va), graphed.forward(qb, kb, vb)
        check(bwd(da, a[2], graphed), bwd(da, engine.forward(qa, ka, va)[2], engine))
        del a
        c = graphed.forward(qc, kc, vc)
        check(graphed.forward(qn, kn, vn, keep_saved=False)[:2], engine.forward(qn, kn, vn)[:2])
        check(bwd(db, b[2], graphed), bwd(db, engine.forward(qb, kb, vb)[2], engine))
        check(bwd(dc, c[2], graphed), bwd(dc, engine.forward(qc, kc, vc)[2], engine))
        del b, c
    assert all(s.free() for s in graphed._slots)
    seqs = [s.fwd.seq for s in graphed._slots]
    assert seqs == sorted(seqs)


def test_graphed_plan_captures_again_after_its_graphs_are_gone():
    """PyTorch drops a graph pool with its last graph, and capturing into a dropped pool fails an internal assert;
    so after ``release`` (Note [Graphs and shutdown]) or once a kind's graphs are destroyed (found faster eager), the
    next capture takes a new pool: calls keep giving the eager engine's results."""
    from seqpar.methods.base import BackwardInputs
    from seqpar.numerics import GradRows
    from seqpar.runtime.graphs import Graphed

    engine = _SavingEngine()
    graphed = Graphed(engine, required=True)
    q, k, v, do = (torch.randn(64, 32, device="cuda") for _ in range(4))
    want = engine.backward(BackwardInputs(GradRows(do, None, None), None, None, None, None, engine.forward(q, k, v)[2],
                                          None, False))

    def step():
        saved = graphed.forward(q, k, v)[2]
        got = graphed.backward(BackwardInputs(GradRows(do, None, None), do.sum(-1), None, None, None, saved, None,
                                              False))
        assert all(torch.equal(x, y) for x, y in zip(got, want))

    for _ in range(3):
        step()
    assert graphed.release() > 0
    for _ in range(3):
        step()
    graphed._drop("fwd")                        # every graph of the pool gone: the slots held them all
    graphed._eager.add("fwd")
    assert not graphed._slots and not graphed._graphs
    for _ in range(2):                          # eager forwards; the backward's own graph, in a new pool
        step()
    assert graphed._graphs


def test_ulysses_saving_its_inputs_falls_back_to_clones():
    """Note [Saved slots]: Ulysses at degree 1 with two head groups (not the direct path) saves views of the inputs
    it was given (no all-to-all), so its graphed forward cannot keep them in slots - it clones them, and out and
    gradients equal eager bitwise with three layers in flight."""
    from seqpar.runtime import call as _call
    from seqpar.runtime.graphs import Graphed

    _call.cache_clear()
    kw = dict(method="ulysses", head_chunks=2, deterministic=True)
    try:
        for step in range(3):
            torch.manual_seed(step)
            layers = [[torch.randn(1, 512, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2, 8)]
                      for _ in range(3)]
            res = {}
            for graphs in (False, True):
                held = []
                for q, k, v, _ in layers:
                    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
                    held.append((leaves, seqpar.attention(*leaves, graphs=graphs, **kw)))
                res[graphs] = [(out, *torch.autograd.grad(out, leaves, do))
                               for (leaves, out), (*_, do) in reversed(list(zip(held, layers)))]
                del held
            for a, b in zip(res[False], res[True]):
                for name, x, y in zip(("out", "dq", "dk", "dv"), a, b):
                    assert torch.equal(x, y), (step, name)
        (engine,) = [p.engine for p, _ in _call._PLANS.values() if isinstance(p.engine, Graphed)]
        assert not engine._slotted and not engine._slots and "fwd" in engine._graphs
    finally:
        _call.cache_clear()


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_graphed_packed_batches_equal_eager_and_retire(method):
    """Note [Graphed batches]: a packed batch's calls - eager, captured, replayed - give the eager result bitwise;
    the next packed batch's plan retires the first's graphs, and a call that comes back for the first batch runs
    eagerly with the same result."""
    from seqpar.runtime import call as _call

    _call.cache_clear()
    batches = [torch.tensor(cu, dtype=torch.int32) for cu in ((0, 100, 356, 512), (0, 256, 300, 512))]
    kw = dict(method=method, deterministic=True)

    def run(cu, graphs, q, k, v, do):
        leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
        out = seqpar.attention(*leaves, cu_seqlens=cu, graphs=graphs, **kw)
        return (out, *torch.autograd.grad(out, leaves, do))

    def check(cu, calls):
        for step in range(calls):
            torch.manual_seed(step)
            q, k, v = (torch.randn(1, 512, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
            do = torch.randn(1, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
            for name, a, b in zip(("out", "dq", "dk", "dv"), run(cu, True, q, k, v, do),
                                  run(cu, False, q, k, v, do)):
                assert torch.equal(a, b), (method, step, name)

    def engines(cu):
        return [p.engine for p, _ in _call._BATCH_PLANS.values() if p.cfg.cu_seqlens == tuple(cu.tolist())]

    try:
        check(batches[0], 4)
        first = [e for e in engines(batches[0]) if hasattr(e, "retire")]
        assert first and not any(e.retired for e in first)       # graphs=True: graphed (W = 1: auto would not)
        check(batches[1], 3)
        assert all(e.retired for e in first)
        check(batches[0], 2)                                      # retired: eager, the same bits
    finally:
        _call.cache_clear()


def test_reduce_overhead_compile_equals_eager():
    """torch.compile(mode="reduce-overhead") of a decoder stack calling seqpar.attention gives the eager
    result at W = 1 on NCCL, loss and gradients, after the warm-up and recorded runs."""
    from tests.test_gpu_emulated import _decoder_stack

    model = _decoder_stack()
    x = torch.randn(1, 1024, 512, device="cuda", dtype=torch.bfloat16)
    eager_loss = model(x).float().square().mean()
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled = torch.compile(model, mode="reduce-overhead")
    for _ in range(3):
        loss = compiled(x).float().square().mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=2e-2)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2)


def test_padding_within_the_divisor_runs_on_cudnn_and_matches_the_truth():
    """A valid length short of the padded one by less than the layout's divisor keeps per-shape kernels (cuDNN on
    its blocks, Call.shapes_vary): out, lse and the gradients of the valid rows match the fp64 truth on the valid
    rows, and the padding's rows and gradients are zero."""
    from seqpar.runtime import call as _call

    torch.manual_seed(5)
    S, valid, H, Hkv, D = 1024, 1023, 8, 2, 128
    q, k, v = (torch.randn(1, S, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (H, Hkv, Hkv))
    out, lse = seqpar.attention(q, k, v, method="ring", seq_len=valid, return_lse=True)
    plan = next(reversed(_call._BATCH_PLANS.values()))[0]           # the call just made
    assert not plan.call.shapes_vary
    do, dlse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), (q, k, v))
    t_out, t_lse, t_grads = _dense(q[:, :valid], k[:, :valid], v[:, :valid], do[:, :valid], dlse[:, :, :valid])
    assert _rel(out[:, :valid], t_out) < 2e-2 and _rel(lse[:, :, :valid], t_lse) < 1e-3
    for g, t in zip(grads, t_grads):
        assert _rel(g[:, :valid], t) < 3e-2
        assert g[:, valid:].abs().max() == 0
