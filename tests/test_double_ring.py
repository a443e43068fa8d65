"""Double ring against the dense oracle (out, lse, dq, dk, dv), node sizes 1, 2, 4, and its input checks."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_ok, run_cases

from seqpar.testing import Case, case_error

M = "double_ring"


def _grid(world: int, node_size: int) -> list[Case]:
    kw = {"method": M, "seq_len": 8 * world, "heads": 4, "head_dim": 8, "seed": world + node_size,
          "options": (("node_size", node_size),)}
    return [Case(layout="zigzag", causal=True, kv_heads=2, dtype="float32", **kw),
            Case(layout="zigzag", causal=True, kv_heads=1, dtype="bfloat16", batch=2, **kw),
            Case(layout="zigzag", causal=False, kv_heads=4, dtype="bfloat16", **kw),
            Case(layout="contiguous", causal=False, kv_heads=2, dtype="float32", **kw)]


def test_double_ring_small_groups(pools):
    assert_all_ok(run_cases(pools(2), _grid(2, 1) + _grid(2, 2)))
    assert_all_ok(run_cases(pools(1), _grid(1, 1)))


@pytest.mark.parametrize("world,node_sizes", [(8, (2, 4)), (4, (1, 2, 4))])
def test_double_ring_matches_oracle(pools, world, node_sizes):
    assert_all_ok(run_cases(pools(world), [c for w in node_sizes for c in _grid(world, w)]))


def test_double_ring_windows_documents_padding_lse_grad(pools):
    kw = {"method": M, "seq_len": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "options": (("node_size", 2),)}
    cases = [Case(layout="zigzag", window=(5, 0), **kw),
             Case(layout="contiguous", causal=False, window=(3, 4), dtype="bfloat16", **kw),
             Case(layout="zigzag", cu_seqlens=(0, 5, 13, 14, 32), **kw),
             Case(layout="zigzag", causal=False, cu_seqlens=(0, 9, 27), valid_len=27, **kw),
             Case(layout="zigzag", valid_len=29, lse_grad=True, **kw),
             Case(layout="contiguous", causal=False, valid_len=20, **kw),   # rank 3 is all padding
             Case(layout="zigzag", batch=2, dtype="float64", scale=0.4, **kw),
             # a bf16 wire: fp32 sums apart from the wire buffers (Note [Double-ring buffers])
             Case(layout="zigzag", dtype="bfloat16", **{**kw, "options": kw["options"] + (("grad_dtype",
                                                                                             torch.bfloat16),)})]
    assert_all_ok(run_cases(pools(4), cases))


@pytest.mark.parametrize("short", [False, True], ids=["running-sums", "partials-home"])
def test_double_ring_both_dkv_paths_match_oracle(pools, short):
    """The double ring's two dK/dV paths (Note [Double-ring partials home]), each forced on through the pass-KV
    ``HOME_BYTES``: node sizes 1, 2 and 4 of 4 ranks, causal and not, zigzag, contiguous and balanced documents,
    windows, padding, GQA and MQA, a head dim of its own for V, bf16 (fp32 and bf16 wires), the lse gradient."""
    from _workers_ulysses import run_case_short_paths

    from seqpar.testing import check_case

    kw = {"method": M, "seq_len": 32, "heads": 4, "kv_heads": 2, "head_dim": 8}
    cases = [Case(layout=lay, causal=causal, dtype=dt, options=(("node_size", w),), **kw)
             for w in (1, 2, 4) for lay in ("zigzag", "contiguous") for causal in (True, False)
             for dt in ("float32", "bfloat16")]
    two = (("node_size", 2),)
    cases += [Case(layout="zigzag", window=(5, 0), options=two, **kw),
              Case(layout="contiguous", window=(3, 0), options=two, **kw),
              Case(layout="balanced", cu_seqlens=(0, 5, 13, 14, 32), options=two, **kw),
              Case(layout="zigzag", causal=False, cu_seqlens=(0, 9, 27), valid_len=27, options=two, **kw),
              Case(layout="zigzag", valid_len=29, lse_grad=True, dtype="float64", options=two, **kw),
              Case(layout="zigzag", method=M, seq_len=32, heads=4, kv_heads=1, head_dim=16, value_dim=8,
                   options=two),
              Case(layout="zigzag", dtype="bfloat16", options=(*two, ("grad_dtype", torch.bfloat16)), **kw)]
    pool = pools(4)
    assert_all_ok([check_case(c, pool.run(run_case_short_paths, short, c)) for c in cases])


@pytest.mark.parametrize("options,match", [
    ((), "needs node_size"),
    ((("node_size", 3),), "node_size must be a positive int dividing the group size 4, got 3"),
    ((("node_size", 0),), "node_size must be a positive int dividing"),
    ((("node_size", True),), "node_size must be a positive int dividing"),
    ((("node_size", 2), ("inner", 2)), "method='double_ring' takes options"),
])
def test_double_ring_rejects_bad_node_size(pools, options, match):
    case = Case(method=M, seq_len=32, options=options)
    for kind, msg in pools(4).run(case_error, case):
        assert kind and match in msg, (kind, msg)
        assert "(rank " in msg
