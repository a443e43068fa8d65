"""Ulysses and USP with ``head_chunks``: the all-to-alls pipelined over head groups (ALGORITHMS.md §5.5).

Against the dense oracle (out, lse, dq, dk, dv): ulysses at W = 2 and 4 and USP 2 x 2 with head_chunks
2, 4 and "auto", MHA and GQA (kv_heads 2 ... 16, with and without per-group KV replication), causal and
not, fp32 and bf16, windows, documents, padding and the gradient through lse. Also: the exact order of
posts, waits and engine calls (group i+1's transfer is posted before group i's kernels, group i's outputs
are awaited after group i+1's), no host sync or side stream on the path, gradients reach q, k and v
(yunchang's asynchronous Ulysses drops them: PEERS.md §2, defect 10), ``head_chunks=1`` is the previous
code path bit for bit, bad values raise the same error on every rank before any collective, and the
planner's mirror of the "auto" rule and its pipelined cost model.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _workers_overlap import trace_pipeline
from _workers_ulysses import call_error
from conftest import assert_all_ok, assert_same_error_on_every_rank, run_cases

from seqpar.bench.presets import PRESETS, method_specs
from seqpar.cost import model as cost
from seqpar.cost.model import Candidate, Machine, Problem
from seqpar.cost.profile import load_profile
from seqpar.cost.topology import Network, get_topology
from seqpar.methods import _ulysses, get
from seqpar.planner.search import _why_not, predict
from seqpar.planner.validate import parse_method
from seqpar.testing import Case, check_case, run_case

U = dict(method="ulysses", layout="contiguous", head_dim=8)
P = dict(method="usp", head_dim=8, ulysses=2)


def _hc(c) -> tuple[tuple[str, object], ...]:
    return (("head_chunks", c),)


# --- single process: the chunk rules -----------------------------------------------------------------------

def test_chunk_counts_and_auto_rule():
    """Valid counts keep the slot rules per group; "auto" is the largest c <= 4 with no extra KV replication
    and >= 2 query heads per rank per group; the planner's mirror agrees everywhere."""
    assert _ulysses.head_chunk_counts(8, 8, 4) == [1, 2]                # 4 groups: 2 query heads over 4 ranks
    assert _ulysses.head_chunk_counts(16, 4, 4) == [1, 2, 4]            # per-group KV replication is allowed
    assert _ulysses.head_chunk_counts(32, 8, 4) == [1, 2, 4, 8]
    assert _ulysses.auto_head_chunks(32, 32, 4) == 4 and _ulysses.auto_head_chunks(32, 8, 4) == 2
    assert _ulysses.auto_head_chunks(32, 2, 4) == 1                     # already replicated: never split
    assert _ulysses.auto_head_chunks(32, 32, 1) == 1                    # nothing to hide
    assert _ulysses.auto_head_chunks(16, 16, 4) == 2                    # 4 groups would leave 1 head per rank
    for H, U in itertools.product(range(1, 65), (1, 2, 3, 4, 8)):
        for Hkv in (h for h in range(1, H + 1) if H % h == 0):
            if not _ulysses.a2a.HeadSlots.is_valid(H, Hkv, U):
                continue
            want = _ulysses.auto_head_chunks(H, Hkv, U)
            assert cost.auto_head_chunks(H, Hkv, U) == want, (H, Hkv, U)
            assert want in _ulysses.head_chunk_counts(H, Hkv, U)
            assert [c for c in range(1, H + 1) if cost.head_chunk_valid(H, Hkv, U, c)] == \
                _ulysses.head_chunk_counts(H, Hkv, U), (H, Hkv, U)


# --- oracle grids ---------------------------------------------------------------------------------------------

