"""Fault injection: one rank raises inside a method; every rank ends with an error within a bounded time.

The fault is a test kernel registered in the worker only (``_workers_reliability``): it wraps the
reference kernel and raises on rank k at its s-th call (s = the middle of that rank's calls, counted by a
dry run), in forward or in backward. Each call runs on a fresh group with a short timeout T, so the
non-failing ranks must stop by themselves - the harness does not kill them - and the pool's own group is
never touched. Bounds: the failing rank raises at once; the others within T (gloo's timeout on the
transfer or collective they wait for) plus a margin for a loaded machine. A rank whose remaining work no
longer needs the failing rank may finish normally (a backward fault after the last exchange); none may
hang. With the fail-fast recipe (every rank that raises aborts the group) the others stop well before T.
"""

from __future__ import annotations

import pytest
from _workers_reliability import fault_case
from conftest import new_pool
from reliability_methods import LINEAR, SOFTMAX, all_rejected, linear_layout, softmax_setup

W = 4
T = 3.0                 # seconds: the fresh group's timeout
MARGIN = 20.0           # seconds a loaded 2-core machine may add


@pytest.fixture(scope="module")
def fault_pool():
    pool = new_pool(W, timeout=300)
    yield pool
    pool.close(kill=True)           # its fresh groups may still hold timed-out transfers


def _spec(method: str, phase: str, **kw) -> dict:
    if method in LINEAR:
        base = {"kind": "linear", "layout": linear_layout(method)}
    else:
        s = softmax_setup(method, W)
        base = {"kind": "softmax", "layout": s.layout, "ulysses": s.ulysses, "options": s.options}
    return {"method": method, "phase": phase, "timeout": T, "bad_rank": -1, "at_call": 0, **base, **kw}


def _dry_run(pool, method: str, phase: str) -> int:
    """Kernel calls rank 1 makes in ``phase`` when nothing fails (and proof that the setup works)."""
    res = pool.run(fault_case, _spec(method, phase), timeout=120)
    errors = [r["error"] for r in res]
    why = all_rejected(errors)
    if why is not None:
        pytest.skip(f"method {method!r} needs a setup these tests do not know: {why}")
    assert errors == [None] * W, f"{method}: the fault-free run failed: {errors}"
    assert res[1]["calls"] > 0, f"{method}: no kernel call in {phase} on rank 1: cannot inject a fault there"
    return res[1]["calls"]


def _run_fault(pool, method: str, phase: str, **kw) -> list[dict]:
    calls = _dry_run(pool, method, phase)
    at = calls // 2 + 1                                 # the middle of rank 1's calls
    res = pool.run(fault_case, _spec(method, phase, bad_rank=1, at_call=at, **kw), timeout=T * 4 + 120)
    bad = res[1]
    assert bad["error"] is not None and bad["error"].startswith("Injected: injected"), \
        f"{method}: rank 1 did not raise the injected fault: {bad}"
    assert bad["elapsed"] < MARGIN, f"{method}: the failing rank took {bad['elapsed']:.1f}s to raise"
    for r in res:
        assert r["elapsed"] < T + MARGIN, \
            f"{method} {phase}: rank {r['rank']} took {r['elapsed']:.1f}s to stop (timeout {T}s): {r['error']}"
        if r["rank"] != 1:
            assert r["error"] is None or "Injected" not in r["error"], r
    if phase == "forward":          # the backward still needs the failing rank: somebody must have timed out
        assert any(r["error"] for r in res if r["rank"] != 1), f"{method}: no other rank noticed: {res}"
    return res


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("method", SOFTMAX + LINEAR)
def test_a_fault_on_one_rank_stops_every_rank_within_the_timeout(fault_pool, method, phase):
    _run_fault(fault_pool, method, phase)


def test_aborting_the_group_on_error_stops_every_rank_at_once(fault_pool):
    """The fail-fast recipe: a rank that raises aborts the group; its gloo peers see the closed connection,
    raise and abort in turn, so the error reaches every rank long before the timeout."""
    res = _run_fault(fault_pool, "ring", "forward", abort=True)
    for r in res:
        if r["rank"] != 1:
            assert r["elapsed"] < T / 2, f"rank {r['rank']} waited {r['elapsed']:.1f}s despite the abort: {r['error']}"
            assert r["error"] is not None, f"rank {r['rank']} finished despite the abort"
