"""Local kernels: the reference against the dense oracle, selection and its errors (CPU)."""

import pytest
import torch

from seqpar.errors import UnsupportedInputError
from seqpar.kernels import KERNELS, KernelCall, available_kernels, select
from seqpar.masks import Band, Varlen
from seqpar.testing import dense_attention


def _dense_band(q, k, v, do, band, scale):
    m, n = q.shape[1], k.shape[1]
    d = torch.arange(n)[None] - torch.arange(m)[:, None]
    vis = torch.ones(m, n, dtype=torch.bool)
    if band.lo is not None:
        vis &= d >= band.lo
    if band.hi is not None:
        vis &= d <= band.hi
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(g, 2)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]).nan_to_num(0), vd.repeat_interleave(g, 2))
    grads = torch.autograd.grad(out, (qd, kd, vd), do.double())
    return out, lse, grads


@pytest.mark.parametrize("band", [Band(), Band(None, 0), Band(None, 3), Band(-2, 1), Band(-5, -1), Band(2, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_band_forward_backward(band, dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 8, dtype=dtype)
    k, v = torch.randn(2, 7, 2, 8, dtype=dtype), torch.randn(2, 7, 2, 8, dtype=dtype)
    do = torch.randn(2, 5, 4, 8, dtype=dtype)
    ref = KERNELS["reference"]
    out, lse = ref.forward(q, k, v, band, 0.4)
    want_out, want_lse, grads = _dense_band(q, k, v, do, band, 0.4)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert out.dtype == lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=tol, rtol=tol)
    got = ref.backward(do, q, k, v, out, lse, band, 0.4)
    for g, w in zip(got, grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol)


def test_reference_varlen_matches_dense_documents():
    torch.manual_seed(1)
    S = 12
    q, k, v = (torch.randn(1, S, 2, 4, dtype=torch.float64) for _ in range(3))
    cu = (0, 3, 4, 12)
    want = dense_attention(q, k, v, causal=True, cu_seqlens=cu)
    got = KERNELS["reference"].forward(q, k, v, Varlen(cu, cu, (-1, 0)), 4 ** -0.5)
    torch.testing.assert_close(got.out, want["out"])
    torch.testing.assert_close(got.lse, want["lse"])


def test_delta_replaces_out_in_backward():
    torch.manual_seed(2)
    q, k, v, do = (torch.randn(1, 6, 2, 8) for _ in range(4))
    ref = KERNELS["reference"]
    out, lse = ref.forward(q, k, v, Band(None, 0), 0.35)
    delta = (do * out).sum(-1).transpose(1, 2)
    a = ref.backward(do, q, k, v, out, lse, Band(None, 0), 0.35)
    b = ref.backward(do, q, k, v, None, lse, Band(None, 0), 0.35, delta=delta)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_auto_on_cpu_and_named_kernels_refuse_with_reasons():
    call = KernelCall.of(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), Band(None, 0))
    assert select("auto", call).name == "cpu_flash"
    band = KernelCall.of(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), Band(-2, 0))
    assert select("auto", band).name == "reference"                # windows: the reference kernel
    assert select("auto", KernelCall.of(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), Band(None, 0),
                                        deterministic=True)).name == "reference"
    for name in ("cudnn", "flash", "efficient", "flex", "flash_attn", "flash_attn3", "sdpa"):
        with pytest.raises(UnsupportedInputError) as e:
            select(name, call)
        assert "CUDA" in str(e.value)
    with pytest.raises(ValueError, match="kernel must be one of"):
        select("fast", call)
    assert {"auto", "reference", "cudnn", "flash", "flex", "flash_attn", "sdpa"} <= set(available_kernels())


