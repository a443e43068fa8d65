"""Long documents cut in few-head varlen calls (Note [Long documents in few heads], ``seqpar.kernels.long_docs``).

The plan is host arithmetic; the composition (the varlen call, the side blocks, the merge and the gradient adds)
runs here with the reference kernel and a forced slot count, against the same kernel uncut, in fp64.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

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


def _alone_visible(alone: long_docs.Alone, rows: int, keys: int) -> torch.Tensor:
    """What the varlen call and the documents alone show, counting each cell as often as a piece shows it."""
    vis = _visible(alone.main, rows, keys).int()
    for a, b, c, d in alone.docs:
        vis[a:b, c:d] += dense(Band(None, (d - c) - (b - a)), b - a, d - c, "cpu").int()
    return vis


def _docs(lengths: list[int]) -> Varlen:
    cu = tuple(itertools.accumulate([0, *lengths]))
    return Varlen(cu, cu, (-1, 0))


def test_plan_takes_the_long_document_out_in_few_heads_only():
    # the bench's 32K lognormal row's longest document (6656) among shorter ones, 4 heads vs all 32 (H100: 264)
    mask = _docs([1200, 6656, 900, 3000, 2048, 1800, 700, 2500, 4096, 1500, 1100, 2400, 1800, 2968])
    rows = mask.cu_q[-1]
    assert long_docs.plan(mask, 32, 264) is None
    alone = long_docs.plan(mask, 4, 264)
    assert alone is not None and alone.docs == ((1200, 7856, 1200, 7856),)
    # every visible cell shown exactly once: nothing lost, nothing twice
    assert torch.equal(_alone_visible(alone, rows, rows), _visible(mask, rows, rows).int())
    segs = zip(itertools.pairwise(alone.main.cu_q), itertools.pairwise(alone.main.cu_k))
    assert max(min(q1 - q0, k1 - k0) for (q0, q1), (k0, k1) in segs) == 4096    # rows with keys: 4096 at most


def test_plan_leaves_windows_full_segments_and_cpu_alone():
    cu = (0, 8192, 8704)
    assert long_docs.plan(Varlen(cu, cu, (-1, -1)), 1, 264) is None
    assert long_docs.plan(Varlen(cu, cu, (255, 0)), 1, 264) is None
    assert long_docs.plan(Varlen(cu, cu, (-1, 0)), 1, 0) is None
    assert long_docs.slots(torch.device("cpu")) == 0


def test_plan_takes_pieces_against_earlier_keys():
    # all-gather's pieces (few rows against many keys) go alone too; gap segments (keys and no rows, rows and no
    # keys) and a segment with more rows than keys stay
    mask = Varlen((0, 512, 512, 1024, 1100, 1400, 1900), (0, 6000, 6500, 8000, 8000, 8300, 8600), (-1, 0))
    alone = long_docs.plan(mask, 1, 1000)
    assert alone is not None and alone.docs == ((0, 512, 0, 6000), (512, 1024, 6500, 8000), (1100, 1400, 8000, 8300))
    assert torch.equal(_alone_visible(alone, 1900, 8600), _visible(mask, 1900, 8600).int())


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_documents_alone_equal_one_call(kv_heads):
    torch.manual_seed(0)
    mask = Varlen((0, 300, 300, 700, 1000, 1010, 1400, 1700), (0, 300, 700, 1100, 1400, 1500, 1890, 2090), (-1, 0))
    alone = long_docs.plan(mask, 4, 10**6)
    assert alone is not None and len(alone.docs) == 4    # not the gap, the 10-row piece's 100 keys, 300 rows on 200
    B, S, N, H, D = 2, mask.cu_q[-1], mask.cu_k[-1], 4, 16
    q = torch.randn(B, S, H, D, dtype=torch.float64)
    k, v = (torch.randn(B, N, kv_heads, D, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, S, H, D, dtype=torch.float64)
    scale = D ** -0.5
    fwd = lambda *a: REF.forward(*a, scale)                     # noqa: E731
    bwd = lambda *a: REF.backward(*a, scale)                    # noqa: E731
    o, lse = REF.forward(q, k, v, mask, scale)
    ao, alse = long_docs.forward(fwd, fwd, q, k, v, alone)
    torch.testing.assert_close(ao, o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alse, lse, rtol=1e-12, atol=1e-12)
    g = REF.backward(do, q, k, v, o, lse, mask, scale)
    for x, y in zip(long_docs.backward(bwd, bwd, do, q, k, v, o, lse, alone), g):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


def test_buckets_round_up_by_at_most_an_eighth():
    assert [long_docs.bucket(n) for n in (256, 300, 2048, 2049, 6656, 6700, 8192, 100_000)] == \
        [256, 384, 2048, 2304, 6656, 7168, 8192, 106_496]
    for n in range(256, 70_000, 37):
        b = long_docs.bucket(n)
        assert n <= b <= n + max(long_docs.TILE_ROWS, n // 8) and b % long_docs.TILE_ROWS == 0
    assert len({long_docs.bucket(n) for n in range(4097, 8193)}) == 8             # 8 an octave


def test_plan_squares_only():
    mask = Varlen((0, 512, 512, 1024, 1100, 1400), (0, 6000, 6500, 8000, 8000, 8300), (-1, 0))
    alone = long_docs.plan(mask, 1, 1000, True)
    assert alone is not None and alone.docs == ((1100, 1400, 8000, 8300),)


@pytest.mark.parametrize("m", [300, 384, 1000])
def test_padded_document_equals_the_document(m):
    torch.manual_seed(m)
    q, do = torch.randn(2, m, 4, 16, dtype=torch.float64), torch.randn(2, m, 4, 16, dtype=torch.float64)
    k, v = (torch.randn(2, m, 2, 16, dtype=torch.float64) for _ in range(2))
    fwd = lambda *a: REF.forward(*a, 0.25)                      # noqa: E731
    bwd = lambda *a: REF.backward(*a, 0.25)                     # noqa: E731
    seen = []
    o, lse = REF.forward(q, k, v, Band(None, 0), 0.25)
    po, plse = long_docs.padded_forward(lambda *a: seen.append(a[0].shape[1]) or fwd(*a), q, k, v)
    assert seen == [long_docs.bucket(m)]
    torch.testing.assert_close(po, o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plse, lse, rtol=1e-12, atol=1e-12)
    g = REF.backward(do, q, k, v, o, lse, Band(None, 0), 0.25)
    for x, y in zip(long_docs.padded_backward(bwd, do, q, k, v, o, lse), g):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


def test_flash_variants_by_call():
    """Under auto the long documents may go to cuDNN (exact shapes where they recur, buckets where they vary);
    named "flash", the call stays on FA2."""
    from seqpar.kernels.base import KernelCall, select

    call = KernelCall("cuda", torch.bfloat16, 128, 4, 1, "varlen", arch=90)
    flash = KERNELS["flash"]
    assert flash.for_call(call).beside == "cudnn"
    assert flash.for_call(replace(call, shapes_vary=True)).beside == "cudnn-buckets"
    assert flash.for_call(call, named=True) is flash and flash.beside == "flash"
    assert select("flash", call) is flash                     # selection never touches the device
    assert select("auto", call).beside == "cudnn" and select("sdpa", call).beside == "cudnn"


def test_flash_takes_out_what_its_side_kernel_may_run(monkeypatch):
    """FA2 (named, or where cuDNN does not serve) and cuDNN in buckets take square documents only; cuDNN by exact
    shape takes pieces with earlier keys too; a call with nothing long, or not varlen, takes nothing out."""
    from seqpar.kernels import sdpa
    from seqpar.kernels.base import KernelCall

    monkeypatch.setattr(long_docs, "slots", lambda device: 1000)
    mask = Varlen((0, 512, 512, 1024, 1100, 1400), (0, 6000, 6500, 8000, 8000, 8300), (-1, 0))
    q, k = torch.zeros(1, 1400, 1, 8), torch.zeros(1, 8300, 1, 8)
    flash, call = KERNELS["flash"], KernelCall("cuda", torch.bfloat16, 8, 1, 1, "varlen", arch=90)
    square = ((1100, 1400, 8000, 8300),)
    assert (lambda a, side: (a.docs, side))(*flash._alone(mask, q, k, False)) == (square, "flash")
    assert flash.for_call(call)._alone(mask, q, k, False)[1] == "flash"        # CPU tensors: cuDNN does not serve
    monkeypatch.setattr(sdpa, "_serves", lambda kernel, call: True)
    alone, side = flash.for_call(call)._alone(mask, q, k, False)
    assert side == "cudnn" and len(alone.docs) == 3
    alone, side = flash.for_call(replace(call, shapes_vary=True))._alone(mask, q, k, False)
    assert side == "cudnn-buckets" and alone.docs == square
    assert flash._alone(Band(None, 0), q, k, False) == (None, "flash")
    monkeypatch.setattr(long_docs, "slots", lambda device: 1)
    assert flash.for_call(call)._alone(mask, q, k, False) == (None, "flash")


_PIECES = [1200, 6656, 900, 3000]
"""All-gather's rank under ``balanced``: the last eighth of each document against all of its keys."""


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["docs-4-heads-kv1", "docs-4-heads-kv4", "pieces-32-heads-kv8"])
def test_flash_with_documents_alone_matches_one_call(monkeypatch, case):
    """FA2 on the GPU: the long document (or piece) alone on a second stream - on cuDNN by exact shape, on cuDNN
    in buckets (pieces stay in the call), on FA2 (named), on FA2 for a deterministic backward - against FA2 in one
    call, bf16, all against fp32; and the plan takes it out on its own here."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    flash = KERNELS["flash"]
    if case.startswith("docs"):       # the long document off its bucket (6700 -> 7168): padded under buckets
        mask, H, kv_heads = _docs([1200, 6700, 900, 3000, 2048, 1800, 700, 2500, 4096, 1500]), 4, int(case[-1])
    else:
        cu_q = tuple(itertools.accumulate([0, *(n // 8 for n in _PIECES)]))
        mask, H, kv_heads = Varlen(cu_q, tuple(itertools.accumulate([0, *_PIECES])), (-1, 0)), 32, 8
    S, N, D = mask.cu_q[-1], mask.cu_k[-1], 128
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, N, kv_heads, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    scale = D ** -0.5
    from seqpar.kernels.base import KernelCall

    call = KernelCall.of(q, k, mask)
    assert long_docs.plan(mask, H, long_docs.slots(q.device), case.startswith("docs")) is not None
    results = []
    for kern, deterministic in [(flash.for_call(call), False), (flash.for_call(replace(call, shapes_vary=True)),
                                                                 False), (flash, False), (flash.for_call(call), True)]:
        a_o, a_lse = kern.forward(q, k, v, mask, scale)        # cuDNN exact, cuDNN in buckets, FA2, FA2 (bwd)
        results.append((a_o, a_lse, kern.backward(do, q, k, v, a_o, a_lse, mask, scale,
                                                  deterministic=deterministic)))
    monkeypatch.setattr(long_docs, "slots", lambda device: 0)
    o, lse = flash.forward(q, k, v, mask, scale)
    g = flash.backward(do, q, k, v, o, lse, mask, scale)
    f32 = [x.float() for x in (q, k, v, do)]
    ro, rlse = REF.forward(*f32[:3], mask, scale)
    rg = REF.backward(f32[3], *f32[:3], ro, rlse, mask, scale)
    for a_o, a_lse, a_g in results:
        torch.testing.assert_close(a_lse, lse, rtol=0, atol=2e-2)
        for a_x, x, ref in [(a_o, o, ro), *zip(a_g, g, rg)]:
            err_a, err = (a_x.float() - ref).abs().max().item(), (x.float() - ref).abs().max().item()
            assert err_a <= 2 * err + 1e-3, (err_a, err)
