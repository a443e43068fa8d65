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
    the fold of an fp32 accumulator with partials of another dtype, and a sum into a strided view."""
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
    # into half of a (S, B, H, 2D) fp32 buffer seen as (B, S, H, D), as all-gather sums dK (Note [Overlapping
    # calls in one pass]); the other half untouched
    buf = torch.full((shape[1], shape[0], shape[2], 2 * shape[3]), 7.0, device="cuda")
    into = buf[..., :shape[3]].transpose(0, 1)
    combine.sum_parts([(r, o) for r, o, _ in parts], shape, torch.float32, out=into)
    torch.testing.assert_close(into.cpu(), s_ref, rtol=1e-5, atol=1e-5)
    assert bool((buf[..., shape[3]:] == 7.0).all())


# ------------------------------------------------------------------ covered rows (Note [Covered rows])

def _gappy(S=40, B=1, H=2, D=4, dtype=torch.float32, device="cpu"):
    """Partials whose rows outside their covered ranges are (0, -inf), as a varlen call's gap rows are."""
    g = torch.Generator().manual_seed(3)
    spec = [(slice(0, S), None), (slice(5, 37), ((0, 4), (10, 20))), (slice(2, 30), ((3, 28),)),
            (slice(8, 40), ((0, 32),)), (slice(20, 24), ())]
    parts = []
    for rows, covered in spec:
        n = rows.stop - rows.start
        o, lse = torch.randn(B, n, H, D, generator=g), torch.randn(B, H, n, generator=g) * 3
        keep = torch.zeros(n, dtype=torch.bool)
        for a, b in (covered if covered is not None else ((0, n),)):
            keep[a:b] = True
        o[:, ~keep], lse[:, :, ~keep] = 0.0, float("-inf")
        parts.append((rows, o.to(device=device, dtype=dtype), lse.to(device), covered))
    return parts


def test_covered_rows_give_the_same_merge_and_sum(monkeypatch):
    """A merge or a sum that reads only each partial's covered rows equals one that reads every row, deferred
    or folded (the fold's accumulator keeps the union of what it merged); a part covering nothing is skipped."""
    from seqpar.kernels import combine, merge

    shape = (1, 40, 2, 4)
    parts = _gappy()
    ref_out, ref_lse = combine.merge_parts([p[:3] for p in parts], shape, torch.float32)
    out, lse = combine.merge_parts(parts, shape, torch.float32)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    ref_sum = combine.sum_parts([(r, o) for r, o, _, _ in parts], shape, torch.float32)
    torch.testing.assert_close(combine.sum_parts([(r, o, c) for r, o, _, c in parts], shape, torch.float32), ref_sum)
    for budget in (1 << 30, 1):
        monkeypatch.setattr(merge, "DEFER_BYTES", budget)
        acc = Accumulator(torch.empty(shape), defer=True)
        rs = merge.RowSum(shape, torch.float32, torch.device("cpu"))
        for rows, o, lse_, covered in parts[1:]:
            acc.add(rows, o, lse_, covered)
            rs.add(rows, o, covered)
        sub_out, sub_lse = combine.merge_parts([p[:3] for p in parts[1:]], shape, torch.float32)
        a_out, a_lse = acc.result(torch.float32)
        torch.testing.assert_close(a_out, sub_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a_lse, sub_lse, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rs.result(torch.float32),
                                   combine.sum_parts([(r, o) for r, o, _, _ in parts[1:]], shape, torch.float32))
    assert combine.union(parts[1:], 40) == ((5, 40),)
    assert combine.union(parts[:1], 40) is None


def test_task_covered_names_the_rows_with_keys():
    """A grouped varlen call's covered rows are its segments with keys; a call without gaps covers every row."""
    from seqpar.layouts.blocks import Task, group_varlen
    from seqpar.masks.forms import Band

    tasks = (Task(0, 4, 0, 4, Band(None, 0)), Task(10, 12, 6, 8, Band(None, 0)), Task(12, 15, 8, 11, Band(None, 0)))
    (grouped,) = group_varlen(tasks)
    assert (grouped.q_start, grouped.q_stop) == (0, 15)
    assert grouped.covered == ((0, 4), (10, 15))
    assert tasks[0].covered is None
    (whole,) = group_varlen((Task(0, 4, 0, 4, Band(None, 0)), Task(4, 6, 4, 6, Band(None, 0))))
    assert whole.covered is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_pass_reads_covered_rows_only(dtype):
    """The one-launch Triton pass over covered spans (block lists, spans starting mid-block, a part covering
    nothing, an fp32 accumulator beside bf16 partials) equals the torch pass over every row; its rows outside
    every span are (0, -inf), and garbage outside a part's spans is never read."""
    from seqpar.kernels import combine

    S, shape = 200, (2, 200, 3, 128)
    parts = _gappy(S=S, B=2, H=3, D=128, dtype=dtype, device="cuda")
    ref_out, ref_lse = combine.merge_parts([(r, o.cpu().float(), l.cpu()) for r, o, l, _ in parts], shape,
                                           torch.float32)
    poisoned = []
    for rows, o, lse, covered in parts:
        o, lse = o.clone(), lse.clone()
        if covered is not None:
            keep = torch.zeros(o.shape[1], dtype=torch.bool, device="cuda")
            for a, b in covered:
                keep[a:b] = True
            o[:, ~keep], lse[:, :, ~keep] = float("nan"), float("nan")     # never read
        poisoned.append((rows, o, lse, covered))
    out, lse = combine.merge_parts(poisoned, shape, dtype)
    tol = {"rtol": 2e-2, "atol": 1e-2} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out.float().cpu(), ref_out.to(dtype).float(), **tol)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=1e-5, atol=1e-5)
    folded = [(slice(0, S), out.float(), lse, combine.union(parts, S)), *poisoned[1:]]
    f_out, _ = combine.merge_parts(folded, shape, torch.float32)
    f_ref, _ = combine.merge_parts([(r, o.cpu().float(), l.cpu()) for r, o, l, _ in
                                    [(slice(0, S), out.float(), lse, None), *parts[1:]]], shape, torch.float32)
    torch.testing.assert_close(f_out.cpu(), f_ref, rtol=1e-4, atol=1e-4)
    s = combine.sum_parts([(r, o, c) for r, o, _, c in poisoned], shape, torch.float32)
    s_ref = combine.sum_parts([(r, o.cpu().float()) for r, o, _, _ in parts], shape, torch.float32)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-5, atol=1e-5)


def test_sum_into_a_buffer():
    """``sum_parts(out=)`` writes the sum into a strided view (a wire buffer's rows) and zeroes it when no part
    covers anything (a step without tasks)."""
    from seqpar.kernels import combine

    buf = torch.full((10, 1, 2, 4), 7.0)                           # seq-major, as a wire buffer
    view = buf[2:8].permute(1, 0, 2, 3)                             # rows 2..8 as (B, S, H, D)
    x = torch.randn(1, 3, 2, 4)
    combine.sum_parts([(slice(1, 4), x)], tuple(view.shape), torch.float32, out=view)
    torch.testing.assert_close(view[:, 1:4], x)
    assert view[:, :1].abs().sum() == 0 and view[:, 4:].abs().sum() == 0 and (buf[:2] == 7).all()
    combine.sum_parts([], tuple(view.shape), torch.float32, out=view)
    assert view.abs().sum() == 0 and (buf[8:] == 7).all()