def test_auto_passes_over_plan_per_shape_kernels_when_shapes_vary(monkeypatch):
    """Note [Plans per shape]: cuDNN keeps a graph per block shape without bound, so ``auto`` never gives it a
    block whose shape comes from a batch's documents (FA2 serves it); a named kernel is still honoured, and
    the planned call's runner marks its blocks so when it has documents or a valid length."""
    from dataclasses import replace
    from types import SimpleNamespace

    from seqpar.kernels.executor import TaskRunner

    assert KERNELS["cudnn"].plans_per_shape and not KERNELS["flash"].plans_per_shape
    for name in ("cudnn", "flash"):                 # as on a GPU that serves both
        monkeypatch.setattr(type(KERNELS[name]), "not_supported_reasons", lambda self, call: [])
    select.cache_clear()
    try:
        fixed = KernelCall("cuda", torch.bfloat16, 128, 32, 8, "causal")
        assert select("auto", fixed).name == "cudnn"
        assert select("auto", replace(fixed, shapes_vary=True)).name == "flash"
        assert select("cudnn", replace(fixed, shapes_vary=True)).name == "cudnn"
    finally:
        select.cache_clear()

    from seqpar.config import AttentionConfig
    from seqpar.methods.base import Call

    def runner(**cfg):
        call = SimpleNamespace(cfg=AttentionConfig(layout="balanced" if "cu_seqlens" in cfg else "zigzag", **cfg),
                               scale=0.1, seq_len=8, layout=SimpleNamespace(divisor=2))
        call.packed = Call.packed.fget(call)
        call.shapes_vary = Call.shapes_vary.fget(call)
        return TaskRunner.of(call)
    assert not runner().shapes_vary
    assert runner(cu_seqlens=(0, 5, 8)).shapes_vary and runner(seq_len=6).shapes_vary
    assert runner(cu_seqlens=(0, 6)).shapes_vary                   # one document, padded past the divisor
    assert not runner(cu_seqlens=(0, 8)).shapes_vary              # one document: the shapes of the length
    assert not runner(seq_len=7).shapes_vary                       # padding within the divisor: bounded lengths


def test_gpu_kernels_declare_mask_limits():
    cuda = KernelCall("cuda", torch.bfloat16, 128, 32, 8, "band")
    assert any("band" in r for r in KERNELS["cudnn"].not_supported_reasons(cuda))
    assert KERNELS["flash"].not_supported_reasons(cuda) == []
    varlen = KernelCall("cuda", torch.bfloat16, 128, 32, 8, "varlen")
    assert KERNELS["flash"].not_supported_reasons(varlen) == []
    assert KERNELS["cudnn"].not_supported_reasons(varlen)
    big = KernelCall("cuda", torch.bfloat16, 512, 8, 8, "full")
    assert all(KERNELS[n].not_supported_reasons(big) for n in ("cudnn", "flash", "efficient", "flex"))
    fp32 = KernelCall("cuda", torch.float32, 64, 8, 8, "causal")
    assert KERNELS["efficient"].not_supported_reasons(fp32) == []
    assert KERNELS["cudnn"].not_supported_reasons(fp32)


def test_auto_never_picks_the_reference_kernel_on_cuda():
    call = KernelCall("cuda", torch.bfloat16, 512, 8, 8, "full")      # nothing fused serves head dim 512
    with pytest.raises(UnsupportedInputError) as e:
        select("auto", call)
    assert "never picks the reference kernel on a GPU" in str(e.value)


def test_cudnn_and_fa2_declare_value_dims_and_softcap():
    mla = KernelCall("cuda", torch.bfloat16, 192, 16, 16, "causal", value_dim=128)
    assert KERNELS["flash"].not_supported_reasons(mla) == []          # V zero-padded to 192
    capped = KernelCall("cuda", torch.bfloat16, 128, 16, 16, "causal", softcap=True)
    for name in ("cudnn", "flash", "efficient"):
        assert any("softcap" in r for r in KERNELS[name].not_supported_reasons(capped)), name
    assert not any("softcap" in r for r in KERNELS["flex"].not_supported_reasons(capped))


