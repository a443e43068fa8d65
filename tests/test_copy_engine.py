"""The copy-engine ring's CPU-side contract (Note [Copy-engine ring] in ``seqpar.comm.symmetric``); its transfers
run on GPUs only: ``tests/test_gpu_copy_engine.py``."""

import pytest
import torch

from seqpar.comm import symmetric


def test_an_exchange_waits_for_its_pushes_and_its_p2p_alike(pools):
    """A push posted beside send/recv pairs in one exchange is awaited too (its handle once went missing when the
    pairs were posted after it: a capture then failed with unjoined work, and eager results raced)."""
    from _workers_copy_engine import mixed_exchange

    got = pools(2).run(mixed_exchange)
    for rank, r in enumerate(got):
        assert r["posted"] == 1 and r["waited"] == 1, r
        assert r["got"] == [float(1 - rank)] * 2 and r["landed"] == [7.0] * 3, r


@pytest.mark.parametrize("world", [2, 3])
def test_a_default_group_made_again_plans_anew_with_lanes_of_its_own(tmp_path, world):
    """A process that destroys its default group and makes it again (an elastic restart, the fail-fast recipe of
    docs/RELIABILITY.md) calls with ``mesh=None`` as before: the new group's calls plan anew and make their own
    copy-engine lanes, equal to the first group's results. Planned calls and lanes were once found by the default
    group's name alone, which a re-created group keeps: the second group's first call raised that its ring's group
    was destroyed."""
    from _workers_copy_engine import across_a_new_default_group
    from conftest import new_pool

    with new_pool(world, timeout=120) as pool:
        got = pool.run(across_a_new_default_group, str(tmp_path))
    for rank, (before, after) in enumerate(got):
        assert all(torch.equal(a, b) for a, b in zip(before, after)), f"rank {rank}: the second group's results differ"
        assert torch.equal(before[0], before[2]) and torch.equal(before[1], before[3]), \
            f"rank {rank}: the ring on copy engines differs from the ring on gloo"


def test_lane_buffers_are_carved_aligned_in_order():
    """Receive buffers sit at ALIGN-aligned offsets, in the order asked, the same on every rank (a peer's copy of a
    buffer is found at its offset): carved from a plain tensor, as ``Lane.carve`` carves the symmetric one."""
    lane = symmetric.Lane.__new__(symmetric.Lane)
    specs = [((1, 3, 2, 5), torch.bfloat16), ((7,), torch.float32), ((2, 2), torch.float64)]
    nbytes = symmetric.span(specs)
    assert nbytes == 3 * symmetric.ALIGN
    lane.buf, lane.nbytes, lane.device = torch.zeros(nbytes, dtype=torch.uint8), nbytes, torch.device("cpu")
    views = lane.carve(specs)
    base = lane.buf.data_ptr()
    assert [(tuple(v.shape), v.dtype) for v in views] == [(s, d) for s, d in specs]
    assert [v.data_ptr() - base for v in views] == [0, 256, 512]
    assert all(v.is_contiguous() for v in views)
    assert all(lane.holds(v) for v in views) and not lane.holds(torch.zeros(3))


@pytest.mark.parametrize("case, etype, words", [
    ("alloc", "RuntimeError", ["could not allocate 1024 bytes of symmetric memory", "group rank(s) [1]",
                               "no IPC in this container", "pass transport='nccl'"]),
    ("hosts", "ValueError", ["needs every rank of the group on one host", "['host0', 'host1']",
                             "pass transport='nccl'"]),
])
def test_a_lane_that_cannot_be_made_fails_on_every_rank_alike(pools, case, etype, words):
    """A rank whose symmetric allocation fails, or a group over two hosts: every rank raises the same clear error
    before the rendezvous (which would wait for the failed rank until the store times out)."""
    from _workers_copy_engine import lane_error

    for rank, (name, msg) in enumerate(pools(2).run(lane_error, case)):
        assert name == etype, (rank, name, msg)
        for w in [*words, f"rank {rank} of 2"]:
            assert w in msg, (rank, w, msg)


def test_auto_takes_the_nccl_transport_on_cpu(pools):
    """``method="auto", transport="nccl"`` is auto as usual (the option says what auto may use): correct against
    the oracle on gloo; ``transport="copy_engine"`` there is refused by name (tests/test_bad_input.py)."""
    from conftest import assert_all_ok, run_cases

    from seqpar.testing.cases import Case

    assert_all_ok(run_cases(pools(2), [Case(method="auto", seq_len=64, options=(("transport", "nccl"),))]))