def test_ulysses_world2(pools):
    """U = 2: H = 8 with kv 8, 4 (4 groups: one KV head each, replicated to both ranks) and 2; H = 16 where
    "auto" picks 4; causal and not, fp32, bf16 and fp64 (lse stays fp64)."""
    grid = [(8, 8, 2), (8, 8, 4), (8, 8, "auto"), (8, 4, 2), (8, 4, 4), (8, 2, 2), (16, 16, "auto"), (16, 2, 2)]
    cases = [Case(**U, seq_len=8, heads=h, kv_heads=kv, options=_hc(c), causal=i % 3 != 1,
                  dtype="bfloat16" if i % 2 else "float32", seed=i) for i, (h, kv, c) in enumerate(grid)]
    cases.append(Case(**U, seq_len=8, heads=8, kv_heads=4, options=_hc(2), dtype="float64", batch=2))
    assert_all_ok(run_cases(pools(2), cases))


def test_ulysses_world4(pools):
    """U = 4, H = 16: kv 16, 8 and 4 (4 groups of one KV head, each on 4 ranks) with 2, 4 and "auto"
    (2, 2 and 1 here); causal and not, fp32 and bf16, batch 2 once."""
    grid = list(itertools.product([16, 8, 4], [2, 4, "auto"]))
    cases = [Case(**U, seq_len=16, heads=16, kv_heads=kv, options=_hc(c), causal=i % 3 != 2,
                  dtype="bfloat16" if i % 2 else "float32", batch=2 if i == 4 else 1, seed=i)
             for i, (kv, c) in enumerate(grid)]
    assert_all_ok(run_cases(pools(4), cases))


def test_ulysses_world4_features(pools):
    """Windows, documents crossing ranks (and of length 1), end padding and the gradient through lse, each
    group running the block planner on the whole sequence."""
    docs = (0, 1, 7, 8, 13, 16)
    base = Case(**U, seq_len=16, heads=16, kv_heads=8, options=_hc(2))
    cases = [base.with_(window=(3, 0)),
             base.with_(window=(2, 3), causal=False, options=_hc(4), kv_heads=4),
             base.with_(cu_seqlens=docs, dtype="bfloat16"),
             base.with_(cu_seqlens=(0, 5, 6, 13), valid_len=13, window=(2, 0), options=_hc("auto")),
             base.with_(lse_grad=True),
             base.with_(lse_grad=True, causal=False, cu_seqlens=docs, kv_heads=4, options=_hc(4), dtype="bfloat16")]
    assert_all_ok(run_cases(pools(4), cases))


def test_usp_2x2(pools):
    """U = 2 x R = 2: each layout, both placements, GQA with and without per-group replication, causal and
    not, fp32 and bf16, and the features (window, documents, padding, lse gradient) through the ring."""
    docs = (0, 1, 7, 8, 13, 16)
    grid = [("zigzag", "contiguous", 8, 2, {}), ("zigzag", "strided", 8, 4, {"dtype": "bfloat16"}),
            ("contiguous", "contiguous", 4, "auto", {"causal": False}),
            ("stripe", "strided", 2, 2, {"dtype": "bfloat16"}),
            ("zigzag", "contiguous", 4, 4, {"lse_grad": True}),
            ("zigzag", "strided", 8, "auto", {"window": (3, 0), "causal": False}),
            ("stripe", "contiguous", 8, 2, {"cu_seqlens": docs, "lse_grad": True, "dtype": "bfloat16"}),
            ("contiguous", "strided", 4, 2, {"cu_seqlens": (0, 5, 6, 13), "valid_len": 13})]
    cases = [Case(**P, layout=lay, placement=pl, seq_len=16, heads=8, kv_heads=kv, options=_hc(c), seed=i, **kw)
             for i, (lay, pl, kv, c, kw) in enumerate(grid)]
    assert_all_ok(run_cases(pools(4), cases))


# --- the schedule -----------------------------------------------------------------------------------------------

# posts are numbered in posting order; forward: in(i) = q/k/v, then out(i) and lse(i) as two posts
FWD_3 = ["P0", "P1", "W0", "C", "P2", "P3",                       # in0, in1 | wait in0 | engine 0 | out0, lse0
         "P4", "W1", "C", "P5", "P6", "W2", "W3",                 # in2 | wait in1 | engine 1 | out1, lse1 | out0
         "W4", "C", "P7", "P8", "W5", "W6",                       # wait in2 | engine 2 | out2, lse2 | out1
         "W7", "W8"]                                              # out2
