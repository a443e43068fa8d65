"""LASP-2 and LASP-1 against the fp64 recurrence: out, final state, dq, dk, dv, gates and initial state.

Every test asserts. PEERS.md §5 lists the LASP/LASP-2 defects; the test proving we do not have each:
    no intra-block term / unmasked diagonal tile  -> test_matches_recurrence, test_no_future_leak
    no decay or gates                             -> every grid runs none / const / scalar / dim gates
    synchronous gather, no backward overlap,
    blocking recv before compute (LASP-1)         -> test_collectives_are_overlapped
    tail garbage, dropped rows                    -> test_matches_recurrence's uneven lengths, chunk sizes that
                                                     do not divide (+ the kernel tail tests)
    uninitialised buffers                         -> the oracle grids (garbage would show) and test_no_future_leak
                                                     (two runs bitwise equal)
    global ranks instead of the group's           -> test_strided_subgroups
    bf16 local state                              -> test_bf16_error_does_not_grow_with_world_size
"""

from __future__ import annotations

import random

import pytest
from linear_cases import (
    LinearCase,
    assert_reports,
    bad_input_worker,
    check_linear_case,
    leak_worker,
    overlap_worker,
    run_and_check,
    subgroup_worker,
)

SCHEMES = [("lasp2", "contiguous"), ("lasp2", "zigzag"), ("lasp1", "contiguous")]
GATES = ["none", "const", "scalar", "dim"]


def _grid(world: int) -> list[LinearCase]:
    S = 6 * world
    cases = []
    for (method, layout), gate in ((s, g) for s in SCHEMES for g in GATES):
        base = LinearCase(method=method, layout=layout, gate=gate, seq_len=S, seed=world * 11 + len(cases))
        cases.append(base)
        cases.append(base.with_(batch=2, initial_state=True, final_state=method == "lasp2", chunk_size=5,
                                seed=base.seed + 1))
    for layout in ("contiguous", "zigzag"):
        cases.append(LinearCase(layout=layout, causal=False, seq_len=S, batch=2))
        cases.append(LinearCase(layout=layout, causal=False, seq_len=S, feature_map="elu1"))
    cases.append(LinearCase(layout="zigzag", gate="dim", seq_len=S, dtype="float32", final_state=True))
    cases.append(LinearCase(layout="zigzag", gate="scalar", seq_len=S, dtype="bfloat16", feature_map="relu",
                            scale=0.5, chunk_size=3))
    return cases


def _doc_sets(world: int) -> list[tuple[int, ...]]:
    S, L = 4 * world, 4
    rng = random.Random(world)
    fixed = [(0, L, 3 * L, S) if world >= 3 else (0, L, S),                 # boundaries on rank edges
             (0, 1, L + 1, S - 3, S)]                                       # a document across > 2 ranks
    cuts = sorted(rng.sample(range(1, S), min(S - 1, 2 * world)))
    fixed.append(tuple([0, *cuts[:2], cuts[1], *cuts[2:], S]))              # short documents, an empty one
    return fixed


