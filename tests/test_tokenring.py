"""TokenRing (pass-Q) against the dense oracle: out, lse, dq, dk, dv."""

from __future__ import annotations

import pytest
from conftest import assert_all_ok, run_cases

from seqpar.testing import Case, check_case, run_case

M = "tokenring"


def _grid(world: int) -> list[Case]:
    seq = 8 * world
    kw = {"method": M, "seq_len": seq, "heads": 4, "head_dim": 8, "seed": world}
    return [Case(layout="zigzag", causal=True, kv_heads=2, dtype="float32", **kw),
            Case(layout="zigzag", causal=True, kv_heads=4, dtype="bfloat16", **kw),
            Case(layout="zigzag", causal=False, kv_heads=1, dtype="float32", batch=2, **kw),
            Case(layout="zigzag", causal=False, kv_heads=2, dtype="bfloat16", **kw),
            Case(layout="contiguous", causal=True, kv_heads=2, dtype="bfloat16", **kw),
            Case(layout="stripe", causal=True, kv_heads=1, dtype="float32", **kw)]


@pytest.mark.parametrize("world", [1, 3, 4, 5, 6, 2, 8])     # ends with the pools the next test uses
def test_tokenring_matches_oracle(pools, world):
    assert_all_ok(run_cases(pools(world), _grid(world)))


def test_error_growth_with_world_size_is_bounded(pools):
    """Partial outputs travel in the input dtype (bf16 here: the bytes of ALGORITHMS.md §7.1, and what GPU
    kernels return anyway) and merge in fp32, so out gains at most one bf16 rounding of the partials over
    a single step; gradients (dQ partials on an fp32 wire, dK/dV local) do not grow."""
    case = Case(method=M, layout="zigzag", seq_len=64, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16", seed=3)
    (r2,) = run_cases(pools(2), [case])
    (r8,) = run_cases(pools(8), [case])
    assert r2.ok and r8.ok, (r2, r8)
    for f, growth in (("out", 2.0), ("dq", 1.25), ("dk", 1.25), ("dv", 1.25)):
        e2, e8 = r2.verdicts[f].error, r8.verdicts[f].error
        assert e8 <= growth * e2 + 1e-4, f"{f}: error {e8:.2e} at W=8 vs {e2:.2e} at W=2"


def test_tokenring_windows_documents_padding_lse_grad(pools):
    kw = {"method": M, "seq_len": 32, "heads": 4, "kv_heads": 2, "head_dim": 8}
    cases = [Case(layout="zigzag", window=(5, 0), **kw),
             Case(layout="contiguous", window=(6, 0), dtype="bfloat16", **kw),
             Case(layout="contiguous", causal=False, window=(3, 4), **kw),
             Case(layout="zigzag", cu_seqlens=(0, 5, 13, 14, 32), **kw),
             Case(layout="zigzag", causal=False, cu_seqlens=(0, 9, 27), valid_len=27, **kw),
             Case(layout="stripe", valid_len=21, **kw),
             Case(layout="contiguous", valid_len=20, **kw),                 # rank 3 is all padding
             Case(layout="zigzag", lse_grad=True, **kw),
             Case(layout="zigzag", batch=2, dtype="float64", scale=0.4, **kw)]
    assert_all_ok(run_cases(pools(4), cases))


def run_without_delta(case: Case):
    """Worker side: a reference kernel that recomputes Delta from O (as cuDNN and FA2 do), so the bundle
    carries (dO', O') with any lse gradient folded in (Note [Folding the lse gradient])."""
    from seqpar.kernels import KERNELS
    from seqpar.kernels.base import register
    from seqpar.kernels.reference import ReferenceKernel

    class NoDelta(ReferenceKernel):
        name = "reference_nodelta"
        auto_rank = {}
        takes_delta = False

    if NoDelta.name not in KERNELS:
        register(NoDelta())
    return run_case(case)


def test_tokenring_sends_out_when_the_kernel_takes_no_delta(pools):
    cases = [Case(method=M, layout="zigzag", seq_len=32, kernel="reference_nodelta", dtype=dt, kv_heads=kv,
                  lse_grad=lse_grad)
             for dt, kv in (("float32", 2), ("bfloat16", 4)) for lse_grad in (False, True)]
    pool = pools(4)
    assert_all_ok([check_case(c, pool.run(run_without_delta, c)) for c in cases])