def test_flash_attn3_is_declared_and_refuses_without_its_package():
    call = KernelCall("cuda", torch.bfloat16, 128, 16, 16, "causal")
    why = KERNELS["flash_attn3"].not_supported_reasons(call)
    assert any("flash_attn_interface" in r or "Hopper" in r or "CUDA" in r for r in why), why
    assert "cuda" not in KERNELS["flash_attn3"].auto_rank                 # named only: no measurement says faster


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask", [Band(), Band(None, 0), Band(None, 3)])
def test_cpu_flash_matches_the_reference(dtype, mask):
    """Forward and backward (from the final out and lse, with an lse gradient folded in), GQA, Dv != D."""
    from seqpar.numerics import GradRows

    torch.manual_seed(3)
    q, do = torch.randn(2, 6, 4, 8, dtype=dtype), torch.randn(2, 6, 4, 4, dtype=dtype)
    k, v = torch.randn(2, 9, 2, 8, dtype=dtype), torch.randn(2, 9, 2, 4, dtype=dtype)
    dlse = torch.randn(2, 4, 6)
    ref, cpu = KERNELS["reference"], KERNELS["cpu_flash"]
    want, got = ref.forward(q, k, v, mask, 0.3), cpu.forward(q, k, v, mask, 0.3)
    if dtype == torch.float64:                     # split bands merge in the accumulation dtype: fp64 stays fp64
        assert got.out.dtype == torch.float64, got.out.dtype
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(got.out.to(want.out.dtype), want.out, **tol)
    torch.testing.assert_close(got.lse, want.lse, **tol)
    out = want.out.to(dtype)
    rows = GradRows(do, out, dlse)
    a = ref.backward(do, q, k, v, None, want.lse, mask, 0.3, delta=rows.delta)
    b = cpu.backward(*rows.folded[:1], q, k, v, rows.folded[1], want.lse, mask, 0.3)
    for x, y in zip(a, b):
        assert dtype != torch.float64 or y.dtype == torch.float64, y.dtype
        torch.testing.assert_close(y.to(x.dtype), x, **({"atol": 5e-2, "rtol": 5e-2} if tol else {}))


def test_folding_the_lse_gradient_is_exact_in_fp64():
    """Note [Folding the lse gradient]: (dO', O') give the reference backward the Delta - dlse it would get."""
    from seqpar.numerics import GradRows

    torch.manual_seed(4)
    q, k, v = torch.randn(1, 5, 2, 8, dtype=torch.float64), *(torch.randn(1, 7, 2, 8, dtype=torch.float64)
                                                              for _ in range(2))
    do = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    do[:, 2] = 0                                                      # a row whose dO is zero
    ref = KERNELS["reference"]
    out, lse = ref.forward(q, k, v, Band(), 0.4)
    rows = GradRows(do, out, torch.randn(1, 2, 5, dtype=torch.float64))
    with_delta = ref.backward(do, q, k, v, None, lse, Band(), 0.4, delta=rows.delta)
    folded = ref.backward(rows.folded[0], q, k, v, rows.folded[1], lse, Band(), 0.4)
    for x, y in zip(with_delta, folded):
        torch.testing.assert_close(y, x, atol=1e-12, rtol=1e-10)
    arrived = GradRows.given(rows.folded[0], folded=rows.folded)      # pass-Q's bundle, to a kernel taking Delta
    torch.testing.assert_close(arrived.delta, rows.delta, atol=1e-12, rtol=1e-10)


def test_causal_halves_cover_the_causal_block_once():
    """Note [Long causal calls in halves]: the three blocks see exactly the causal block's pairs, each pair once,
    and merged they give the one call's out and lse (reference kernel, fp64); other blocks stay whole, and off
    CUDA ``forward_each`` never cuts."""
    from seqpar.kernels import combine
    from seqpar.kernels.executor import HALVES_ROWS, TaskRunner, halves
    from seqpar.layouts.blocks import Task

    for q0, k0, n in ((0, 0, 10), (3, 5, 9)):
        t = Task(q0, q0 + n, k0, k0 + n, Band(None, 0))
        seen = torch.zeros(n, n, dtype=torch.int64)
        parts = halves(t)
        assert len(parts) == 3
        for p in parts:
            d = torch.arange(p.cols)[None] - torch.arange(p.rows)[:, None]
            vis = torch.ones(p.rows, p.cols, dtype=torch.bool)
            if p.mask.hi is not None:
                vis &= d <= p.mask.hi
            seen[p.q_start - q0:p.q_stop - q0, p.k_start - k0:p.k_stop - k0] += vis
        assert torch.equal(seen, torch.ones(n, n, dtype=torch.int64).tril())
    for other in (Task(0, 8, 0, 8, Band()), Task(0, 8, 0, 12, Band(None, 4)), Task(0, 8, 0, 8, Band(-3, 0))):
        assert halves(other) == (other,)

    torch.manual_seed(0)
    q = torch.randn(2, 12, 4, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 12, 2, 16, dtype=torch.float64) for _ in range(2))
    runner, whole = TaskRunner("reference", 0.25), Task(0, 12, 0, 12, Band(None, 0))
    one = runner.forward(q, k, v, whole)
    out, lse = combine.merge_parts([(p.q, *runner.forward(q, k, v, p)) for p in halves(whole)], tuple(q.shape),
                                   q.dtype)
    torch.testing.assert_close(out, one.out)
    torch.testing.assert_close(lse, one.lse)
    big = Task(0, HALVES_ROWS, 0, HALVES_ROWS, Band(None, 0))
    qb = torch.zeros(1, HALVES_ROWS, 1, 8)
    called = []
    runner.forward = lambda q_, k_, v_, t: called.append(t)
    runner.forward_each((big,), qb, qb, qb)
    assert called == [big]


