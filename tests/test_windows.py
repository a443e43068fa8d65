"""Sliding windows ``(left, right)`` in GLOBAL positions, for every softmax method and layout, causal and not.

PEERS.md §1 defect 2: ring-flash-attn applies the window in each block's local coordinates, which is
silently wrong on every block whose query and key offsets differ (delta != 0, ALGORITHMS.md §1.6). The
windows below are shorter than a chunk, straddle rank boundaries and are one-sided, so almost every block
has delta != 0; results must equal the dense oracle. Also: the ring ends early when the window is shorter
than the ring (Note [Ring truncation]) and the all-gather plan computes nothing outside the window.
"""

from __future__ import annotations

import pytest
from _cross import METHODS, method_cases
from conftest import assert_all_ok, run_cases

from seqpar.layouts import Contiguous, Rule, Stripe, Zigzag
from seqpar.methods import _passkv
from seqpar.methods.allgather import gather_plan
from seqpar.testing import Case


def windows(L: int) -> list[tuple[bool, tuple[int, int]]]:
    """(causal, window) pairs around the local length L: inside a chunk, across one or two rank edges."""
    return [(True, (0, -1)), (True, (1, -1)), (True, (L - 1, -1)), (True, (L + 1, -1)), (True, (2 * L + 3, -1)),
            (False, (0, 0)), (False, (2, 3)), (False, (-1, 2)), (False, (3, -1)), (False, (L, L + 2))]


def window_cases(world: int, full: bool) -> list[Case]:
    S = 6 * world
    L = S // world
    pairs = windows(L) if full else [windows(L)[i] for i in (1, 3, 6, 9)]
    base = Case(seq_len=S, heads=4, kv_heads=2, head_dim=8, seed=world)
    out = [base.with_(causal=c, window=w, seed=world + i) for i, (c, w) in enumerate(pairs)]
    out[1] = out[1].with_(dtype="bfloat16")
    out[-1] = out[-1].with_(dtype="bfloat16", kv_heads=1)
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_windows_match_oracle(pools, method, world):
    cases = [c for base in window_cases(world, full=world == 4) for c in method_cases(method, world, base)]
    assert_all_ok(run_cases(pools(world), cases))


def test_windows_with_documents_and_lse_gradient(pools):
    cu = (0, 3, 4, 15, 24)
    base = Case(seq_len=24, heads=4, kv_heads=2, head_dim=8, cu_seqlens=cu, lse_grad=True)
    cases = [c for causal, w in ((True, (5, -1)), (False, (1, 4))) for m in ("ring", "allgather")
             for c in method_cases(m, 4, base.with_(causal=causal, window=w))]
    assert_all_ok(run_cases(pools(4), cases))


@pytest.mark.parametrize("world", [4, 8])
def test_ring_truncates_when_the_window_is_shorter_than_the_ring(world):
    """Note [Ring truncation]: contiguous causal with left window w needs ceil(w / L) + 1 steps."""
    L = 6
    S = L * world
    lay = Contiguous(world)
    for w, steps in ((0, 1), (1, 2), (L - 1, 2), (L, 2), (L + 1, 3), (2 * L + 3, 4)):
        sched = _passkv.schedule(lay, 0, S, Rule(True, (w, -1)), None, None)
        assert sched.n_steps == min(world, steps), (w, sched.n_steps)
    full = _passkv.schedule(lay, 0, S, Rule(True), None, None)
    assert full.n_steps == world
    for w in (1, world - 1, 2 * world):              # stripe: a window of w tokens spans w + 1 ranks
        stripe = _passkv.schedule(Stripe(world), 0, S, Rule(True, (w, -1)), None, None)
        assert stripe.n_steps == min(world, w + 1), (w, stripe.n_steps)


@pytest.mark.parametrize("layout_cls", [Contiguous, Zigzag])
def test_allgather_plan_reads_only_the_window(layout_cls):
    world, S = 4, 48
    lay = layout_cls(world)
    for causal, (left, right) in windows(S // world):
        for r in range(world):
            q_pos = lay.segments(r, S).positions()
            gp = gather_plan(lay, r, S, Rule(causal, (left, right)), None, None)
            for t in gp.tasks:
                first, last = q_pos[t.q_start], q_pos[t.q_stop - 1]
                keys = gp.key_positions(t)
                if left >= 0:
                    assert keys[0] >= first - left, (r, t, left)
                hi = 0 if causal else right
                if hi >= 0:
                    assert keys[-1] <= last + hi, (r, t, right)
