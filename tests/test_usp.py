"""USP (Ulysses x ring) against the dense oracle: out, lse, dq, dk, dv; the Nested placement; make_mesh.

And the yunchang defects it must not have (PEERS.md §2): a strided Ulysses axis gives correct causal
results (7); kv_heads < degree works, head counts outside the rules raise clearly on every rank (8); ring
degree 1 never enters the ring engine (13); the ring runs on the mesh's ring group, not the global one (3).
"""

from __future__ import annotations

import pytest
import torch
from _workers_ulysses import (
    call_error,
    mesh_facts,
    run_case_without_all_to_all,
    run_case_without_ring_engine,
)
from conftest import assert_all_ok, assert_same_error_on_every_rank, run_cases

from seqpar.layouts import Nested, make_layout
from seqpar.testing import Case, check_case, run_case

LAYOUTS = ["contiguous", "zigzag", "stripe"]
P = dict(method="usp", head_dim=8)


# --- single process: the placement ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ring,ulysses", [(1, 4), (2, 2), (3, 2), (2, 4), (4, 1)])
def test_nested_placement(layout, ring, ulysses):
    """Ring rank rho's U pieces, in Ulysses order, are exactly its ring-layout shard; every token once."""
    outer = make_layout(layout, ring)
    lay = Nested(ring * ulysses, outer=outer, inner=ulysses)
    S = 2 * lay.divisor
    seen = []
    for rho in range(ring):
        pieces = [p for u in range(ulysses) for p in lay.segments(rho * ulysses + u, S).positions()]
        assert pieces == outer.segments(rho, S).positions()
        seen += pieces
    assert sorted(seen) == list(range(S))
    x = torch.arange(3 * S).view(1, S, 3)
    assert torch.equal(lay.unshard([lay.shard(x, r) for r in range(lay.world)]), x)
    with pytest.raises(ValueError, match=f"must be a multiple of {lay.divisor}"):
        lay.check_len(S + 1)


# --- mesh and groups --------------------------------------------------------------------------------------

