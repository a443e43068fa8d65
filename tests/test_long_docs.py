"""Long documents cut in few-head varlen calls (Note [Long documents in few heads], ``seqpar.kernels.long_docs``).

The plan is host arithmetic; the composition (the varlen call, the side blocks, the merge and the gradient adds)
runs here with the reference kernel and a forced slot count, against the same kernel uncut, in fp64.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from seqpar.kernels import long_docs
from seqpar.kernels.base import KERNELS
from seqpar.masks.forms import Band, Varlen, dense

REF = KERNELS["reference"]


def _visible(mask: Varlen, rows: int, keys: int) -> torch.Tensor:
    """Boolean (rows, keys) visibility of a varlen mask, one segment at a time."""
    vis = torch.zeros(rows, keys, dtype=torch.bool)
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(mask.cu_q), itertools.pairwise(mask.cu_k)):
        if q1 > q0 and k1 > k0:
            m, n = q1 - q0, k1 - k0
            vis[q0:q1, k0:k1] = dense(Band(None, n - m), m, n, "cpu")
    return vis


def _cut_visible(cut: long_docs.Cut, rows: int, keys: int) -> torch.Tensor:
    """What the cut call shows, counting each cell as often as a piece shows it."""
    vis = _visible(cut.main, rows, keys).int()
    for a, b, c, d in cut.sides:
        vis[a:b, c:d] += 1
    return vis


def _docs(lengths: list[int]) -> Varlen:
    cu = tuple(itertools.accumulate([0, *lengths]))
    return Varlen(cu, cu, (-1, 0))


def test_plan_cuts_the_long_document_in_few_heads_only():
    # the bench's 32K lognormal row's longest document (6656) among shorter ones, 4 heads vs all 32 (H100: 264)
    mask = _docs([1200, 6656, 900, 3000, 2048, 1800, 700, 2500, 4096, 1500, 1100, 2400, 1800, 2968])
    rows = mask.cu_q[-1]
    assert long_docs.plan(mask, 32, 264) is None
    cut = long_docs.plan(mask, 4, 264)
    assert cut is not None and cut.sides == ((1200 + 3328, 1200 + 6656, 1200, 1200 + 3328),)
    # the cut shows every visible cell exactly once: nothing lost, nothing twice
    assert torch.equal(_cut_visible(cut, rows, rows), _visible(mask, rows, rows).int())
    # no segment of the varlen call keeps more than half the long document's keys
    assert cut.main.max_k == 4096 and max(b - a for a, b in itertools.pairwise(cut.main.cu_k)) == 4096


def test_plan_leaves_windows_full_segments_and_cpu_alone():
    cu = (0, 8192, 8704)
    assert long_docs.plan(Varlen(cu, cu, (-1, -1)), 1, 264) is None
    assert long_docs.plan(Varlen(cu, cu, (255, 0)), 1, 264) is None
    assert long_docs.plan(Varlen(cu, cu, (-1, 0)), 1, 0) is None
    assert long_docs.slots(torch.device("cpu")) == 0


def test_plan_covers_rectangles_and_gaps():
    # all-gather's pieces: few rows against many keys, a gap segment with keys and no rows, one with rows only
    mask = Varlen((0, 512, 512, 1024, 1100, 1300), (0, 6000, 6500, 8000, 8000, 8400), (-1, 0))
    cut = long_docs.plan(mask, 1, 1000)
    assert cut is not None
    assert (0, 512, 0, 6000 - 512) in cut.sides          # n >= 2m: every row against the fully visible keys
    assert torch.equal(_cut_visible(cut, 1300, 8400), _visible(mask, 1300, 8400).int())


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_cut_call_equals_the_uncut_call(kv_heads):
    torch.manual_seed(0)
    mask = Varlen((0, 300, 300, 700, 1000, 1010, 1400), (0, 300, 700, 1200, 1500, 1600, 1990), (-1, 0))
    cut = long_docs.plan(mask, 4, 10**6)
    assert cut is not None and len(cut.sides) >= 3
    B, S, N, H, D = 2, mask.cu_q[-1], mask.cu_k[-1], 4, 16
    q = torch.randn(B, S, H, D, dtype=torch.float64)
    k, v = (torch.randn(B, N, kv_heads, D, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, S, H, D, dtype=torch.float64)
    scale = D ** -0.5
    o, lse = REF.forward(q, k, v, mask, scale)
    co, clse = long_docs.forward(lambda *a: REF.forward(*a, scale), q, k, v, cut)
    torch.testing.assert_close(co, o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(clse, lse, rtol=1e-12, atol=1e-12)
    g = REF.backward(do, q, k, v, o, lse, mask, scale)
    cg = long_docs.backward(lambda *a: REF.backward(*a, scale), do, q, k, v, o, lse, cut)
    for x, y in zip(cg, g):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_flash_cut_matches_flash_uncut(monkeypatch, kv_heads):
    """FA2 on the GPU: the cut call (side stream, merge, adds) against FA2 uncut, bf16, both against fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    flash = KERNELS["flash"]
    mask = _docs([1200, 6656, 900, 3000, 2048, 1800, 700, 2500, 4096, 1500])
    S, H, D = mask.cu_q[-1], 4, 128
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, S, kv_heads, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    scale = D ** -0.5
    assert long_docs.plan(mask, H, long_docs.slots(q.device)) is not None      # it cuts on its own here
    cut_o, cut_lse = flash.forward(q, k, v, mask, scale)
    cut_g = flash.backward(do, q, k, v, cut_o, cut_lse, mask, scale)
    monkeypatch.setattr(long_docs, "slots", lambda device: 0)
    o, lse = flash.forward(q, k, v, mask, scale)
    g = flash.backward(do, q, k, v, o, lse, mask, scale)
    f32 = [x.float() for x in (q, k, v, do)]
    ro, rlse = REF.forward(*f32[:3], mask, scale)
    rg = REF.backward(f32[3], *f32[:3], ro, rlse, mask, scale)
    torch.testing.assert_close(cut_lse, lse, rtol=0, atol=1e-4)
    for cut_x, x, ref in [(cut_o, o, ro), *zip(cut_g, g, rg)]:
        err_cut, err = (cut_x.float() - ref).abs().max().item(), (x.float() - ref).abs().max().item()
        assert err_cut <= 2 * err + 1e-3, (err_cut, err)
