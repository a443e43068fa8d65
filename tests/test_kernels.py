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


def test_auto_on_cpu_is_the_reference_and_named_kernels_refuse_with_reasons():
    call = KernelCall.of(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8), Band(None, 0))
    assert select("auto", call).name == "reference"
    for name in ("cudnn", "flash", "efficient", "flex", "flash_attn", "sdpa"):
        with pytest.raises(UnsupportedInputError) as e:
            select(name, call)
        assert "CUDA" in str(e.value)
    with pytest.raises(ValueError, match="kernel must be one of"):
        select("fast", call)
    assert {"auto", "reference", "cudnn", "flash", "flex", "flash_attn", "sdpa"} <= set(available_kernels())


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
