"""Cross-rank agreement: ranks that make different calls raise the same clear error on every rank, never hang.

Every spec runs on every rank of a pool with a short run timeout: a hang fails the test instead of stalling it.
The message must be identical on every rank (up to the rank suffix), name the rank that differs and how.
Attention specs pass ``check_ranks=1`` (a round on every call, read at once: these are disagreements on one
call); when the round runs otherwise, and what a disagreement then costs, is tested on fresh groups below
(Note [When the round is read]).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _workers_reliability import call_specs, round_cost
from conftest import strip_rank

import seqpar
from seqpar import agreement

Q, KV = (1, 8, 4, 16), (1, 8, 2, 16)
OK = {"q": Q, "k": KV, "v": KV}
RUN_TIMEOUT = 180          # seconds per pool call: generous for a loaded 2-core machine, finite for a hang


def _spec(per_rank=None, kwargs=None, shapes=None, kind="attention", **extra):
    every = {"check_ranks": 1} if kind == "attention" else {}
    return {"kind": kind, "shapes": shapes or OK, "kwargs": {**every, **(kwargs or {})}, "per_rank": per_rank or {},
            **extra}


# (what, spec, words every accepting rank's message must contain)
DISAGREE_W3 = [
    ("kv heads", _spec({2: {"shapes": {"k": (1, 8, 1, 16), "v": (1, 8, 1, 16)}}}),
     ["rank 2 has k shape (1, 8, 1, 16) where ranks 0-1 have (1, 8, 2, 16)", "rank 2 has v shape"]),
    ("dtype", _spec({2: {"dtypes": {"q": "bfloat16", "k": "bfloat16", "v": "bfloat16"}}}),
     ["rank 2 has q dtype torch.bfloat16 where ranks 0-1 have torch.float32"]),
    ("local length", _spec({0: {"shapes": {"q": (1, 4, 4, 16), "k": (1, 4, 2, 16), "v": (1, 4, 2, 16)}}}),
     ["rank 0 has q shape (1, 4, 4, 16) where ranks 1-2 have (1, 8, 4, 16)"]),
    ("causal", _spec({2: {"kwargs": {"causal": False}}}), ["rank 2 has causal False where ranks 0-1 have True"]),
    ("window", _spec({1: {"kwargs": {"window_size": (3, 0)}}}),
     ["rank 1 has window_size (3, 0) where ranks 0, 2 have (-1, -1)"]),
    ("documents", _spec({2: {"kwargs": {"cu_seqlens": [0, 12, 24]}}}, {"cu_seqlens": [0, 10, 24]}),
     ["rank 2 has cu_seqlens (0, 12, 24) where ranks 0-1 have (0, 10, 24)"]),
    ("method", _spec({2: {"kwargs": {"method": "ulysses"}}}, {"layout": "contiguous"}),
     ["rank 2 has method 'ulysses' where ranks 0-1 have 'ring'"]),
    ("layout", _spec({2: {"kwargs": {"layout": "stripe"}}}),
     ["rank 2 has layout 'stripe' where ranks 0-1 have 'zigzag'"]),
    ("scale", _spec({2: {"kwargs": {"softmax_scale": 0.5}}}),
     ["rank 2 has softmax_scale 0.5 where ranks 0-1 have None"]),
    ("kernel", _spec({2: {"kwargs": {"kernel": "reference"}}}),
     ["rank 2 has kernel 'reference' where ranks 0-1 have 'auto'"]),
    ("kernel that cannot serve", _spec({2: {"kwargs": {"kernel": "cudnn"}}}),
     ["rank 2 has kernel 'cudnn' where ranks 0-1 have 'auto'"]),
    ("padding", _spec({2: {"kwargs": {"seq_len": 20}}}), ["rank 2 has seq_len 20 where ranks 0-1 have None"]),
    ("deterministic", _spec({0: {"kwargs": {"deterministic": True}}}),
     ["rank 0 has deterministic True where ranks 1-2 have False"]),
    ("backward on some ranks", _spec({2: {"grad": False}}), ["rank 2 has backward False where ranks 0-1 have True"]),
    ("return_lse", _spec({1: {"kwargs": {"return_lse": True}}}),
     ["rank 1 has return_lse True where ranks 0, 2 have False"]),
    ("verify", _spec({1: {"kwargs": {"verify": True}}}), ["rank 1 has verify True where ranks 0, 2 have False"]),
    ("grad dtype", _spec({2: {"kwargs": {"grad_dtype": torch.bfloat16}}}),
     ["rank 2 has grad_dtype torch.bfloat16 where ranks 0-1 have torch.float32"]),
    ("two ranks, two ways", _spec({0: {"kwargs": {"causal": False}}, 2: {"kwargs": {"window_size": (2, 0)}}}),
     # no majority: the lowest rank is the reference
     ["rank 1 has causal True where rank 0 has False", "rank 2 has window_size (2, 0) where rank 0 has (-1, -1)"]),
]

# a rank whose local validation fails: it raises its own error, the others name it
REJECT_W3 = [
    ("3D tensor on rank 1", _spec({1: {"shapes": {"q": (8, 4, 16)}}}), 1, "ValueError", "4D"),
    ("unknown method on rank 1", _spec({1: {"kwargs": {"method": "spiral"}}}), 1, "ValueError", "spiral"),
    ("bad window on rank 0", _spec({0: {"kwargs": {"window_size": (-3, 0)}}}), 0, "ValueError", "window_size"),
    ("unknown option on rank 2", _spec({2: {"kwargs": {"heads_k_stride": 2}}}), 2, "TypeError", "heads_k_stride"),
    ("odd length on rank 2", _spec({2: {"shapes": {"q": (1, 7, 4, 16), "k": (1, 7, 2, 16), "v": (1, 7, 2, 16)}}}),
     2, "ValueError", "local sequence length"),
]


def _assert_same_error(what, reports, world, words, exc="RankDisagreementError"):
    msgs = []
    for rank, rep in enumerate(reports):
        assert rep is not None, f"{what}: rank {rank} raised nothing"
        name, msg = rep
        assert name == exc, f"{what}: rank {rank} raised {name}: {msg}"
        assert f"(rank {rank} of {world})" in msg, f"{what}: rank {rank} message lacks its rank: {msg}"
        assert msg.startswith("ranks disagree on the call: "), msg
        for w in words:
            assert w in msg, f"{what}: rank {rank} message lacks {w!r}: {msg}"
        msgs.append(strip_rank(msg))
    assert len(set(msgs)) == 1, f"{what}: ranks raised different messages: {msgs}"


def test_every_disagreement_raises_the_same_error_on_every_rank(pools):
    results = pools(3).run(call_specs, [s for _, s, _ in DISAGREE_W3], timeout=RUN_TIMEOUT)
    for i, (what, _, words) in enumerate(DISAGREE_W3):
        _assert_same_error(what, [r[i] for r in results], 3, words)


def test_a_rank_that_rejects_the_call_is_named_by_the_others(pools):
    results = pools(3).run(call_specs, [s for _, s, *_ in REJECT_W3], timeout=RUN_TIMEOUT)
    for i, (what, _, bad, exc, word) in enumerate(REJECT_W3):
        for rank, rep in enumerate(r[i] for r in results):
            assert rep is not None, f"{what}: rank {rank} raised nothing"
            name, msg = rep
            if rank == bad:
                assert name == exc and word in msg, f"{what}: rank {rank} raised {name}: {msg}"
            else:
                assert name == "RankDisagreementError", f"{what}: rank {rank} raised {name}: {msg}"
                assert f"rank {bad} rejected it with {exc}" in msg and word in msg, msg
                assert f"(rank {rank} of 3)" in msg, msg


def test_a_changed_signature_after_agreed_calls_is_caught_and_the_group_stays_usable(pools):
    """Repeated identical calls (the digest cache) then one rank changes its input: no rank skips the round."""
    changed = _spec({1: {"shapes": {"q": (1, 8, 4, 8), "k": (1, 8, 2, 8), "v": (1, 8, 2, 8)}}})
    specs = [_spec(), _spec(), changed, _spec()]
    results = pools(3).run(call_specs, specs, timeout=RUN_TIMEOUT)
    for rank, rep in enumerate(results):
        assert rep[0] is None and rep[1] is None and rep[3] is None, f"rank {rank}: {rep}"
    _assert_same_error("changed signature", [r[2] for r in results], 3,
                       ["rank 1 has q shape (1, 8, 4, 8) where ranks 0, 2 have (1, 8, 4, 16)"])


def test_2d_mesh_disagreement_across_both_axes(pools):
    """USP on a 2 x 2 mesh: rank 3 shares neither its Ulysses group nor its ring group with rank 0."""
    specs = [_spec({3: {"kwargs": {"causal": False}}}, {"method": "usp"}, ulysses=2),
             _spec({0: {"shapes": {"q": (1, 8, 4, 16), "k": (1, 8, 1, 16), "v": (1, 8, 1, 16)}}},
                   {"method": "usp"}, ulysses=2),
             _spec({2: {"kwargs": {"method": "spiral"}}}, {"method": "usp"}, ulysses=2)]
    results = pools(4).run(call_specs, specs, timeout=RUN_TIMEOUT)
    _assert_same_error("usp causal", [r[0] for r in results], 4, ["rank 3 has causal False where ranks 0-2 have True"])
    _assert_same_error("usp kv heads", [r[1] for r in results], 4,
                       ["rank 0 has k shape (1, 8, 1, 16) where ranks 1-3 have (1, 8, 2, 16)"])
    for rank, (name, msg) in enumerate(r[2] for r in results):
        want = "ValueError" if rank == 2 else "RankDisagreementError"
        assert name == want and "spiral" in msg, f"rank {rank}: {name}: {msg}"


def test_linear_attention_disagreement_and_rejection(pools):
    lin = {"q": (1, 8, 2, 4), "k": (1, 8, 2, 4), "v": (1, 8, 2, 4)}
    specs = [_spec({2: {"kwargs": {"chunk_size": 4}}}, shapes=lin, kind="linear_attention"),
             _spec({1: {"shapes": {"decay": (3,)}}}, shapes={**lin, "decay": (2,)}, kind="linear_attention"),
             _spec({0: {"kwargs": {"method": "lasp1"}}}, shapes=lin, kind="linear_attention")]
    results = pools(3).run(call_specs, specs, timeout=RUN_TIMEOUT)
    _assert_same_error("chunk size", [r[0] for r in results], 3, ["rank 2 has chunk_size 4 where ranks 0-1 have 64"])
    for rank, (name, msg) in enumerate(r[1] for r in results):
        if rank == 1:
            assert name == "ValueError" and "decay must have shape" in msg, msg
        else:
            assert name == "RankDisagreementError" and "rank 1 rejected it with ValueError" in msg, msg
    _assert_same_error("linear method", [r[2] for r in results], 3,
                       ["rank 0 has method 'lasp1' where ranks 1-2 have 'lasp2'"])


# --- when the round runs (Note [When the round is read]): fresh groups, so every count starts at call 0 -------

TINY = (1, 4, 2, 8)


def _fresh() -> Any:
    return dist.new_group(list(range(dist.get_world_size())))


def _attend(group, i: int, check_ranks: Any, scale: float | None = None) -> None:
    g = torch.Generator().manual_seed(i)
    q, k, v = (torch.randn(*TINY, generator=g) for _ in range(3))
    seqpar.attention(q, k, v, mesh=group, check_ranks=check_ranks, softmax_scale=scale)


def count_rounds(check_ranks: Any, calls: int) -> list[int]:
    """The agreeing path on a fresh group: the calls at which an all-reduce (a round) ran."""
    group, at, real, i = _fresh(), [], dist.all_reduce, 0

    def counted(*a, **kw):
        at.append(i)
        return real(*a, **kw)

    with mock.patch.object(dist, "all_reduce", counted):
        for i in range(calls):
            _attend(group, i, check_ranks)
    return at


class _HostPosted(agreement._Posted):
    """The lazily read round of a device group, on gloo: the same schedule and settling, the result on the host."""

    def __init__(self, values, groups, device, call, mine):
        self.call, self.mine = call, mine
        self.result = agreement._all_reduce_max(values, torch.int64, groups, torch.device("cpu"))

    def values(self) -> list[int]:
        return self.result


def _lazily(fn, *args):
    """``fn(*args)`` with every group taken for a device group (rounds read lazily, as on NCCL) whose collectives
    still run on gloo."""
    real = agreement._all_reduce_max

    def on_host(values, dtype, groups, device):
        return real(values, dtype, groups, torch.device("cpu"))

    with mock.patch.object(agreement, "_device", lambda groups, hint: torch.device("cuda", 0)), \
            mock.patch.object(agreement, "_all_reduce_max", on_host), \
            mock.patch.object(agreement, "_Posted", _HostPosted):
        return fn(*args)


def drift(every: int, k: int, calls: int, lazily: bool) -> tuple[int, str, str] | None:
    """A fresh group, ``check_ranks=every``; from call ``k`` on rank 1 passes another softmax scale (a
    disagreement the methods run through: no collective changes). ``(call, type, message)`` of what this rank
    raised first, or None."""
    def run():
        group = _fresh()
        for i in range(calls):
            try:
                _attend(group, i, every, 0.5 if i >= k and dist.get_rank() == 1 else None)
            except Exception as e:   # the test inspects which call raised what
                return i, type(e).__name__, str(e)
        return None
    return _lazily(run) if lazily else run()


def reject_lazily(every: int, at: int, calls: int) -> list[tuple[int, str, str]]:
    """The tracker alone (no method runs), rounds read lazily: rank 2 rejects call ``at``; what each call raised."""
    def run():
        tracker = agreement.Tracker(_fresh())
        items = (("q shape", TINY),)
        raised = []
        for i in range(calls):
            try:
                if i == at and dist.get_rank() == 2:
                    tracker.share_error(ValueError("q must be 4D (rank 2 of 3)"), every)
                    raise ValueError("q must be 4D (rank 2 of 3)")
                tracker.round(items, every=every, device=None)
            except Exception as e:   # the test inspects which call raised what
                raised.append((i, type(e).__name__, str(e)))
        return raised
    return _lazily(run)


def test_the_round_runs_on_the_first_call_and_every_n_calls(pools):
    """No per-call collective in steady state: check_ranks=True is a round every CHECK_EVERY calls, N every N,
    1 every call, False never; the group's first call always has one."""
    from seqpar.runtime.call import CHECK_EVERY

    pool = pools(2)
    assert pool.run(count_rounds, True, CHECK_EVERY + 2, timeout=RUN_TIMEOUT) == [[0, CHECK_EVERY]] * 2
    assert pool.run(count_rounds, 4, 10, timeout=RUN_TIMEOUT) == [[0, 4, 8]] * 2
    assert pool.run(count_rounds, 1, 3, timeout=RUN_TIMEOUT) == [[0, 1, 2]] * 2
    assert pool.run(count_rounds, False, 3, timeout=RUN_TIMEOUT) == [[]] * 2
    # read lazily (a device group): every N // 2 calls, so that a round is settled within N calls
    assert pool.run(_lazily, count_rounds, 4, 10, timeout=RUN_TIMEOUT) == [[0, 2, 4, 6, 8]] * 2


