"""Ulysses all-to-all attention against the dense oracle: out, lse, dq, dk, dv.

Also the yunchang defects it must not have (PEERS.md §2): GQA with kv_heads < degree works (8), head counts
outside the slot rules raise a clear error on every rank before any collective (8), the all-to-all runs on
the group passed in, not the global one (3).
"""

from __future__ import annotations

import itertools

import pytest
from _workers_ulysses import call_error, run_case_on_submesh
from conftest import assert_all_ok, assert_same_error_on_every_rank, run_cases

from seqpar.testing import Case, check_case

U = dict(method="ulysses", layout="contiguous", head_dim=8)


def _gqa_grid(world: int, heads: int, kv_list, seq: int) -> list[Case]:
    cases = []
    for causal, kv, dtype in itertools.product([True, False], kv_list, ["float32", "bfloat16"]):
        cases.append(Case(**U, causal=causal, seq_len=seq, heads=heads, kv_heads=kv, dtype=dtype,
                          seed=world * 7 + kv))
    return cases


def test_ulysses_world4_gqa_grid(pools):
    """U = 4, H = 8 with kv_heads 8, 4, 2, 1 (no replication ... each KV head on 4 ranks); fp32, bf16,
    fp64 and fp16; causal and not; batch 2."""
    cases = _gqa_grid(4, 8, [8, 4, 2, 1], 16)
    cases += [Case(**U, seq_len=16, batch=2, heads=4, kv_heads=1, dtype="float64"),
              Case(**U, seq_len=16, batch=2, heads=8, kv_heads=2, dtype="float16", scale=0.3, causal=False)]
    assert_all_ok(run_cases(pools(4), cases))


def test_ulysses_world4_features(pools):
    """Windows (offset blocks), cu_seqlens documents spanning ranks and of length 1, end padding, and the
    gradient through lse - all served by the block planner on the full sequence."""
    docs = (0, 1, 7, 8, 13, 16)                  # L = 4: documents cross rank edges; two of length 1
    base = Case(**U, seq_len=16, heads=8, kv_heads=2)
    cases = [base.with_(window=(3, 0)),
             base.with_(window=(2, 3), causal=False),
             base.with_(cu_seqlens=docs),
             base.with_(cu_seqlens=docs, causal=False, kv_heads=1),
             base.with_(cu_seqlens=(0, 5, 6, 13), valid_len=13, window=(2, 0)),
             base.with_(valid_len=11, causal=False),
             base.with_(lse_grad=True),
             base.with_(lse_grad=True, causal=False, cu_seqlens=docs, kv_heads=1, dtype="bfloat16")]
    assert_all_ok(run_cases(pools(4), cases))


def test_ulysses_on_a_subgroup(pools):
    """W = 4 as (dp = 2) x (sp = 2): each dp replica runs Ulysses on its own sp group with its own inputs.
    A schedule that used global ranks or the default group would mix the replicas' heads."""
    for case in [Case(**U, seq_len=8, heads=4, kv_heads=1), Case(**U, seq_len=8, heads=4, kv_heads=4,
                                                                 causal=False, dtype="bfloat16")]:
        results = pools(4).run(run_case_on_submesh, case)
        for dp in (0, 1):
            mine = [res for d, res in results if d == dp]
            assert len(mine) == 2
            report = check_case(case.with_(seed=case.seed + dp), mine)
            assert report.ok, report


BAD = [
    ({"shape": (1, 4, 6, 6, 8), "method": "ulysses", "layout": "contiguous"},
     "ValueError", ["ulysses degree must divide heads=6", "valid: 1, 2, 3, 6", "got 4"]),
    ({"shape": (1, 4, 12, 6, 8), "method": "ulysses", "layout": "contiguous"},
     "ValueError", ["ulysses degree must divide kv_heads=6 or be a multiple of it", "valid: 1, 2, 3, 6, 12",
                    "got 4"]),
    ({"shape": (1, 4, 4, 4, 8), "method": "ulysses", "layout": "zigzag"},
     "ValueError", ["layout must be one of ['contiguous'] for method='ulysses'", "got 'zigzag'"]),
    ({"shape": (1, 4, 4, 4, 8), "method": "ulysses", "layout": "contiguous", "mesh": (2, "contiguous")},
     "ValueError", ["mesh must be a 1D mesh (or a ProcessGroup) for this method", "got a 2D mesh"]),
    ({"shape": (1, 4, 4, 4, 8), "method": "ulysses", "layout": "contiguous", "heads_k_stride": 1},
     "TypeError", ["method='ulysses' takes options ['head_chunks', 'transport']", "heads_k_stride"]),
    ({"shape": (1, 4, 4, 4, 8), "method": "ulysses", "layout": "contiguous", "cu_seqlens": (0, 5, 15)},
     "ValueError", ["cu_seqlens must end at the global length 16", "got 15"]),
]


@pytest.mark.parametrize("spec,etype,fragments", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_ulysses_bad_input_raises_on_every_rank(pools, spec, etype, fragments):
    """The same clear error on every rank (naming the argument, the value and the rank), before any
    collective: the pool stays usable afterwards."""
    results = pools(4).run(call_error, spec)
    assert_same_error_on_every_rank(results, etype, fragments)
    assert_all_ok(run_cases(pools(4), [Case(**U, seq_len=8, heads=4, kv_heads=2)]))


def test_ulysses_world3(pools):
    """An odd degree: U = 3, H = 6 with kv_heads 6, 3 (no replication) and 1 (on all 3 ranks).
    (W = 1 and 2 run through the same code as USP's degenerate meshes in test_usp.py.)"""
    cases = [Case(**U, causal=c, seq_len=12, heads=6, kv_heads=kv, seed=kv)
             for c, kv in itertools.product([True, False], [6, 3, 1])]
    cases.append(Case(**U, seq_len=12, heads=6, kv_heads=1, dtype="bfloat16", batch=2))
    assert_all_ok(run_cases(pools(3), cases))


def test_ulysses_world8(pools):
    """U = 8, H = 8: kv_heads 8, 4, 2, 1 (replicated to 1, 2, 4, 8 ranks), tiny shapes."""
    cases = [Case(**U, seq_len=16, heads=8, kv_heads=kv, causal=kv != 4, seed=kv) for kv in (8, 4, 2, 1)]
    cases.append(Case(**U, seq_len=16, heads=8, kv_heads=2, dtype="bfloat16", cu_seqlens=(0, 3, 4, 11, 16)))
    assert_all_ok(run_cases(pools(8), cases))
