"""The block planner against a dense mask: every visible pair computed exactly once, nothing else."""

import random

import pytest

from seqpar.layouts import Contiguous, Nested, Rule, Segments, Stripe, Zigzag, group_varlen, plan
from seqpar.layouts.blocks import any_visible, visible_dense
from seqpar.masks import Band, Varlen, bottom_right_window


def _band_cells(task):
    m, n = task.rows, task.cols
    lo, hi = task.mask.lo, task.mask.hi
    return {(task.q_start + i, task.k_start + j) for i in range(m) for j in range(n)
            if (lo is None or j - i >= lo) and (hi is None or j - i <= hi)}


def _varlen_cells(task):
    cells = set()
    cu_q, cu_k, (left, right) = task.mask.cu_q, task.mask.cu_k, task.mask.window
    for s in range(len(cu_q) - 1):
        m, n = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(m):
            for j in range(n):
                d = j - i - (n - m)
                if (left < 0 or d >= -left) and (right < 0 or d <= right):
                    cells.add((task.q_start + cu_q[s] + i, task.k_start + cu_k[s] + j))
    return cells


def _check(qseg: Segments, kseg: Segments, rule: Rule, fewest_calls: bool = True):
    truth = visible_dense(qseg.positions(), kseg.positions(), rule,
                          [r.doc for r in qseg.runs for _ in range(r.length)],
                          [r.doc for r in kseg.runs for _ in range(r.length)])
    want = {(i, j) for i, row in enumerate(truth) for j, v in enumerate(row) if v}
    tasks = plan(qseg, kseg, rule, fewest_calls=fewest_calls)
    assert any_visible(qseg, kseg, rule) == bool(want)          # the ring's step count relies on it
    got: list = []
    for t in tasks:
        assert isinstance(t.mask, Band)
        bottom_right_window(t.mask, t.rows, t.cols)   # every trimmed band is a flash-attn window
        cells = _band_cells(t)
        assert cells, f"task {t} computes nothing"
        got.extend(cells)
    assert len(got) == len(set(got)), "a (query, key) pair is computed twice"
    assert set(got) == want
    grouped = group_varlen(tasks)
    got2 = [c for t in grouped for c in (_varlen_cells(t) if isinstance(t.mask, Varlen) else _band_cells(t))]
    assert len(got2) == len(set(got2)) and set(got2) == want
    return tasks


@pytest.mark.parametrize("layout_cls", [Contiguous, Zigzag, Stripe])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_layouts(layout_cls, world, causal):
    lay = layout_cls(world)
    seq = lay.divisor * 3
    for r in range(world):
        for j in range(world):
            tasks = _check(lay.segments(r, seq), lay.segments(j, seq), Rule(causal))
            assert len(tasks) <= 1, "a plain layout step must be one kernel call"


def test_zigzag_rule():
    """Note [Zigzag load balance]: diagonal causal, j < i front keys only, j > i back queries only."""
    lay, seq = Zigzag(4), 32
    h = 4
    for i in range(4):
        for j in range(4):
            (t,) = plan(lay.segments(i, seq), lay.segments(j, seq), Rule(True))
            if i == j:
                assert (t.q, t.k, t.mask) == (slice(0, 2 * h), slice(0, 2 * h), Band(None, 0))
            elif j < i:
                assert (t.q, t.k, t.mask) == (slice(0, 2 * h), slice(0, h), Band())
            else:
                assert (t.q, t.k, t.mask) == (slice(h, 2 * h), slice(0, 2 * h), Band())


def test_random_documents_windows_and_padding():
    rng = random.Random(0)
    for _ in range(300):
        world = rng.choice([1, 2, 3, 4, 5])
        lay = rng.choice([Contiguous, Zigzag, Stripe])(world)
        seq = lay.divisor * rng.randint(1, 4)
        valid = rng.randint(1, seq)
        cuts = sorted(rng.sample(range(1, valid), min(rng.randint(0, 5), valid - 1))) if valid > 1 else []
        bounds = [0, *cuts, valid]
        left = rng.choice([-1, 0, 1, 3, 7])
        right = rng.choice([-1, 0, 2, 5])
        rule = Rule(rng.random() < 0.5, (left, right))
        r, j = rng.randrange(world), rng.randrange(world)
        _check(lay.segments(r, seq).cut(bounds), lay.segments(j, seq).cut(bounds), rule)


