"""Note [FA2's capped windows] (``seqpar.kernels.sdpa``): FA2 clamps a window side to the key length, so a trimmed band
with more query rows than keys + 1 and a far right side is not the window it asks for; such a band runs as row
ranges FA2 does hold.

On CPU, FA2's clamping is simulated from flash_api.cpp: every trimmed band on small blocks either is exact as one
window or its pieces are - disjoint rows, each an exact window, together the band. On a GPU (``-m gpu``), FA2 on the
bands that were wrong (a windowed span's image rows against the tokens before it) matches the reference kernel.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from seqpar.kernels.sdpa import fa2_pieces
from seqpar.masks import Band, bottom_right_window, fa2_exact


def band_mask(band: Band, m: int, n: int) -> torch.Tensor:
    i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
    lo = torch.full_like(j - i, -(1 << 30)) if band.lo is None else torch.full_like(j - i, band.lo)
    hi = torch.full_like(j - i, 1 << 30) if band.hi is None else torch.full_like(j - i, band.hi)
    return (lo <= j - i) & (j - i <= hi)


def fa2_mask(band: Band, m: int, n: int) -> torch.Tensor:
    """What FA2 computes for ``band``'s bottom-right window on an m x n block, clamped as flash_api.cpp clamps it
    (``mha_fwd`` then ``set_params_fprop``; the kernel's ``col_idx_limit_left/right``)."""
    left, right = bottom_right_window(band, m, n)
    if left >= n:
        left = -1
    if right >= n:
        right = -1
    i, j = torch.arange(m)[:, None], torch.arange(n)[None, :]
    if left < 0 and right < 0:
        return torch.ones(m, n, dtype=torch.bool)
    left = n if left < 0 else left
    right = n if right < 0 else right
    s = n - m
    return (i + s - left <= j) & (j <= i + s + right)


def trimmed_bands(m: int, n: int):
    """Every band on an m x n block that the block planner could hand a kernel (``lo <= n - m <= hi``, every row and
    key seen), sides up to a little past the block."""
    s = n - m
    for lo, hi in itertools.product([None, *range(-m - 1, s + 1)], [None, *range(s, n + 2)]):
        band = Band(lo, hi)
        vis = band_mask(band, m, n)
        if bool(vis.any(1).all()) and bool(vis.any(0).all()):
            yield band


@pytest.mark.parametrize("m, n", [(1, 1), (3, 7), (7, 3), (9, 4), (12, 3), (5, 5), (6, 4), (16, 2), (11, 1)])
def test_every_trimmed_band_is_one_exact_window_or_exact_pieces(m, n):
    checked = pieces_seen = 0
    for band in trimmed_bands(m, n):
        want = band_mask(band, m, n)
        assert fa2_exact(band, m, n) == bool(torch.equal(fa2_mask(band, m, n), want)), band
        pieces = fa2_pieces(band, m, n)
        if pieces is None:
            continue
        pieces_seen += 1
        got = torch.zeros(m, n, dtype=torch.bool)
        rows = torch.zeros(m, dtype=torch.long)
        for r0, r1, k0, k1, b in pieces:
            assert fa2_exact(b, r1 - r0, k1 - k0), (band, b)
            got[r0:r1, k0:k1] |= fa2_mask(b, r1 - r0, k1 - k0)
            rows[r0:r1] += 1
        assert torch.equal(got, want), (band, pieces)
        assert int(rows.max()) == 1 and len(pieces) <= 3, (band, pieces)
        checked += 1
    assert checked == pieces_seen and (m <= n + 1 or pieces_seen > 0)


def test_the_window_that_was_wrong_on_an_h100():
    """Rows 10-110 of a 100-token window against the 10 tokens before an image (``spans(..., window=100)``):
    FA2 saw keys [i - 90, i - 80] from row i, the band every key from rows 0-90."""
    band, m, n = Band(-90, None), 100, 10
    assert not fa2_exact(band, m, n) and not torch.equal(fa2_mask(band, m, n), band_mask(band, m, n))
    assert fa2_pieces(band, m, n) == ((0, 91, 0, 10, Band()), (91, 100, 1, 10, Band(0, None)))


@pytest.mark.parametrize("m, n, band", [(100, 10, Band(-90, None)), (64, 16, Band(None, 0)), (100, 10, Band(-95, 5))])
def test_row_ranges_assemble_the_block(m, n, band):
    """``pieces_forward`` / ``pieces_backward`` (FA2's path for such bands) with the reference kernel on each range:
    out, lse, dq, dk and dv of the whole block, fp64, in the inputs' dtype."""
    from seqpar.kernels import KERNELS
    from seqpar.kernels.sdpa import pieces_backward, pieces_forward

    ref, pieces = KERNELS["reference"], fa2_pieces(band, m, n)
    g = torch.Generator().manual_seed(m + n)
    q, do = (torch.randn(1, m, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    o, lse = ref.forward(q, k, v, band, 0.3)
    got = pieces_forward(lambda *a: ref.forward(*a, 0.3), q, k, v, pieces)
    grads = pieces_backward(lambda *a: ref.backward(*a, 0.3), do, q, k, v, o, lse, pieces)
    for x, y in zip((*got, *grads), (o, lse, *ref.backward(do, q, k, v, o, lse, band, 0.3))):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def test_varlen_groups_leave_clamped_windows_alone():
    """A varlen call holds one window for all its documents, so a task FA2 would clamp stays a call of its own (and
    runs as row ranges); the others still pack."""
    from seqpar.layouts.blocks import Task, group_varlen
    from seqpar.masks import Varlen

    clamped = Task(0, 100, 0, 10, Band(-90, None))
    tasks = (clamped, Task(100, 110, 10, 20, Band(None, 0)), Task(110, 120, 20, 30, Band(None, 0)))
    out = group_varlen(tasks)
    assert clamped in out and sum(isinstance(t.mask, Varlen) for t in out) == 1 and len(out) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["flash", "flash_attn"])
@pytest.mark.parametrize("m, n, band", [(100, 10, Band(-90, None)), (100, 200, Band(0, None)), (64, 16, Band(None, 0)),
                                        (100, 10, Band(-95, 5)), (400, 500, Band(0, 100))])
def test_fa2_matches_the_reference_on_clamped_windows(kernel, m, n, band):
    """PyTorch's FA2 and flash-attn's (where installed: the peers' stand-in routes it to PyTorch's FA2)."""
    from seqpar.kernels import KERNELS, KernelCall

    fa2, ref = KERNELS[kernel], KERNELS["reference"]
    why = fa2.not_supported_reasons(KernelCall("cuda", torch.bfloat16, 64, 8, 2, "band"))
    if why:
        pytest.skip("; ".join(why))
    g = torch.Generator(device="cuda").manual_seed(m + n)
    q, do = (torch.randn(1, m, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, n, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    o, lse = fa2.forward(q, k, v, band, 0.125)
    o64, lse64 = ref.forward(q.double(), k.double(), v.double(), band, 0.125)
    torch.testing.assert_close(o.double(), o64, atol=2e-2, rtol=0)
    torch.testing.assert_close(lse.double(), lse64, atol=1e-3, rtol=0)
    got = fa2.backward(do, q, k, v, o, lse, band, 0.125)
    want = ref.backward(do.double(), q.double(), k.double(), v.double(), o64, lse64, band, 0.125)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, atol=6e-2, rtol=0)
