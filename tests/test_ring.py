"""Ring attention (pass-KV) against the dense oracle: out, lse, dq, dk, dv."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_all_ok, run_cases

from seqpar.testing import Case

LAYOUTS = ["contiguous", "zigzag", "stripe"]


def _grid(world: int, layout: str) -> list[Case]:
    seq = 8 * world if world < 8 else 32
    cases = []
    for causal, kv, dtype in itertools.product([True, False], [4, 2, 1], ["float32", "bfloat16"]):
        cases.append(Case(layout=layout, causal=causal, seq_len=seq, heads=4, kv_heads=kv, head_dim=8,
                          dtype=dtype, seed=world * 7 + kv))
    cases.append(Case(layout=layout, seq_len=seq, batch=2, heads=2, kv_heads=1, head_dim=16, dtype="float64"))
    cases.append(Case(layout=layout, seq_len=seq, heads=2, kv_heads=2, head_dim=8, dtype="float16", scale=0.3))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_matches_oracle(pools, world, layout):
    assert_all_ok(run_cases(pools(world), _grid(world, layout)))


def test_ring_head_dim_256_and_lse_gradient(pools):
    cases = [Case(layout="zigzag", seq_len=8, heads=2, kv_heads=1, head_dim=256),
             Case(layout="stripe", seq_len=16, heads=4, kv_heads=2, lse_grad=True),
             Case(layout="contiguous", causal=False, seq_len=16, lse_grad=True, dtype="float64")]
    assert_all_ok(run_cases(pools(2), cases))


@pytest.mark.parametrize("short", [False, True], ids=["running-sums", "partials-home"])
def test_both_dkv_paths_match_oracle(pools, short):
    """The pass-KV backward's two dK/dV paths (Note [Partials home] in ``seqpar.methods._passkv``), each forced on
    through ``HOME_BYTES``: causal and not, every layout, windows, documents, padding, GQA, bf16, the lse gradient,
    a head dim of its own for V, USP's ring, and a ring truncated by its window."""
    from _workers_ulysses import run_case_short_paths

    from seqpar.testing import check_case

    kw = {"heads": 4, "kv_heads": 2, "head_dim": 8}
    cases = [Case(layout=lay, causal=causal, seq_len=32, dtype=dt, **kw)
             for lay in LAYOUTS for causal in (True, False) for dt in ("float32", "bfloat16")]
    cases += [Case(layout="zigzag", seq_len=48, window=(5, 0), **kw),
              Case(layout="contiguous", seq_len=48, window=(3, 0), **kw),               # ends before the ring does
              Case(layout="zigzag", seq_len=48, cu_seqlens=(0, 7, 30, 31, 48), **kw),
              Case(layout="zigzag", causal=False, seq_len=48, cu_seqlens=(0, 17, 41), valid_len=41, **kw),
              Case(layout="stripe", seq_len=32, lse_grad=True, dtype="float64", **kw),
              Case(layout="zigzag", seq_len=32, heads=4, kv_heads=1, head_dim=16, value_dim=8),
              Case(method="usp", layout="zigzag", seq_len=32, ulysses=2, **kw)]
    pool = pools(4)
    assert_all_ok([check_case(c, pool.run(run_case_short_paths, short, c)) for c in cases])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_error_does_not_grow_with_world_size(pools, layout):
    """bf16 error at 8 ranks is no worse than at 2 (block partials are merged in fp32)."""
    case = Case(layout=layout, seq_len=64, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16", seed=3)
    (r2,) = run_cases(pools(2), [case])
    (r8,) = run_cases(pools(8), [case])
    for f in ("out", "dq", "dk", "dv"):
        e2, e8 = r2.verdicts[f].error, r8.verdicts[f].error
        assert e8 <= 1.25 * e2 + 1e-4, f"{f}: error {e8:.2e} at W=8 vs {e2:.2e} at W=2"


def test_head_chunks_bound_memory_and_match(pools):
    """``head_chunks`` runs the ring per KV-head group; results are the same function."""
    grid = (("zigzag", 2, False), ("stripe", 4, True), ("contiguous", 4, False))
    cases = [Case(layout=lay, seq_len=32, heads=8, kv_heads=4, head_dim=8, options=(("head_chunks", c),),
                  lse_grad=lse) for lay, c, lse in grid]
    assert_all_ok(run_cases(pools(4), cases))


def test_partials_home_is_decided_by_bytes():
    """Note [Partials home]: the partials go home while W of them, each element the wider of the inputs' and the
    wire's dtype, fit ``HOME_BYTES`` - MHA (32 heads of 128) in bf16 over 8 ranks with an fp32 wire keeps exactly
    the old 8192 local rows, GQA 8 goes home at 16K (the packed rows), a bf16 wire doubles the rows."""
    from seqpar.methods._passkv import partials_home

    def kv(rows, heads):
        return (torch.empty(1, rows, heads, 128, dtype=torch.bfloat16, device="meta") for _ in range(2))

    assert partials_home(*kv(8192, 32), 8, torch.float32) and not partials_home(*kv(8193, 32), 8, torch.float32)
    assert partials_home(*kv(16384, 8), 8, torch.float32) and not partials_home(*kv(32769, 8), 8, torch.float32)
    assert partials_home(*kv(16384, 32), 8, torch.bfloat16) and not partials_home(*kv(16385, 32), 8, torch.bfloat16)
    # the cost model decides alike (seqpar.cost.model.partials_home mirrors the rule: cost imports no method)
    from seqpar.cost import model

    for rows, heads, wire in ((8192, 32, 4), (8193, 32, 4), (32769, 8, 4), (16385, 32, 2), (16384, 32, 2)):
        p = model.Problem(seq_len=rows * 8, heads=heads, kv_heads=heads, head_dim=128, world=8, grad_bytes=wire)
        assert model.partials_home(p, rows, heads, 8) == partials_home(
            *kv(rows, heads), 8, torch.float32 if wire == 4 else torch.bfloat16), (rows, heads, wire)