def _varlen(world: int) -> list[LinearCase]:
    """Documents spanning ranks (state resets), on rank edges, empty ones; with and without end padding."""
    S = 4 * world
    cases = []
    for docs in _doc_sets(world):
        for (method, layout), gate in ((s, g) for s in SCHEMES for g in ("none", "scalar", "dim")):
            cases.append(LinearCase(method=method, layout=layout, gate=gate, seq_len=S, cu_seqlens=docs,
                                    final_state=method == "lasp2", chunk_size=3, seed=len(cases)))
        for layout in ("contiguous", "zigzag"):
            cases.append(LinearCase(layout=layout, causal=False, seq_len=S, cu_seqlens=docs, seed=len(cases)))
    end = S - 3
    cases += [LinearCase(layout=layout, gate="dim", seq_len=S, cu_seqlens=(0, 2, end // 2, end), valid_len=end,
                         final_state=True) for layout in ("contiguous", "zigzag")]
    cases.append(LinearCase(layout="zigzag", causal=False, seq_len=S, cu_seqlens=(0, 3, end), valid_len=end))
    return cases


def _uneven(world: int) -> list[LinearCase]:
    """Global lengths that do not divide the world: end padding, whole ranks of padding included."""
    cases = []
    for valid in (4 * world - 1, 4 * world - 5, 3):
        for (method, layout), gate in ((s, g) for s in SCHEMES for g in ("const", "dim")):
            cases.append(LinearCase(method=method, layout=layout, gate=gate, seq_len=4 * world, valid_len=valid,
                                    initial_state=True, final_state=method == "lasp2", seed=valid))
        cases.append(LinearCase(layout="zigzag", causal=False, seq_len=4 * world, valid_len=valid))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_matches_recurrence(pools, world):
    """Every variant (gates, states, causal or not, feature maps, dtypes), documents and uneven lengths.

    One test per world size so each pool of W ranks starts once (starting ranks dominates the cost).
    """
    cases = _grid(world) + (_varlen(world) if world > 1 else []) + (_uneven(world) if world in (3, 4) else [])
    assert_reports(run_and_check(pools(world), cases))


@pytest.mark.parametrize("case", [LinearCase(layout="contiguous", gate="dim", seq_len=32, chunk_size=3),
                                  LinearCase(layout="zigzag", gate="scalar", seq_len=32, chunk_size=64),
                                  LinearCase(method="lasp1", gate="none", seq_len=32)],
                         ids=lambda c: f"{c.method}-{c.layout}-{c.gate}")
def test_no_future_leak(pools, case):
    """Perturbing token t+1 never changes an output at a position <= t (ALGORITHMS §13.4), at rank edges too."""
    for token in (8, 9, 13, 17):                     # W = 4: rank edges of both layouts and inside a rank
        results = pools(4).run(leak_worker, case, token)
        for r in results:
            assert r["base"].equal(r["again"]), "two runs on the same input differ"
            past = r["positions"] < token
            assert r["base"][:, past].equal(r["bumped"][:, past]), f"token {token} changed an earlier output"
        moved = any(not r["base"][:, r["positions"] == token].equal(r["bumped"][:, r["positions"] == token])
                    for r in results)
        assert moved, f"token {token}'s own output did not move"


def test_collectives_are_overlapped(pools):
    """LASP-2 posts its gather before the local pass and waits after it, in forward and backward; LASP-1
    posts its receive before the local pass (never a blocking receive first) and sends as soon as it can."""
    for res in pools(4).run(overlap_worker, "lasp2"):
        fwd, bwd = res[:res.index("backward")], res[res.index("backward"):]
        assert fwd == ["gather", "local_forward", "gather.wait"], fwd
        assert bwd == ["backward", "gather", "local_backward", "gather.wait"], bwd
    first, *middle, last = pools(4).run(overlap_worker, "lasp1")
    assert first == ["local_forward", "send.post", "exchange.wait",
                     "backward", "recv.post", "local_backward", "exchange.wait"], first
    for m in middle:
        assert m == ["recv.post", "local_forward", "exchange.wait", "send.post", "exchange.wait",
                     "backward", "recv.post", "local_backward", "exchange.wait", "send.post", "exchange.wait"], m
    assert last == ["recv.post", "local_forward", "exchange.wait",
                    "backward", "local_backward", "send.post", "exchange.wait"], last


def test_strided_subgroups(pools):
    """Two SP groups {0, 2} and {1, 3}: neighbours and gathers follow group ranks, never global ranks.

    (Runs after every test that uses the default group on this pool: new_group is collective.)"""
    cases = [LinearCase(layout="zigzag", gate="dim", seq_len=16, initial_state=True, final_state=True),
             LinearCase(method="lasp1", gate="scalar", seq_len=12, initial_state=True),
             LinearCase(layout="contiguous", causal=False, seq_len=12, cu_seqlens=(0, 5, 12))]
    results = pools(4).run(subgroup_worker, cases)
    for gid in (0, 1):
        mine = [res for g, res in results if g == gid]
        assert len(mine) == 2
        assert_reports([check_linear_case(c, [m[i] for m in mine]) for i, c in enumerate(cases)])


def test_bf16_error_does_not_grow_with_world_size(pools):
    """States, scans and gathered buffers are fp32: the bf16 error at W = 8 is no worse than at W = 4."""
    case = LinearCase(layout="zigzag", gate="dim", seq_len=64, heads=2, k_dim=8, v_dim=8, dtype="bfloat16",
                      chunk_size=4, final_state=True)
    (r4,) = run_and_check(pools(4), [case])
    (r8,) = run_and_check(pools(8), [case])
    assert_reports([r4, r8])
    for f in ("out", "dq", "dk", "dv", "dg", "final"):
        assert r8.errors[f] <= 1.25 * r4.errors[f] + 1e-4, f"{f}: {r8.errors[f]:.2e} at W=8 vs {r4.errors[f]:.2e}"


def test_bad_inputs_raise_with_the_facts(pools):
    res = pools(4).run(bad_input_worker)[1]
    want = {"gqa": "NotImplementedError", "both_gates": "ValueError", "decay_shape": "ValueError",
            "gates_shape": "ValueError", "noncausal_decay": "NotImplementedError",
            "noncausal_state": "NotImplementedError", "h0_docs": "NotImplementedError", "h0_shape": "ValueError",
            "lasp1_zigzag": "ValueError", "lasp1_final": "NotImplementedError",
            "lasp1_noncausal": "NotImplementedError", "method": "ValueError", "stripe": "ValueError",
            "kernel_cpu": "UnsupportedInputError", "kernel_name": "ValueError", "zigzag_odd": "ValueError",
            "chunk": "ValueError", "feature_map": "ValueError", "scale": "ValueError", "dtype_mix": "TypeError",
            "seq_len": "ValueError", "cu_end": "ValueError"}
    for name, kind in want.items():
        got, msg = res[name]
        assert got == kind, f"{name}: raised {got} ({msg}), want {kind}"
        if kind != "UnsupportedInputError":
            assert "must" in msg and "got" in msg and "(rank 1 of 4)" in msg, f"{name}: {msg}"