OPEN = [(Band(2, None), 5, 7), (Band(1, None), 6, 6), (Band(0, None), 6, 6), (Band(-3, None), 6, 9),
        (Band(-2, None), 9, 4), (Band(4, None), 8, 8), (Band(-20, None), 5, 7), (Band(7, None), 5, 7)]


@pytest.mark.parametrize("band,m,n", OPEN)
@pytest.mark.parametrize("dv", [8, 12])
def test_open_bands_run_backwards_on_the_cpu_flash_kernel(band, m, n, dv):
    """Note [Open bands backwards]: a band open to the right (a windowed ring's farthest step) on the top-left
    causal kernel, its rows and keys reversed: out, lse (-inf where a row sees nothing) and the gradients against
    the dense computation, GQA, a differing value head dim, a strided row slice; cuDNN does the same on a GPU
    (``tests/test_gpu_kernels.py``)."""
    torch.manual_seed(3)
    big = torch.randn(2, m + 3, 4, 8)
    q = big[:, 1:1 + m]
    k, v = torch.randn(2, n, 2, 8), torch.randn(2, n, 2, dv)
    do = torch.randn(2, m, 4, dv)
    call = KernelCall.of(q, k, band)
    assert call.mask == "open" and select("auto", call).name == "cpu_flash"
    kern = KERNELS["cpu_flash"]
    out, lse = kern.forward(q, k, v, band, 0.4)
    want_out, want_lse, grads = _dense_band(q, k, v, do, band, 0.4)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), ~finite)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=1e-5, rtol=1e-5)
    got = kern.backward(do, q, k, v, out, lse, band, 0.4)
    for g, w, x in zip(got, grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)


def test_open_cut_reads_an_open_band_backwards():
    from seqpar.kernels.sdpa import open_cut

    assert open_cut(Band(0, None), 4, 4) == (4, 0, 4, Band(None, 0))      # the upper triangle: causal reversed
    assert open_cut(Band(1, None), 4, 4) == (3, 1, 4, Band(None, 0))      # the last row sees nothing
    assert open_cut(Band(-2, None), 4, 4) == (4, 0, 4, Band(None, 2))     # full keys [0, 2) + causal, reversed
    assert open_cut(Band(-3, None), 4, 4) == (4, 0, 4, Band())            # every row sees every key
    assert open_cut(Band(4, None), 4, 4) is None                          # no row sees a key


def test_open_bands_go_to_cudnn_on_a_gpu(monkeypatch):
    """Windows stay off cuDNN; bands open to the right go to it (auto), FA2 and flex still serve them named."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    select.cache_clear()
    try:
        for training in (False, True):
            call = KernelCall("cuda", torch.bfloat16, 128, 32, 8, "open", arch=90, training=training)
            assert select("auto", call).name == "cudnn"
            assert select("flash", call).name == "flash" and select("flex", call).name == "flex"
            band = KernelCall("cuda", torch.bfloat16, 128, 32, 8, "band", arch=90, training=training)
            assert select("auto", band).name != "cudnn"
    finally:
        select.cache_clear()
