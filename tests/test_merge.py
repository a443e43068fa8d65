"""MERGE on its own: exactness, -inf rows, no overflow, in-place row slices."""

import pytest
import torch

from seqpar.kernels import Accumulator, attention_reference, merge_
from seqpar.masks import Band


def test_merge_of_disjoint_key_sets_equals_whole():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    whole = attention_reference(q, k, v, Band())
    a = attention_reference(q, k[:, :4], v[:, :4], Band())
    b = attention_reference(q, k[:, 4:], v[:, 4:], Band())
    out, lse = a.out.clone(), a.lse.clone()
    merge_(out, lse, b.out, b.lse)
    torch.testing.assert_close(out, whole.out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, whole.lse, rtol=1e-6, atol=1e-6)


def test_fully_masked_rows_give_zeros_not_nan():
    out = torch.zeros(1, 3, 2, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    blk = torch.randn(1, 3, 2, 4)
    blk_lse = torch.tensor([[[float("-inf"), 0.5, float("-inf")], [float("-inf")] * 3]])
    merge_(out, lse, torch.where(torch.isfinite(blk_lse).transpose(1, 2).unsqueeze(-1), blk, 0.0), blk_lse)
    assert torch.isfinite(out).all()
    assert torch.isneginf(lse[0, 1]).all() and torch.isneginf(lse[0, 0, [0, 2]]).all()
    assert out[0, 0].abs().sum() == 0 and out[0, 2].abs().sum() == 0
    torch.testing.assert_close(out[0, 1, 0], blk[0, 1, 0])


def test_merge_does_not_overflow_on_large_lse():
    """The naive lse + log(1 + exp(d)) overflowed in a peer and zeroed predictions (EasyContext#14)."""
    out = torch.ones(1, 2, 1, 1)
    lse = torch.tensor([[[1000.0, -1000.0]]])
    merge_(out, lse, torch.full((1, 2, 1, 1), 3.0), torch.tensor([[[1000.0, 1000.0]]]))
    torch.testing.assert_close(lse, torch.tensor([[[1000.0 + torch.log(torch.tensor(2.0)).item(), 1000.0]]]))
    torch.testing.assert_close(out.flatten(), torch.tensor([2.0, 3.0]), rtol=1e-4, atol=0)  # fp32 ulp at 1000


def test_merge_into_a_row_slice_in_place():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4)
    acc = Accumulator(q)
    acc.add(slice(0, 6), *attention_reference(q, k[:, :3], v[:, :3], Band()))
    acc.add(slice(3, 6), *attention_reference(q[:, 3:], k[:, 3:], v[:, 3:], Band()))
    out, lse = acc.result(torch.float32)
    want_front = attention_reference(q[:, :3], k[:, :3], v[:, :3], Band())
    want_back = attention_reference(q[:, 3:], k, v, Band())
    torch.testing.assert_close(out[:, :3], want_front.out)
    torch.testing.assert_close(out[:, 3:], want_back.out)
    torch.testing.assert_close(lse[:, :, 3:], want_back.lse)


