"""MERGE on its own: exactness, -inf rows, no overflow, in-place row slices."""

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