@pytest.mark.parametrize("lazily", [False, True], ids=["read-at-once", "read-lazily"])
def test_a_disagreement_from_call_k_raises_on_every_rank_by_call_k_plus_n(pools, lazily):
    """Every rank raises the same named error at the same call, no later than k + N - 1: from a round read at
    once (gloo), or settled at the next round (NCCL), whichever call k falls on."""
    N, pool = 4, pools(3)
    for k in (1, 4, 5, 7):
        results = pool.run(drift, N, k, k + 2 * N, lazily, timeout=RUN_TIMEOUT)
        calls = {r[0] for r in results if r is not None}
        assert len(calls) == 1 and None not in results, f"k={k}: ranks raised at different calls: {results}"
        call = calls.pop()
        assert k <= call <= k + N - 1, f"k={k}: raised at call {call}"
        _assert_same_error(f"k={k}", [r[1:] for r in results], 3,
                           ["rank 1 has softmax_scale 0.5 where ranks 0, 2 have None"])
        if lazily:
            assert all("found at its next round" in r[2] for r in results), results


def test_a_rank_that_rejects_a_lazily_read_round_is_named_at_the_next_round(pools):
    """Rank 2 rejects call 2 (a round read lazily): it raises its own error there; at the next round (call 4)
    every rank raises the same error naming it, and the group goes on."""
    results = pools(3).run(reject_lazily, 4, 2, 6, timeout=RUN_TIMEOUT)
    for rank, raised in enumerate(results):
        mine = [(i, name) for i, name, _ in raised]
        want = [(4, "RankDisagreementError")] if rank != 2 else [(2, "ValueError"), (4, "RankDisagreementError")]
        assert mine == want, f"rank {rank}: {raised}"
    msgs = [strip_rank(raised[-1][2]) for raised in results]
    assert len(set(msgs)) == 1 and "rank 2 rejected it with ValueError: q must be 4D" in msgs[0], msgs
    assert "call 2 of this group" in msgs[0], msgs


@pytest.mark.parametrize("world", [2])
def test_round_cost_on_gloo_is_small(pools, world):
    """The agreeing round costs a CPU all-reduce of 32 bytes (benchmarks/bench_agreement.py records it)."""
    us = pools(world).run(round_cost, 200, timeout=RUN_TIMEOUT)
    assert max(us) < 20_000, f"agreement round took {max(us):.0f} us per call on gloo"
