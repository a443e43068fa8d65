"""TASP against the dense oracle (out, lse, dq, dk, dv), both schedules, and its input checks."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_all_ok, run_cases

from seqpar.testing import Case, case_error

M = "tasp"


def _grid(world: int, schedule: str) -> list[Case]:
    seq = 2 * world * max(world - 1, 1) * (2 if world < 4 else 1)
    kw = {"method": M, "seq_len": seq, "heads": 4, "head_dim": 8, "seed": world, "options": (("schedule", schedule),)}
    cases = [Case(layout="zigzag", causal=True, kv_heads=2, dtype="float32", **kw),
             Case(layout="zigzag", causal=False, kv_heads=4, dtype="bfloat16", **kw)]
    if schedule != "cycles":
        cases += [Case(layout="zigzag", causal=True, kv_heads=1, dtype="bfloat16", batch=2, **kw),
                  Case(layout="contiguous", causal=False, kv_heads=2, dtype="float32", **kw)]
    return cases


@pytest.mark.parametrize("world", [1, 2, 4, 5, 6, 8, 3])     # ends with the pools the next tests use
def test_tasp_matches_oracle(pools, world):
    schedules = ["auto" if world == 2 else "direct"] + ([] if world in (4, 6) else ["cycles"])
    assert_all_ok(run_cases(pools(world), [c for s in schedules for c in _grid(world, s)]))


@pytest.mark.parametrize("world,seq", [(4, 32), (5, 50), (8, 128), (8, 32)])
def test_tasp_uneven_sub_chunks_match_oracle(pools, world, seq):
    """Lengths the layout splits but not into equal sub-chunks (Note [Uneven sub-chunks]): parts a row apart (at
    8 x 32, pieces of 2 rows in 7 parts: empty ones), both schedules where the group has cycles, causal and not,
    GQA, bf16."""
    schedules = ["direct"] + ([] if world in (4, 6) else ["cycles"])
    kw = {"method": M, "seq_len": seq, "heads": 4, "head_dim": 8, "seed": world}
    cases = [Case(layout="zigzag", causal=True, kv_heads=2, options=(("schedule", s),), **kw) for s in schedules]
    cases += [Case(layout="zigzag", causal=False, kv_heads=4, dtype="bfloat16", options=(("schedule", "direct"),),
                   **kw),
              Case(layout="contiguous", causal=False, kv_heads=1, options=(("schedule", "direct"),), **kw)]
    assert_all_ok(run_cases(pools(world), cases))


def test_uneven_sub_chunks_are_a_row_apart():
    from seqpar.layouts import make_layout
    from seqpar.layouts.subchunks import Subchunked

    lay = Subchunked(8, base=make_layout("zigzag", 8), parts=7)
    rows = lay.piece_rows(2048)                                 # 16K tokens over 8: no padding
    sizes = [b - a for sub in rows for a, b in sub]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 2048 and lay.divisor == 16
    for piece in zip(*rows):                                    # each piece's parts tile it in order
        assert piece[0][0] in (0, 1024) and all(x[1] == y[0] for x, y in itertools.pairwise(piece))


def test_slowest_rank():
    """Zigzag gives TASP's ranks the same pairs but not the same calls: the bench emulates a rank between the
    ends (``Method.slowest_rank``), the one with the most calls, then tiles - rank 1 (thin all-query calls), in
    the rounds' plan at 16K tokens per rank and in the gathered one at 2K (Notes [TASP forward at short chunks],
    [TASP backward at short chunks]: both passes run it); without a mask every rank runs one call a round and the
    first ties win."""
    from seqpar.layouts import Rule
    from seqpar.methods import get

    slowest = get(M).slowest_rank
    assert slowest("zigzag", 8, 16384, Rule(True)) == 1 and slowest("zigzag", 4, 16384, Rule(True)) == 1
    assert slowest("zigzag", 8, 1 << 17, Rule(True)) == 1                 # 16K per rank: the rounds' plan
    assert slowest("contiguous", 8, 16384, Rule(False)) == 0


def test_gathered_forward_joins_thin_rounds():
    """Note [TASP forward at short chunks]: at 2K tokens per rank over 8, rank 1's all-query pieces (146 keys a
    round) run as one call over the rounds, its back-query pieces (12288 keys) in keys // ``GATHER_ROWS`` calls (one)
    - 2 calls where its rounds ran 14; at 8K tokens per rank over 4, rank 1's 16384 back-query keys in two calls,
    the first once its share has arrived; every key row of the buffer is some call's, once per query range; longer
    chunks and the cycles keep the rounds' own calls."""
    from seqpar.layouts import Rule
    from seqpar.methods import _tasp, tasp

    layout, _ = tasp._placement("zigzag", tasp.GroupSizes(8))
    tp = _tasp.schedule(layout, 1, 16384, Rule(True), None, None, "direct", _tasp.gathers(16384, 8))
    g = tp.gathered
    assert [len(ts) for ts in g.tasks] == [0] * 6 + [2] and sum(len(rd.tasks) for rd in tp.rounds) == 14
    back = [t.cols for ts in g.tasks for t in ts if t.q == slice(1024, 2048)]
    assert len(back) == max(1, sum(back) // _tasp.GATHER_ROWS) == 1
    front = [t for ts in g.tasks for t in ts if t.q == slice(0, 2048)]
    assert len(front) == 1 and front[0].cols == sum(p.rows[1] - p.rows[0] for rd in tp.rounds for p in rd.held
                                                    if p.origin == 0)
    cover = sorted((t.k_start, t.k_stop) for ts in g.tasks for t in ts)
    assert cover[0][0] == 0 and cover[-1][1] == g.rows and all(a[1] == b[0] for a, b in itertools.pairwise(cover))
    g4 = _tasp.schedule(tasp._placement("zigzag", tasp.GroupSizes(4))[0], 1, 32768, Rule(True), None, None, "direct",
                        True).gathered
    back = [(t, s) for s, ts in enumerate(g4.tasks, 1) for t in ts if t.q == slice(4096, 8192)]
    assert sum(t.cols for t, _ in back) == 16384 and [s for _, s in back] == [2, 3]
    assert not _tasp.gathers(1 << 17, 8)                                    # 16K tokens per rank
    mha, gqa = (_tasp.held_row_bytes(1, h, 128, 128, torch.bfloat16) for h in (32, 8))   # bytes held: GATHER_BYTES
    assert _tasp.gathers(32768, 8, mha) and not _tasp.gathers(65536, 8, mha) and _tasp.gathers(65536, 8, gqa)
    assert _tasp.schedule(layout, 1, 16384, Rule(True), None, None, "direct", False).gathered is None
    assert _tasp.schedule(layout, 1, 16384, Rule(True), None, None, "cycles", True).gathered is None


@pytest.mark.parametrize("world,seq", [(8, 16384), (4, 16384), (5, 400), (8, 48 * 8)])
def test_gathered_backward_returns_agree(world, seq):
    """Note [TASP backward at short chunks]: the gathered plan's calls cover every key row of the buffer, every held
    piece's partial goes home, and the partials' one exchange agrees on both ends of every link - what r sends o,
    in order, is what o receives from r, piece by piece, with the same tasks (which decide the link's dtype)."""
    from seqpar.layouts import Rule
    from seqpar.methods import _tasp, tasp

    layout, _ = tasp._placement("zigzag", tasp.GroupSizes(world))
    plans = [_tasp.schedule(layout, r, seq, Rule(True), None, None, "direct", True) for r in range(world)]
    for r, tp in enumerate(plans):
        g = tp.gathered
        cover = _tasp._runs(sorted({(t.k_start, t.k_stop) for ts in g.tasks for t in ts}))
        assert cover == [(0, g.rows)]
        assert sorted(rows for _, rows, _ in g.grad_out) == sorted(rows for ts in g.kv_rows for rows in ts)
        for o, other in enumerate(plans):
            sent = [(b - a, ts) for dst, (a, b), ts in g.grad_out if dst == o]
            came = [(b - a, ts) for src, (a, b), ts in other.gathered.grad_in if src == r]
            assert sent == came, (r, o)


def test_exact_piece_grads_are_the_calls_own_rows():
    """Note [TASP K and V apart]: on an exact link a piece's dK and dV go home as the rows of the one call that covers
    them (views, nothing computed); a piece across calls, or with rows no call covers, is assembled (zeros there)."""
    from seqpar.methods import _tasp

    def rand(n):
        return torch.randn(1, n, 2, 4, dtype=torch.bfloat16)

    parts = [(slice(0, 6), rand(6), rand(6)), (slice(6, 10), rand(4), rand(4)), (slice(12, 15), rand(3), rand(3))]
    dk, dv = _tasp._piece_grads(parts, 2, 5)
    assert dk.data_ptr() == parts[0][1][:, 2:].data_ptr() and dv.data_ptr() == parts[0][2][:, 2:].data_ptr()
    assert dk.shape == dv.shape == (1, 3, 2, 4)
    gap = torch.zeros(1, 2, 2, 4, dtype=torch.bfloat16)
    for i, got in enumerate(_tasp._piece_grads(parts, 4, 14), 1):
        want = torch.cat((parts[0][i][:, 4:], parts[1][i], gap, parts[2][i][:, :2]), 1)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("short", [False, True], ids=["long-chunk-paths", "short-chunk-paths"])
def test_tasp_both_chunk_paths_match_oracle(pools, short):
    """TASP's short- and long-chunk paths (the gathered passes, Notes [TASP forward at short chunks], [TASP backward
    at short chunks]; home partials held or folded each round, Note [TASP sums]), each forced
    (``run_case_short_paths``): both schedules, causal and not, windows, documents, padding, GQA, bf16, the lse
    gradient, at 3 and 4 ranks."""
    from _workers_ulysses import run_case_short_paths

    from seqpar.testing import check_case

    kw = {"method": M, "heads": 4, "kv_heads": 2, "head_dim": 8}
    cases = [Case(layout=lay, causal=causal, seq_len=48, dtype=dt, options=(("schedule", sch),), **kw)
             for sch in ("direct", "cycles") for lay, causal in (("zigzag", True), ("contiguous", False))
             for dt in ("float32", "bfloat16")]
    cases += [Case(layout="zigzag", seq_len=48, window=(7, 0), **kw),
              Case(layout="zigzag", seq_len=48, cu_seqlens=(0, 7, 30, 31, 48), **kw),
              Case(layout="zigzag", causal=False, seq_len=48, valid_len=41, lse_grad=True, dtype="float64", **kw)]
    for world in (3, 4):
        pool = pools(world)
        assert_all_ok([check_case(c, pool.run(run_case_short_paths, short, c)) for c in cases
                       if c.options != (("schedule", "cycles"),) or world != 4])


@pytest.mark.parametrize("schedule", ["direct", "cycles"])
def test_tasp_windows_documents_padding_lse_grad(pools, schedule):
    kw = {"method": M, "seq_len": 36, "heads": 4, "kv_heads": 2, "head_dim": 8,
          "options": (("schedule", schedule),)}
    cases = [Case(layout="zigzag", window=(7, 0), **kw),
             Case(layout="contiguous", causal=False, window=(4, 5), dtype="bfloat16", **kw),
             Case(layout="zigzag", cu_seqlens=(0, 5, 13, 14, 36), **kw),
             Case(layout="zigzag", causal=False, cu_seqlens=(0, 11, 29), valid_len=29, **kw),
             Case(layout="zigzag", valid_len=30, lse_grad=True, **kw),
             Case(layout="contiguous", causal=False, valid_len=20, **kw),   # rank 2 is all padding
             Case(layout="zigzag", batch=2, dtype="float64", scale=0.4, **kw)]
    assert_all_ok(run_cases(pools(3), cases))


@pytest.mark.parametrize("options,layout,causal,seq,match", [
    ((("schedule", "cycles"),), "zigzag", True, 24, "schedule='cycles' needs a group size with a Hamiltonian"),
    ((), "contiguous", True, 24, "causal=True needs layout='zigzag'"),
    ((("schedule", "ring"),), "zigzag", True, 24, "schedule must be one of"),
    ((("chunks", 3),), "zigzag", True, 24, "method='tasp' takes options"),
    ((), "zigzag", True, 28, "must be a multiple of 8 for the zigzag layout over 4 ranks with every piece cut"),
    ((), "stripe", False, 24, "layout must be one of"),
])
def test_tasp_rejects_what_it_cannot_serve(pools, options, layout, causal, seq, match):
    case = Case(method=M, layout=layout, causal=causal, seq_len=seq, options=options)
    for kind, msg in pools(4).run(case_error, case):
        assert kind and match in msg, (kind, msg)