def test_one_lane_per_use_grown_only_for_a_larger_call(monkeypatch):
    """Calls of changing lengths share one lane per (group, device, use), made again only when a call needs more
    (Note [Lanes are shared]): symmetric memory stays bounded by the largest call, not by the number of lengths."""
    made = []

    class FakeLane:
        def __init__(self, group, device, nbytes):
            self.nbytes = nbytes
            made.append(nbytes)

    class FakeGroup:
        group_name = "g"

    monkeypatch.setattr(symmetric, "Lane", FakeLane)
    monkeypatch.setattr(symmetric, "_LANES", {})
    dev = torch.device("cpu")
    spec = lambda n: [((n,), torch.uint8)]                       # noqa: E731
    sizes = [1024, 512, 4096, 2048, 4096, 1024]
    group = FakeGroup()
    lanes = [symmetric.lane(group, dev, spec(n), "kv") for n in sizes]
    assert made == [1024, 4096]                                  # grown once, at the first larger call
    assert [lane.nbytes for lane in lanes] == [1024, 1024, 4096, 4096, 4096, 4096]
    other = symmetric.lane(group, dev, spec(512), "home")        # another use: a lane of its own
    assert made == [1024, 4096, 512] and other not in lanes
    # a group made again under the same name (a default group destroyed and re-created) gets lanes of its own, and
    # the dead group's lanes are dropped when the next lane is made
    del group
    again = FakeGroup()
    assert symmetric.lane(again, dev, spec(1024), "kv") not in lanes and made[-1] == 1024
    assert [(k[0].id, *k[1:]) for k in symmetric._LANES] == [(id(again), dev, "kv")]


