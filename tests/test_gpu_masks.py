"""On one GPU (``python -m pytest -m gpu tests/test_gpu_masks.py``): masks on CUDA kernels against the fp64 oracle.

* every named mask runs on dense kernels only (no flex, no reference) and matches the oracle in bf16 within the
  suite's tolerance (2x a single-device bf16 computation);
* a generic ``mask_mod`` runs its partly visible blocks on flex, the whole-call (direct) path and the engine path
  (lse returned) alike; softcap's direct path equals its engine path;
* equal chunks run as one batched cuDNN call (Note [Equal blocks as a batch]) and match the oracle;
* flex's forward on TMA (Note [Flex on TMA]) captured as a CUDA graph gives the eager call's results;
* windowed bands on ``auto`` (the sink window, windowed spans, a plain ``window_size=``) in a training call: on sm90
  flex, a step's band and thin blocks joined into one call (Note [Bands on flex]), direct and engine paths; the
  plan on sm90.
"""

from __future__ import annotations

import pytest
import torch

import seqpar
from seqpar import masks
from seqpar.testing.cases import HashMask
from seqpar.testing.oracle import dense_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              # flex's backward from the final rows must build here (its fallback, the recompute, would pass too)
              pytest.mark.filterwarnings("error:seqpar. flex.s backward from the final rows:RuntimeWarning"),
              pytest.mark.usefixtures("nccl_group")]
S = 1024


def _inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, S, h, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for h in (8, 2, 2)]


def _check(out, q, k, v, causal, mask, softcap=0.0, window=(-1, -1)):
    # a seeded dO: drawn from the process's generator, one draw in a few runs of the spans window (one flex call,
    # flex's own autograd) put dv at 2.05x the bf16 dense error and another at 0.6x
    do = torch.randn(out.shape, device=out.device, dtype=out.dtype,
                     generator=torch.Generator(device=out.device).manual_seed(1))
    out.backward(do)
    got = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    truth = dense_attention(q, k, v, do, causal=causal, window=window, mask_mod=mask, softcap=softcap)
    base = dense_attention(q, k, v, do, causal=causal, window=window, mask_mod=mask, softcap=softcap,
                           dtype=torch.bfloat16, upcast_softmax=False)
    for f, x in got.items():
        err = (x.double() - truth[f]).abs().max().item()
        ref = (base[f].double() - truth[f]).abs().max().item()
        assert err <= 2 * ref + 1e-3, (f, err, ref)


NAMED = [(True, masks.chunked(256)), (False, masks.spans([(10, 200), (600, 700)])), (False, masks.prefix_lm(300)),
         (False, masks.block_causal(128)), (False, masks.shared_prefix(512, [128, 256, 128])),
         (False, masks.sink_window(127, 4))]


@pytest.mark.parametrize("causal,mask", NAMED, ids=[type(m).__name__ for _, m in NAMED])
def test_named_masks_run_on_dense_kernels(causal, mask):
    q, k, v = _inputs()          # kernel="sdpa" (cuDNN, FA2, efficient) would refuse any block needing flex
    out = seqpar.attention(q, k, v, causal=causal, mask_mod=mask, layout="contiguous", kernel="sdpa")
    _check(out, q, k, v, causal, mask)


@pytest.mark.parametrize("causal,mask", [(True, masks.chunked(256)), (False, masks.chunked(512))],
                         ids=["chunks-causal", "chunks-full"])