def test_make_mesh_groups_both_placements(pools):
    """contiguous: Ulysses groups are consecutive ranks; strided: ring groups are. The SP index is
    ``ring_rank * U + ulysses_rank`` either way."""
    for placement in ("contiguous", "strided"):
        for r, f in enumerate(pools(4).run(mesh_facts, 2, placement)):
            u, rho = (r % 2, r // 2) if placement == "contiguous" else (r // 2, r % 2)
            want_u = [rho * 2, rho * 2 + 1] if placement == "contiguous" else [rho, rho + 2]
            want_r = [u, u + 2] if placement == "contiguous" else [u * 2, u * 2 + 1]
            assert (f["ulysses"], f["ring"], f["index"], f["world"]) == (want_u, want_r, rho * 2 + u, 4), f


MESH_BAD = [
    ({"kind": "make_mesh", "ulysses": 3}, "ValueError", ["ulysses must divide the world size 4",
                                                         "valid: [1, 2, 4]", "got 3"]),
    ({"kind": "make_mesh", "ulysses": 0}, "ValueError", ["ulysses must be a positive int, got 0"]),
    ({"kind": "make_mesh", "ulysses": 2, "ring": 4}, "ValueError", ["ulysses * ring must equal the world size 4",
                                                                    "got 2 * 4"]),
    ({"kind": "make_mesh", "ulysses": 2, "placement": "diagonal"}, "ValueError",
     ["placement must be 'contiguous' or 'strided'", "got 'diagonal'"]),
    ({"shape": (1, 4, 6, 6, 8), "method": "usp", "layout": "zigzag", "mesh": (4, "contiguous")},
     "ValueError", ["ulysses degree must divide heads=6", "valid: 1, 2 for 4 ranks", "got 4"]),
    ({"shape": (1, 4, 12, 6, 8), "method": "usp", "layout": "stripe", "mesh": (4, "strided")},
     "ValueError", ["ulysses degree must divide kv_heads=6 or be a multiple of it", "valid: 1, 2 for 4 ranks",
                    "got 4"]),
    ({"shape": (1, 4, 4, 4, 8), "method": "usp", "layout": "zigzag"},
     "ValueError", ["mesh must be a 2D DeviceMesh with dims named ('ulysses', 'ring')", "got NoneType"]),
    ({"shape": (1, 4, 4, 4, 8), "method": "usp", "layout": "zigzag", "mesh": "1d"},
     "ValueError", ["mesh must be a 2D mesh with dims named ('ulysses', 'ring')", "got a 1D mesh"]),
]


@pytest.mark.parametrize("spec,etype,fragments", MESH_BAD, ids=[f"bad{i}" for i in range(len(MESH_BAD))])
def test_usp_bad_input_raises_on_every_rank(pools, spec, etype, fragments):
    results = pools(4).run(call_error, spec)
    assert_same_error_on_every_rank(results, etype, fragments)


# --- world 4 against the oracle ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_usp_2x2(pools, layout):
    """U = 2, R = 2, both placements of the Ulysses axis, causal and not, fp32 and bf16, GQA with
    replication (kv 1) and without, batch 2."""
    grid = [("contiguous", True, "float32", 2, 1), ("strided", True, "float32", 1, 1),
            ("strided", False, "float32", 4, 2), ("contiguous", True, "bfloat16", 1, 2),
            ("strided", True, "bfloat16", 2, 1), ("contiguous", False, "bfloat16", 4, 1)]
    cases = [Case(**P, layout=layout, ulysses=2, placement=pl, causal=c, dtype=dt, seq_len=16, heads=4,
                  kv_heads=kv, batch=b, seed=i) for i, (pl, c, dt, kv, b) in enumerate(grid)]
    assert_all_ok(run_cases(pools(4), cases))


def test_usp_gqa_kv_heads(pools):
    """H = 8 with kv_heads 8, 4, 2 (U = 2 divides them) and 1 (replicated to both Ulysses ranks)."""
    cases = [Case(**P, layout="zigzag", ulysses=2, placement=pl, seq_len=16, heads=8, kv_heads=kv, seed=kv)
             for kv, pl in zip((8, 4, 2, 1), ("contiguous", "strided", "contiguous", "strided"))]
    assert_all_ok(run_cases(pools(4), cases))


def test_usp_degenerate_meshes(pools):
    """Ring only (U = 1: a plain ring, each layout) and Ulysses only (R = 1: plain Ulysses, GQA with
    kv_heads 1 and 2 replicated to 4 and 2 ranks), both placements."""
    cases = [Case(**P, layout=lay, ulysses=1, placement=pl, causal=c, dtype=dt, seq_len=16, heads=4, kv_heads=2)
             for lay, pl, c, dt in [("contiguous", "contiguous", True, "float32"),
                                    ("zigzag", "strided", True, "bfloat16"), ("stripe", "contiguous", False,
                                                                              "float32")]]
    cases += [Case(**P, layout=lay, ulysses=4, placement=pl, causal=c, seq_len=16, heads=8, kv_heads=kv)
              for lay, pl, c, kv in [("contiguous", "contiguous", True, 1), ("zigzag", "strided", True, 2),
                                     ("stripe", "contiguous", False, 8)]]
    assert_all_ok(run_cases(pools(4), cases))


def test_usp_ring_degree_1_never_enters_the_ring_engine(pools):
    """R = 1 runs Ulysses' local engine (yunchang runs its ring code, fp32 merges included)."""
    for case in [Case(**P, layout="zigzag", ulysses=4, seq_len=16, heads=4, kv_heads=1, lse_grad=True),
                 Case(**P, layout="stripe", ulysses=4, placement="strided", seq_len=16, heads=8, kv_heads=4,
                      cu_seqlens=(0, 3, 16))]:
        report = check_case(case, pools(4).run(run_case_without_ring_engine, case))
        assert report.ok, report


def test_usp_ulysses_degree_1_has_no_all_to_all(pools):
    case = Case(**P, layout="zigzag", ulysses=1, seq_len=16, heads=4, kv_heads=2, lse_grad=True)
    report = check_case(case, pools(4).run(run_case_without_all_to_all, case))
    assert report.ok, report


def test_usp_features(pools):
    """Windows, documents spanning ranks and of length 1, padding, lse gradient, on U = 2 x R = 2."""
    docs = (0, 1, 7, 8, 13, 16)
    base = Case(**P, ulysses=2, seq_len=16, heads=4, kv_heads=2)
    cases = [base.with_(layout="contiguous", window=(3, 0)),
             base.with_(layout="zigzag", placement="strided", window=(2, 2), causal=False),
             base.with_(layout="zigzag", cu_seqlens=docs),
             base.with_(layout="stripe", placement="strided", cu_seqlens=(0, 5, 6, 13), valid_len=13),
             base.with_(layout="zigzag", valid_len=11, causal=False, kv_heads=1),
             base.with_(layout="zigzag", placement="strided", lse_grad=True, kv_heads=1),
             base.with_(layout="contiguous", lse_grad=True, cu_seqlens=docs, window=(4, 0), dtype="bfloat16")]
    assert_all_ok(run_cases(pools(4), cases))


def test_usp_deterministic_runs_are_bitwise_equal(pools):
    """Deterministic flag: two runs of the same USP case are bitwise equal."""
    case = Case(**P, layout="zigzag", ulysses=2, placement="strided", seq_len=16, heads=4, kv_heads=1,
                deterministic=True)
    a, b = (pools(4).run(run_case, case) for _ in range(2))
    for ra, rb in zip(a, b):
        for f in ("out", "lse", "dq", "dk", "dv"):
            assert torch.equal(ra[f], rb[f]), f


# --- world 8, tiny --------------------------------------------------------------------------------------

def test_usp_world8(pools):
    """2 x 4, 4 x 2 and 8 x 1 (U x R), both placements, each layout, GQA with and without replication."""
    specs = [(2, "contiguous", "zigzag", True, "float32", 2, {}),
             (2, "strided", "stripe", True, "bfloat16", 1, {}),
             (4, "strided", "contiguous", True, "float32", 2, {"cu_seqlens": (0, 3, 4, 11, 16)}),
             (4, "contiguous", "zigzag", False, "float32", 4, {"lse_grad": True}),
             (8, "contiguous", "zigzag", True, "float32", 1, {}),
             (8, "strided", "stripe", True, "bfloat16", 8, {"valid_len": 13})]
    cases = [Case(**P, ulysses=u, placement=pl, layout=lay, causal=c, dtype=dt, seq_len=16, heads=8, kv_heads=kv,
                  **extra) for u, pl, lay, c, dt, kv, extra in specs]
    assert_all_ok(run_cases(pools(8), cases))