BWD_3 = ["P0", "P1", "W0", "C", "P2",                             # dO0, dO1 | wait dO0 | engine 0 | grads0
         "P3", "W1", "C", "P4", "W2",                             # dO2 | wait dO1 | engine 1 | grads1 | grads0
         "W3", "C", "P5", "W4",                                   # wait dO2 | engine 2 | grads2 | grads1
         "W5"]                                                    # grads2


@pytest.mark.parametrize("method", ["ulysses", "usp"])
def test_pipeline_order_no_host_sync_and_gradients(pools, method):
    """Three groups: every transfer but the first input and the last output is posted before, and awaited
    after, a neighbouring group's engine call; every post is awaited; nothing syncs the host or opens a side
    stream; q, k and v all get gradients."""
    if method == "ulysses":
        case, pool = Case(**U, seq_len=8, heads=6, kv_heads=6, options=_hc(3)), pools(2)
    else:
        case, pool = Case(**P, layout="zigzag", seq_len=16, heads=6, kv_heads=6, options=_hc(3)), pools(4)
    for r, res in enumerate(pool.run(trace_pipeline, case)):
        assert res["fwd"] == FWD_3, f"rank {r}: {res['fwd']}"
        assert res["bwd"] == BWD_3, f"rank {r}: {res['bwd']}"
        assert res["grads"], f"rank {r}: q, k or v got no gradient"


# --- head_chunks = 1 and bad values ---------------------------------------------------------------------------

def test_head_chunks_1_is_the_default_bitwise(pools):
    """``head_chunks=1`` is bitwise the call without the option; two groups match the oracle."""
    cases = [Case(**U, seq_len=16, heads=8, kv_heads=2, lse_grad=True, dtype="bfloat16"),
             Case(**P, layout="zigzag", seq_len=16, heads=4, kv_heads=1, causal=False)]
    for case in cases:
        default = pools(4).run(run_case, case)
        explicit = pools(4).run(run_case, case.with_(options=_hc(1)))
        for r, (a, b) in enumerate(zip(default, explicit)):
            for f in ("out", "lse", "dq", "dk", "dv"):
                assert torch.equal(a[f], b[f]), f"rank {r}: {f} differs with head_chunks=1"
    case = cases[0].with_(options=_hc(2))
    report = check_case(case, pools(4).run(run_case, case))
    assert report.ok, report


BAD = [
    ({"shape": (1, 4, 8, 8, 8), "method": "ulysses", "layout": "contiguous", "head_chunks": 3}, "ValueError",
     ["head_chunks must split heads=8 and kv_heads=8 into groups that each keep the GQA slot rules over the "
      "ulysses degree 4", "valid: 1, 2)", "got 3"]),
    ({"shape": (1, 4, 16, 2, 8), "method": "ulysses", "layout": "contiguous", "head_chunks": 4}, "ValueError",
     ["kv_heads=2", "valid: 1, 2)", "got 4"]),
    ({"shape": (1, 4, 8, 8, 8), "method": "ulysses", "layout": "contiguous", "head_chunks": 0}, "ValueError",
     ["valid: 1, 2)", "got 0"]),
    ({"shape": (1, 4, 8, 8, 8), "method": "ulysses", "layout": "contiguous", "head_chunks": "two"}, "TypeError",
     ["head_chunks must be a positive int or 'auto'", "got 'two'"]),
    ({"shape": (1, 4, 8, 8, 8), "method": "ulysses", "layout": "contiguous", "head_chunks": True}, "TypeError",
     ["head_chunks must be a positive int or 'auto'", "got True"]),
    ({"shape": (1, 4, 8, 4, 8), "method": "usp", "layout": "zigzag", "mesh": (2, "strided"), "head_chunks": 8},
     "ValueError", ["heads=8 and kv_heads=4", "ulysses degree 2", "valid: 1, 2, 4)", "got 8"]),
]