def test_gathered_buffer_and_nested():
    lay = Zigzag(3)
    seq = 24
    gathered = Segments.concat([lay.segments(r, seq) for r in range(3)])
    for r in range(3):
        _check(lay.segments(r, seq), gathered, Rule(True))
    nested = Nested(6, outer=Zigzag(3), inner=2)
    assert sorted(p for r in range(6) for p in nested.segments(r, 24).positions()) == list(range(24))


def test_named_masks_with_and_without_step_six_match_the_dense_mask():
    """Under every named mask, with documents, windows and padding, the plan - with step 6 (the fewer calls of the
    whole and its halves) and without it (what the cost model and the all-gather's reads ask for) - computes every
    visible pair exactly once."""
    from seqpar import masks

    rng = random.Random(3)
    for _ in range(120):
        world = rng.choice([1, 2, 3, 4])
        lay = rng.choice([Contiguous, Zigzag, Stripe])(world)
        seq = lay.divisor * rng.randint(-(-12 // lay.divisor), max(2, 48 // lay.divisor))
        valid = rng.randint(seq // 2, seq)
        cuts = sorted(rng.sample(range(1, valid), min(rng.randint(0, 3), valid - 1)))
        mask = rng.choice([masks.block_causal(rng.randint(2, 7)), masks.sink_window(rng.randint(1, 9), 2),
                           masks.shared_prefix(seq // 3, [seq // 6, seq - seq // 3 - seq // 6]),
                           masks.chunked(rng.randint(2, 9)), masks.prefix_lm(rng.randint(1, seq - 1)),
                           masks.spans([(1, 3), (seq // 2, seq // 2 + 2)])])
        rule = Rule(rng.random() < 0.5, rng.choice([(-1, -1), (rng.randint(0, 6), -1)]), mask=mask)
        r, j = rng.randrange(world), rng.randrange(world)
        q, k = lay.segments(r, seq).cut([0, *cuts, valid]), lay.segments(j, seq).cut([0, *cuts, valid])
        fewest = _check(q, k, rule)
        apart = _check(q, k, rule, fewest_calls=False)
        assert len(group_varlen(fewest)) <= len(group_varlen(apart))


def test_cut_marks_padding():
    seg = Contiguous(2).segments(1, 8).cut([0, 3, 6])
    assert [(r.glob, r.length, r.doc) for r in seg.runs] == [(4, 2, 1), (6, 2, -1)]


def _bounds(rng: random.Random, valid: int, docs: int) -> list[int]:
    return [0, *sorted(rng.sample(range(1, valid), min(docs, valid - 1))), valid]


def test_many_small_documents_match_the_dense_mask():
    """Dozens of documents (empty ones too) per rank, gathered buffers, windows and padding."""
    rng = random.Random(1)
    for _ in range(150):
        world = rng.choice([1, 2, 3, 4, 8])
        lay = rng.choice([Contiguous, Zigzag, Stripe])(world)
        seq = lay.divisor * rng.randint(4, 12)
        valid = rng.randint(seq // 2, seq)
        bounds = _bounds(rng, valid, rng.randint(valid // 4, valid // 2 + 1))
        bounds[1:1] = [bounds[1]] * rng.randint(0, 2)                    # empty documents
        rule = Rule(rng.random() < 0.7, (rng.choice([-1, 0, 2, 9]), rng.choice([-1, 0, 3])))
        r, j = rng.randrange(world), rng.randrange(world)
        q = lay.segments(r, seq).cut(bounds)
        if rng.random() < 0.3:
            k = Segments.concat([lay.segments(x, seq) for x in range(world)]).cut(bounds)
        else:
            k = lay.segments(j, seq).cut(bounds)
        _check(q, k, rule)


def _evaluations(monkeypatch, q: Segments, k: Segments, rule: Rule) -> int:
    """Band evaluations (pair bands and clipped candidates) one plan() makes."""
    from seqpar.layouts import blocks

    count = 0

    def counted(fn):
        def wrapper(*args):
            nonlocal count
            count += 1
            return fn(*args)
        return wrapper

    with monkeypatch.context() as m:
        m.setattr(blocks, "_pair_band", counted(blocks._pair_band))
        m.setattr(blocks, "_clip", counted(blocks._clip))
        plan(q, k, rule)
    return count


@pytest.mark.parametrize("rule", [Rule(True), Rule(False), Rule(True, (64, 0))])
def test_plan_cost_is_linear_in_documents(monkeypatch, rule):
    """Doubling the documents at most ~doubles the band evaluations (the full matrix would quadruple them)."""
    rng = random.Random(2)
    lay, seq = Zigzag(4), 1 << 15
    counts = []
    for docs in (250, 500, 1000):
        bounds = _bounds(rng, seq, docs)
        segs = [lay.segments(r, seq).cut(bounds) for r in range(4)]
        counts.append(sum(_evaluations(monkeypatch, segs[r], segs[(r - s) % 4], rule)
                          for r in range(4) for s in range(4)))
    assert counts[1] <= 2.2 * counts[0] and counts[2] <= 2.2 * counts[1], counts


def test_group_varlen_calls_stay_few_with_many_documents():
    """group_varlen scans its open groups per task: with rows and keys in document order (every layout's own
    rows) a step of 1000 documents packs into a handful of calls, so grouping stays linear in the tasks."""
    from seqpar.layouts import Balanced

    rng = random.Random(3)
    seq = 1 << 15
    bounds = _bounds(rng, seq, 999)
    for lay in (Contiguous(4), Zigzag(4), Stripe(4), Balanced(4, tuple(bounds))):
        segs = [lay.segments(r, seq).cut(bounds) for r in range(4)]
        for rule in (Rule(True), Rule(False), Rule(True, (64, 0)), Rule(False, (16, 16))):
            for r in range(4):
                for s in range(4):
                    tasks = plan(segs[r], segs[(r - s) % 4], rule)
                    assert len(group_varlen(tasks)) <= 6, (lay, rule, r, s)


def test_key_run_groups_end_where_a_scan_of_merged_does():
    """Step 3 of Note [Block planning]: ``_longest`` (one pass, the test kept incrementally) ends a query run's
    group of key runs where a left-to-right scan of ``merged`` ends it, on the grids of random layouts, documents,
    windows and named masks - many key runs per query run included (a staircase of frames against the whole
    sequence)."""
    from seqpar import masks
    from seqpar.layouts import make_layout
    from seqpar.layouts.blocks import Run, _Grid, _longest, split_pieces

    def scan(g, i, mine, start):
        end = start
        while end + 1 < len(mine) and g.merged(i, i, mine[start], mine[end + 1]) is not None:
            end += 1
        return end

    rng = random.Random(5)
    checked = 0
    for _ in range(60):
        W = rng.choice([1, 2, 4])
        S = W * rng.choice([16, 48, 96])
        lay = make_layout(rng.choice(["contiguous", "zigzag"]), W, None)
        mask = rng.choice([None, masks.block_causal(rng.randint(2, 9)), masks.sink_window(rng.randint(1, 20), 2),
                           masks.shared_prefix(S // 3, [S // 6, S - S // 3 - S // 6]),
                           masks.chunked(rng.randint(3, 17)), masks.prefix_lm(rng.randint(1, S - 1)),
                           masks.spans([(1, 4), (S // 2, S // 2 + 3)])])
        window = rng.choice([(-1, -1), (rng.randint(0, S // 2), -1), (rng.randint(0, 9), rng.randint(0, 9))])
        docs = tuple(sorted({0, S, *rng.sample(range(1, S), 2)})) if rng.random() < 0.3 else (0, S)
        rule = Rule(rng.random() < 0.5, window, mask=mask)
        keys = Segments((Run(0, 0, S),)).cut(docs)
        for r in range(W):
            q = lay.segments(r, S).cut(docs)
            g = _Grid(split_pieces(q, rule.pieces), split_pieces(keys, rule.pieces), rule)
            for i, mine in enumerate(g.row_keys):
                for start in range(len(mine)):
                    assert _longest(g, i, mine, start) == scan(g, i, mine, start), (rule, r, i, start)
                    checked += 1
    assert checked > 1000, checked