def test_home_regions_hold_each_step_block_in_the_wider_dtype_within_the_limit(monkeypatch):
    """The regions a copy-engine ring's backward receives partials into (Note [Copy-engine ring]): per step after the
    first, one for dK and one for dV, each the whole block in the wider of the inputs' and the wire's dtype, all at
    rank-independent sizes; none (the partials go over NCCL) past ``COPY_HOME_BYTES`` or on an NCCL ring."""
    from seqpar.methods import _passkv

    asked = []

    class FakeRing:
        copies = True

        def buffers(self, specs, device, tag):
            asked.append((specs, tag))
            return [torch.empty(s, dtype=d) for s, d in specs]

    engine = _passkv.PassKV.__new__(_passkv.PassKV)
    engine.ring = FakeRing()
    k, v = torch.empty(1, 16, 2, 8, dtype=torch.bfloat16), torch.empty(1, 16, 2, 4, dtype=torch.bfloat16)
    regions = engine._home_regions(k, v, torch.float32, 4)
    assert len(regions) == 6 and asked[-1][1] == "home"
    assert [r.numel() for r in regions[:2]] == [16 * 2 * 8 * 4, 16 * 2 * 4 * 4]        # fp32 wire: 4 bytes each
    assert engine._home_regions(k, v, torch.bfloat16, 4)[0].numel() == 16 * 2 * 8 * 2
    monkeypatch.setattr(_passkv, "COPY_HOME_BYTES", 3 * (k.numel() + v.numel()) * 4 - 1)
    assert engine._home_regions(k, v, torch.float32, 4) is None
    engine.ring.copies = False
    monkeypatch.setattr(_passkv, "COPY_HOME_BYTES", 1 << 40)
    assert engine._home_regions(k, v, torch.float32, 4) is None


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_posts_each_lane_alike_when_a_step_has_no_partial(pools, world):
    """Documents whose last chunk is a document of its own: at W = 2 rank 0's step-1 partial is empty (its chunk 3
    sees no key of chunks 1-2), rank 1's is not. Every rank must still post the home lane at that hop, since a
    lane's barriers pair up across ranks: a rank that skipped it left its peers waiting forever (a backward over
    documents hung so on four H100s)."""
    from _workers_copy_engine import lane_posts

    seq = 16 * world
    posts = pools(world).run(lane_posts, [0, seq - seq // (2 * world), seq])
    assert all(p == posts[0] for p in posts) and posts[0].get("home", 0) > 0, posts


def _gloo_cases(world: int):
    from seqpar.testing.cases import Case

    base = Case(method="ring", seq_len=32 * world, heads=4, kv_heads=2, head_dim=8, deterministic=True)
    docs = (0, 3 * world, 10 * world, 32 * world)
    return [base, base.with_(layout="contiguous", causal=False), base.with_(dtype="bfloat16"),
            base.with_(cu_seqlens=docs), base.with_(cu_seqlens=(0, 28 * world, 32 * world)),
            base.with_(layout="stripe", options=(("head_chunks", 2),)),
            base.with_(heads=4, kv_heads=4, window=(20 * world // 2, 0), layout="contiguous"),
            base.with_(lse_grad=True, cu_seqlens=docs, layout="balanced"),
            base.with_(layout="balanced_whole", cu_seqlens=docs)]


def _copy_engines_agree(pool, case, short: bool, calls: int, pulls: bool = False) -> None:
    """``case`` on ``pool`` with ``transport="copy_engine"`` over gloo lanes (``gloo_lane_calls``): ``calls`` calls of
    one plan, each within the dense oracle's tolerance and bitwise equal to the case's one call on gloo alone, and
    the lanes posted (else the transfers went over gloo's own P2P); with ``pulls`` the all-to-alls pulled on the
    lanes, else none pulled."""
    from _workers_copy_engine import gloo_lane_calls
    from _workers_ulysses import run_calls

    from seqpar.testing.cases import check_case

    want = [r[0] for r in pool.run(run_calls, short, case, 1)]
    copy = case.with_(options=tuple(sorted({**dict(case.options), "transport": "copy_engine"}.items())))
    res = pool.run(gloo_lane_calls, short, copy, calls)
    assert all(r[-1]["lane_posts"] > 0 for r in res), [r[-1]["lane_posts"] for r in res]
    assert all((r[-1]["lane_pulls"] > 0) == pulls for r in res), (pulls, [r[-1]["lane_pulls"] for r in res])
    for t in range(calls):
        got = [r[t] for r in res]
        report = check_case(case, got)
        assert report.ok, f"call {t}: {report}"
        for rank, (g, w) in enumerate(zip(got, want)):
            for f in ("out", "lse", "dq", "dk", "dv"):
                assert torch.equal(g[f], w[f]), f"{copy.label()} call {t}: rank {rank}'s {f} differs from gloo's"


@pytest.mark.parametrize("short", [False, True], ids=["running-sums", "partials-home"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_copy_engine_schedule_on_gloo_equals_the_ring(pools, world, short):
    """The copy-engine ring's whole schedule - K/V pushed into the peers' receive buffers, the backward's partials
    home into byte regions, the lanes shared and grown across cases - run on CPU with each lane's pushes delivered
    over gloo (``_GlooLane``: every post pairs up across ranks, as the GPUs' barriers do, and a rank at another post
    raises): every case agrees with the dense oracle and, bit for bit, with the ring on gloo P2P. The GPUs' own
    transfers: tests/test_gpu_copy_engine.py."""
    pool = pools(world)
    for case in _gloo_cases(world):
        _copy_engines_agree(pool, case, short, 1)


def _ulysses_cases(world: int):
    from seqpar.testing.cases import Case

    base = Case(method="ulysses", layout="contiguous", seq_len=16 * world, heads=2 * world, kv_heads=world,
                head_dim=8, deterministic=True)
    return [base, base.with_(causal=False, dtype="bfloat16"), base.with_(kv_heads=1, lse_grad=True),
            base.with_(cu_seqlens=(0, 5 * world, 16 * world), sinks=True),
            base.with_(heads=4 * world, kv_heads=2 * world, options=(("head_chunks", 2),)),
            base.with_(value_dim=4, window=(6 * world, 0))]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_all_to_alls_on_copy_engines_equal_nccl_on_gloo(pools, world):
    """Ulysses with ``transport="copy_engine"`` (Note [Copy-engine all-to-all]), its lanes stood in for over gloo: the
    plan's first call runs on the group's all-to-all and makes the lane as it ends, the next calls pull every slot
    from the peers' send buffers (head groups in flight at once in regions of their own, replicated KV heads,
    lse and dlse, sinks): every call bitwise equal to Ulysses on gloo, and judged against the dense oracle."""
    pool = pools(world)
    for case in _ulysses_cases(world):
        _copy_engines_agree(pool, case, False, 3, pulls=True)


@pytest.mark.parametrize("short", [False, True], ids=["running-sums", "partials-home"])
def test_usp_on_copy_engines_equals_nccl_on_gloo(pools, short):
    """USP with ``transport="copy_engine"`` over 4 ranks, its lanes stood in for over gloo: Ulysses 2 x ring 2 pushes
    the ring's hops and partials and leaves the all-to-alls on the group's own collective (measured faster); Ulysses
    4 x ring 1 has no ring, and pulls its all-to-alls as Ulysses does - every call bitwise equal to USP on gloo and
    judged against the dense oracle."""
    from seqpar.testing.cases import Case

    base = Case(method="usp", layout="zigzag", ulysses=2, seq_len=64, heads=4, kv_heads=2, head_dim=8,
                deterministic=True)
    pool = pools(4)
    for case in (base, base.with_(cu_seqlens=(0, 12, 52, 64), lse_grad=True, options=(("head_chunks", 2),)),
                 base.with_(layout="contiguous", causal=False, dtype="bfloat16", ulysses=4)):
        _copy_engines_agree(pool, case, short, 2, pulls=case.ulysses == 4)
