"""Verify mode: ``attention(verify=True)`` and ``seqpar.verify`` pass correct results and catch wrong ones.

A wrong result is made by corrupting a correct one (out or lse, on one rank) or by verifying against a
different mask than the one computed (the peers' "silently wrong window" class of bug). The error must be
raised on every rank, with the measured error in the message.
"""

from __future__ import annotations

import pytest
from _workers_reliability import verify_worker
from conftest import strip_rank
from reliability_methods import SOFTMAX, all_rejected, padded_length, softmax_setup

from seqpar.testing import Case

RUN_TIMEOUT = 300


def _case(method: str, world: int, **kw) -> Case:
    s = softmax_setup(method, world)
    base = dict(method=method, layout=s.layout, ulysses=s.ulysses, options=s.options,
                seq_len=padded_length(s, world, 8 * world), heads=4,
                kv_heads=2, head_dim=8)
    return Case(**{**base, **kw})


def _all_raised(res, exc, words):
    msgs = []
    for rank, r in enumerate(res):
        assert r["attention"] is None, f"rank {rank}: attention(verify=True) failed: {r['attention']}"
        assert r["verify"] is not None, f"rank {rank}: verify passed a wrong result (worst {r.get('worst')})"
        name, msg = r["verify"]
        assert name == exc, f"rank {rank}: {name}: {msg}"
        for w in words:
            assert w in msg, f"rank {rank}: message lacks {w!r}: {msg}"
        msgs.append(strip_rank(msg))
    assert len(set(msgs)) == 1, f"ranks raised different messages: {msgs}"


@pytest.mark.parametrize("method", SOFTMAX)
def test_correct_results_pass_verification(pools, method):
    """fp32 and bf16, plain and with window + documents + padding: attention(verify=True) and verify() pass."""
    world = 4
    cases = [_case(method, world), _case(method, world, dtype="bfloat16", causal=False, seed=1),
             _case(method, world, window=(5, 0), cu_seqlens=(0, 7, 19, 30), valid_len=30, seed=2)]
    pool = pools(world)
    for c in cases:
        res = pool.run(verify_worker, c, timeout=RUN_TIMEOUT)
        why = all_rejected([None if r["attention"] is None else ": ".join(r["attention"]) for r in res])
        if why is not None:
            pytest.skip(f"method {method!r} needs a setup these tests do not know: {why}")
        for rank, r in enumerate(res):
            assert r["attention"] is None and r["verify"] is None, f"{c.label()} rank {rank}: {r}"
            assert r["worst"] <= 1.0


@pytest.mark.parametrize("field", ["out", "lse"])
def test_a_corrupted_result_on_one_rank_fails_on_every_rank(pools, field):
    case = _case("ring", 4)
    res = pools(4).run(verify_worker, case, {"field": field, "rank": 2, "scale": 0.05}, timeout=RUN_TIMEOUT)
    _all_raised(res, "VerificationError", ["verify: method='ring'", f"{field}: error", "limit"])


def test_a_wrong_mask_is_caught(pools):
    """Computed causal, verified as non-causal: the error a silently ignored mask option would produce."""
    case = _case("ring", 4)
    res = pools(4).run(verify_worker, case, None, {"causal": False}, timeout=RUN_TIMEOUT)
    _all_raised(res, "VerificationError", ["out: error"])


def test_the_sample_is_the_same_on_every_rank_and_bounded(pools):
    case = _case("ring", 4, heads=8, kv_heads=2, seq_len=64)
    res = pools(4).run(verify_worker, case, None, {"heads": 3, "rows": 5, "seed": 7}, timeout=RUN_TIMEOUT)
    assert {(r["heads"], r["rows"]) for r in res} == {(res[0]["heads"], 5)} and len(res[0]["heads"]) == 3, res


def test_bad_verify_arguments_raise_on_every_rank(pools):
    case = _case("ring", 2)
    res = pools(2).run(verify_worker, case, None, {"rows": 0}, timeout=RUN_TIMEOUT)
    for r in res:
        assert r["verify"][0] == "ValueError" and "rows must be an int >= 1" in r["verify"][1], r