def test_accumulator_with_no_partial_is_zero_and_neg_inf():
    out, lse = Accumulator(torch.zeros(1, 2, 1, 3, dtype=torch.bfloat16)).result(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and (out == 0).all() and torch.isneginf(lse).all()


# ------------------------------------------------------------------ one merge per call (seqpar.kernels.combine)

def _partials(B=2, S=12, H=3, D=8, dtype=torch.float32, device="cpu"):
    """Partials over several row ranges (a zigzag rank's: all rows, the back half), one row seen by no key."""
    g = torch.Generator().manual_seed(0)
    parts = []
    for rows in (slice(0, S), slice(S // 2, S), slice(S // 2, S), slice(0, S), slice(3, 9)):
        n = rows.stop - rows.start
        o = torch.randn(B, n, H, D, generator=g)
        lse = torch.randn(B, H, n, generator=g) * 3
        if rows.start == 0:
            lse[0, 0, 0], o[0, 0, 0] = float("-inf"), 0.0
        parts.append((rows, o.to(device=device, dtype=dtype), lse.to(device)))
    return parts


def _merged(parts, shape, defer, dtype=torch.float32):
    acc = Accumulator(torch.empty(shape, device=parts[0][1].device), defer=defer)
    for rows, o, lse in parts:
        acc.add(rows, o.clone(), lse.clone())          # the step-by-step merge adopts (and writes) its first part
    return acc.result(dtype)


@pytest.mark.parametrize("budget", [1 << 30, 1])
def test_deferred_merge_equals_step_by_step(monkeypatch, budget):
    """Holding partials and merging them in one pass gives the step-by-step merge's result; a budget too small
    to hold two partials folds them into the fp32 accumulator as they come, with the same result."""
    from seqpar.kernels import merge

    monkeypatch.setattr(merge, "DEFER_BYTES", budget)
    shape = (2, 12, 3, 8)
    parts = _partials()
    ref_out, ref_lse = _merged(parts, shape, defer=False)
    out, lse = _merged(parts, shape, defer=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.isneginf(lse[0, 0, 0]) and out[0, 0, 0].abs().sum() == 0


def test_deferred_merge_rows_nobody_saw_and_a_single_part():
    """Rows no partial covers are (0, -inf); one partial covering every row is returned as it is."""
    o, lse = torch.randn(1, 3, 2, 4), torch.randn(1, 2, 3)
    acc = Accumulator(torch.empty(1, 6, 2, 4), defer=True)
    acc.add(slice(2, 5), o, lse)
    out, l = acc.result(torch.float32)
    assert out[:, :2].abs().sum() == 0 and out[:, 5:].abs().sum() == 0
    assert torch.isneginf(l[:, :, :2]).all() and torch.isneginf(l[:, :, 5:]).all()
    torch.testing.assert_close(out[:, 2:5], o)
    whole = Accumulator(torch.empty(1, 3, 2, 4), defer=True)
    whole.add(slice(0, 3), o, lse)
    assert whole.result(torch.float32)[0] is o
    with pytest.raises(ValueError, match="cannot be owned"):
        Accumulator(o, defer=True).owned()


def test_row_sum_in_one_pass(monkeypatch):
    """RowSum: the sum of row-range partials (a ring's dQ), fp32 inside, rows nobody wrote are 0; a small
    budget folds as it goes with the same result."""
    from seqpar.kernels import merge

    g = torch.Generator().manual_seed(1)
    parts = [(slice(0, 8), torch.randn(1, 8, 2, 4, generator=g)), (slice(4, 8), torch.randn(1, 4, 2, 4, generator=g)),
             (slice(2, 6), torch.randn(1, 4, 2, 4, generator=g))]
    ref = torch.zeros(1, 10, 2, 4)
    for rows, x in parts:
        ref[:, rows] += x
    for budget in (1 << 30, 1):
        monkeypatch.setattr(merge, "DEFER_BYTES", budget)
        s = merge.RowSum((1, 10, 2, 4), torch.float32, torch.device("cpu"))
        for rows, x in parts:
            s.add(rows, x)
        torch.testing.assert_close(s.result(torch.float32), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_merge_and_sum_equal_the_torch_pass(dtype):
    """The Triton pass (CUDA) against the same arithmetic in torch on the same partials, strided ones included,
    and the fold of an fp32 accumulator with partials of another dtype."""
    from seqpar.kernels import combine

    shape = (2, 96, 3, 128)
    parts = _partials(*shape, dtype=dtype, device="cuda")
    parts[1] = (parts[1][0], parts[1][1].transpose(1, 2).contiguous().transpose(1, 2), parts[1][2])   # BHSD strides
    out, lse = combine.merge_parts(parts, shape, dtype)
    ref_out, ref_lse = combine.merge_parts([(r, o.cpu().float(), l.cpu()) for r, o, l in parts], shape, torch.float32)
    torch.testing.assert_close(out.float().cpu(), ref_out.to(dtype).float(), rtol=2e-2 if dtype != torch.float32 else
                               1e-5, atol=1e-2 if dtype != torch.float32 else 1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    folded = [(slice(0, shape[1]), out.float(), lse), *parts[1:]]
    f_out, _ = combine.merge_parts(folded, shape, torch.float32)
    f_ref, _ = combine.merge_parts([(r, o.cpu().float(), l.cpu()) for r, o, l in folded], shape, torch.float32)
    torch.testing.assert_close(f_out.cpu(), f_ref, rtol=1e-4, atol=1e-4)
    s = combine.sum_parts([(r, o) for r, o, _ in parts], shape, torch.float32)
    s_ref = combine.sum_parts([(r, o.cpu().float()) for r, o, _ in parts], shape, torch.float32)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-5, atol=1e-5)