@pytest.mark.parametrize("spec,etype,fragments", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_head_chunks_raise_on_every_rank(pools, spec, etype, fragments):
    """The same clear error on every rank (value, valid counts, rank), before any collective: the pool
    stays usable."""
    results = pools(4).run(call_error, spec)
    assert_same_error_on_every_rank(results, etype, fragments)
    assert pools(4).run(call_error, {"shape": (1, 4, 8, 8, 8), "method": "ulysses", "layout": "contiguous",
                                     "head_chunks": 2}) == [None] * 4


# --- planner and benchmark ------------------------------------------------------------------------------------

def _machine() -> Machine:
    prof = load_profile("h200-nvswitch")
    return Machine(prof, Network(get_topology(None, prof), prof), prof.default_kernel)


def test_cost_model_learns_the_overlap():
    """At 16K on 4 ranks (communication-bound) the pipeline exposes less of the all-to-alls, moves the same
    bytes without replication, and is faster on the device; head_chunks=1 is the plain model exactly. With
    the H200 host's fitted fixed costs (one step cost per head group) it is slower at 16K, as measured there
    (probe run, mha-causal-16k fwd: 4.96 ms piped vs 1.96 ms plain)."""
    m = _machine()
    prof = m.profile.replace(call_us=(), step_us=(), host_overlap_loss=1.0, alpha_us=0.0)
    device = Machine(prof, Network(get_topology(None, prof), prof), prof.default_kernel)
    for Hkv in (32, 8):
        p = Problem(seq_len=16384, heads=32, kv_heads=Hkv, world=4)
        plain = predict(p, Candidate("ulysses", "contiguous"), m)
        assert predict(p, Candidate("ulysses", "contiguous", options=_hc(1)), m) == plain
        piped = predict(p, Candidate("ulysses", "contiguous", options=_hc(2)), m)
        assert piped.exposed_comm_ms < 0.75 * plain.exposed_comm_ms
        assert piped.fwd_ms > plain.fwd_ms                                  # host-bound at 16K (fitted costs)
        d_plain = predict(p, Candidate("ulysses", "contiguous"), device)
        d_piped = predict(p, Candidate("ulysses", "contiguous", options=_hc(2)), device)
        assert d_piped.fwd_ms < d_plain.fwd_ms and d_piped.fwd_bwd_ms < d_plain.fwd_bwd_ms
        assert piped.comm_bytes == pytest.approx(plain.comm_bytes, rel=1e-9)
        auto = predict(p, Candidate("ulysses", "contiguous", options=_hc("auto")), m)
        c = _ulysses.auto_head_chunks(32, Hkv, 4)
        assert auto == predict(p, Candidate("ulysses", "contiguous", options=_hc(c)), m)
        usp = predict(p, Candidate("usp", "zigzag", 2, options=_hc(2)), m)
        assert usp.fwd_bwd_ms > 0 and any("pipelined" in n for n in usp.notes)
    bad = Candidate("ulysses", "contiguous", options=_hc(4))                 # 2 query heads over 4 ranks
    why = _why_not(bad, get("ulysses"), Problem(seq_len=16384, heads=8, kv_heads=8, world=4), frozenset(), False)
    assert any("head_chunks 4 must split heads=8" in w for w in why), why


def test_benchmark_specs_and_labels():
    """The benchmark times the plain ulysses and usp (head_chunks="auto" measured slower on NVSwitch, so it
    is opt-in and not a table row), and validation reads head_chunks labels back."""
    specs = method_specs(PRESETS["mha-causal-16k"], 4, ["ring", "ulysses", "usp"])
    labels = [s.label for s in specs]
    for want in ("ulysses", "usp/u2/zigzag"):
        assert want in labels, labels
    assert not any("head_chunks" in label for label in labels), labels
    assert parse_method("ulysses/head_chunksauto", 4) == Candidate("ulysses", "contiguous", options=_hc("auto"))
    assert parse_method("usp/u2/zigzag/head_chunks2", 4) == Candidate("usp", "zigzag", 2, options=_hc(2))
    assert Candidate("usp", "zigzag", 2, options=_hc(2)).label(4) == "usp/u2r2/zigzag/head_chunks2"
    with pytest.raises(ValueError, match="ulysses x ring"):
        parse_method("usp/u3/zigzag", 4)