def test_equal_chunks_as_one_batched_call(causal, mask):
    """Note [Equal blocks as a batch] on a GPU: Ulysses on one rank runs its whole-sequence call on the engine (no
    direct path for several blocks), the equal chunks as ONE batched cuDNN call forward and backward."""
    from seqpar.kernels import executor

    calls = []
    real = executor.TaskRunner._forward_stacked
    executor.TaskRunner._forward_stacked = lambda self, *a: calls.append(a[3].mask) or real(self, *a)
    try:
        q, k, v = _inputs(2)
        out = seqpar.attention(q, k, v, method="ulysses", causal=causal, mask_mod=mask, kernel="cudnn")
    finally:
        executor.TaskRunner._forward_stacked = real
    assert [m.count for m in calls] == [S // mask.size], calls
    _check(out, q, k, v, causal, mask)


@pytest.mark.parametrize("return_lse", [False, True])
def test_generic_mask_mod_on_flex(return_lse):
    q, k, v = _inputs(1)
    fn = HashMask(3, keep=0.5, period=128)
    res = seqpar.attention(q, k, v, causal=True, mask_mod=fn, layout="contiguous", return_lse=return_lse)
    _check(res.out if return_lse else res, q, k, v, True, fn)


@pytest.mark.parametrize("case", ["mask_mod", "softcap", "band"])
def test_flex_engine_forward_captures_as_a_graph(case, wide_at_256):
    """Note [Flex under capture]: the engine path's flex forward (lse returned: ``FlexKernel.forward``; a band's on
    TMA on sm90, Note [Flex on TMA]) of a training call is captured and replayed as a CUDA graph (graphs=True: the
    first call eager, then captured, then replayed, new inputs each time) and gives the eager call's out and lse
    bitwise, its gradients within a bf16 ulp."""
    kw = {"mask_mod": dict(mask_mod=HashMask(3, keep=0.5, period=128)), "softcap": dict(softcap=5.0),
          "band": dict(window_size=(300, 0))}[case]
    for step in range(3):
        q, k, v = _inputs(10 + step)
        do = torch.randn_like(q)
        res = []
        for graphs in (False, True):
            leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
            out, lse = seqpar.attention(*leaves, causal=True, layout="contiguous", return_lse=True, graphs=graphs,
                                        **kw)
            res.append((out, lse, *torch.autograd.grad(out, leaves, do)))
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
            if name in ("out", "lse"):
                assert torch.equal(a, b), (case, step, name)
            else:
                assert float((a.float() - b.float()).abs().max()) <= 2 ** -7 * float(b.float().abs().max()), name


@pytest.mark.parametrize("case", ["mask_mod", "softcap"])
def test_graphed_flex_call_with_a_sums_gradient(case):
    """Note [Layouts under capture]: a loss's expanded gradient (``out.sum()``: every stride 0) reaches the graphed
    backward contiguous, as its capture's copy is, so the eager call, the capture and the replay meet one variant of
    flex's backward; gradients within a bf16 ulp of the eager plan's."""
    kw = {"mask_mod": dict(mask_mod=HashMask(3, keep=0.5, period=128)), "softcap": dict(softcap=5.0)}[case]
    for step in range(3):                   # graphs=True: eager, captured, replayed
        q, k, v = _inputs(20 + step)
        res = []
        for graphs in (False, True):
            leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v))
            out, _ = seqpar.attention(*leaves, causal=True, layout="contiguous", return_lse=True, graphs=graphs, **kw)
            res.append(torch.autograd.grad(out.float().sum(), leaves))
        for name, a, b in zip(("dq", "dk", "dv"), *res):
            assert float((a.float() - b.float()).abs().max()) <= 2 ** -7 * float(b.float().abs().max()), (step, name)


@pytest.mark.parametrize("return_lse", [False, True])
def test_softcap_direct_and_engine_paths(return_lse):
    q, k, v = _inputs(2)
    res = seqpar.attention(q, k, v, causal=True, softcap=5.0, layout="contiguous", return_lse=return_lse)
    _check(res.out if return_lse else res, q, k, v, True, None, softcap=5.0)


WINDOWED = [(False, masks.sink_window(127, 4), (-1, -1)), (False, masks.spans([(10, 200), (600, 700)], window=100),
            (-1, -1)), (True, None, (200, 0))]


@pytest.fixture
def wide_at_256(monkeypatch):
    """These tests' 1K-token bands count as wide (Note [Bands on flex]: ``WIDE_ROWS`` is 4096), so the flex and
    joined paths run on an sm90 card."""
    import seqpar.kernels.executor as ex

    monkeypatch.setattr(ex, "WIDE_ROWS", 256)


@pytest.mark.usefixtures("wide_at_256")
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("causal,mask,window", WINDOWED, ids=["sink_window", "spans_window", "window_size"])
def test_windowed_bands_on_auto(causal, mask, window, return_lse):
    q, k, v = _inputs(4)
    res = seqpar.attention(q, k, v, causal=causal, mask_mod=mask, window_size=window, layout="contiguous",
                           return_lse=return_lse)
    _check(res.out if return_lse else res, q, k, v, causal, mask, window=window)


@pytest.mark.parametrize("length", [127, 200, 4100])
def test_flex_serves_a_band_of_any_length(length):
    """A band of a length no tile divides, forced onto flex in a training call (the 8B recipe's warm-up met a
    127-row band there): flex lowers it and matches the oracle."""
    g = torch.Generator(device="cuda").manual_seed(length)
    q, k, v = [torch.randn(1, length, h, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (8, 2, 2)]
    out = seqpar.attention(q, k, v, causal=True, window_size=(length // 3, 0), kernel="flex", layout="contiguous")
    _check(out, q, k, v, True, None, window=(length // 3, 0))


@pytest.mark.usefixtures("wide_at_256")
def test_sm90_runs_the_sink_window_as_one_flex_call():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Note [Bands on flex] is declared for sm90")
    from seqpar.kernels.executor import TaskRunner
    from seqpar.layouts import make_layout
    from seqpar.layouts.blocks import Rule
    from seqpar.methods._passkv import schedule

    tasks = schedule(make_layout("contiguous", 1, None, None), 0, S, Rule(False, mask=masks.sink_window(127, 4)),
                     None, None).steps[0]
    calls = TaskRunner("auto", 0.1, training=True).kernels(tasks, (1, S, 8, 64), (1, S, 2, 64), torch.bfloat16, "cuda")
    assert [(type(t.mask).__name__, t.rows, t.cols, k) for t, k in calls] == [("Joined", S, S, "flex")]
