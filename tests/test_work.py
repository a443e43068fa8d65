"""``layouts.work``: per-rank and per-block attention work in closed form against a dense count."""

from __future__ import annotations

import random

from seqpar.layouts import Balanced, Contiguous, DocContiguous, DocZigzag, Rule, Stripe, Zigzag
from seqpar.layouts.blocks import visible_dense
from seqpar.layouts.work import block_work, work


def _docs(seg):
    return [run.doc for run in seg.runs for _ in range(run.length)]


def _random_case(rng: random.Random):
    world = rng.choice([1, 2, 3, 4, 8])
    kind = rng.choice(["contiguous", "zigzag", "stripe", "doc_contiguous", "doc_zigzag", "balanced"])
    if kind in ("doc_contiguous", "doc_zigzag"):
        m = world * (2 if kind == "doc_zigzag" else 1)
        bounds = [0]
        for _ in range(rng.randint(1, 5)):
            bounds.append(bounds[-1] + m * rng.randint(0, 4))
        bounds[-1] += m
        lay = (DocZigzag if kind == "doc_zigzag" else DocContiguous)(world, tuple(bounds))
        seq = bounds[-1] + lay.divisor * rng.randint(0, 2)
    elif kind == "balanced":
        bounds = [0]
        for _ in range(rng.randint(1, 8)):
            bounds.append(bounds[-1] + rng.randint(0, 20))
        bounds[-1] += 1
        lay = Balanced(world, tuple(bounds))
        seq = -(-(bounds[-1] + rng.randint(0, 9)) // world) * world
    else:
        lay = {"contiguous": Contiguous, "zigzag": Zigzag, "stripe": Stripe}[kind](world)
        seq = lay.divisor * rng.randint(1, 5)
        valid = rng.randint(1, seq)
        bounds = [0, *sorted(rng.sample(range(1, valid), min(valid - 1, rng.randint(0, 6)))), valid] \
            if valid > 1 else [0, 1]
    rule = Rule(rng.random() < 0.6, (rng.choice([-1, 0, 2, 5]), rng.choice([-1, 0, 3])))
    return lay, seq, tuple(bounds), rule


def test_work_matches_a_dense_count():
    rng = random.Random(0)
    every = Contiguous(1)
    for _ in range(200):
        lay, seq, bounds, rule = _random_case(rng)
        keys = every.segments(0, seq).cut(bounds)
        want = []
        for r in range(lay.world):
            q = lay.segments(r, seq).cut(bounds)
            dense = visible_dense(q.positions(), keys.positions(), rule, _docs(q), _docs(keys))
            want.append(sum(map(sum, dense)))
        assert work(lay, seq, rule, bounds) == want, (lay, seq, bounds, rule)


def test_block_work_matches_a_dense_count_and_adds_up_to_work():
    rng = random.Random(1)
    for _ in range(100):
        lay, seq, bounds, rule = _random_case(rng)
        segs = [lay.segments(r, seq).cut(bounds) for r in range(lay.world)]
        for r in range(lay.world):
            blocks = []
            for j in range(lay.world):
                dense = visible_dense(segs[r].positions(), segs[j].positions(), rule,
                                      _docs(segs[r]), _docs(segs[j]))
                blocks.append(block_work(segs[r], segs[j], rule))
                assert blocks[-1] == sum(map(sum, dense))
            assert sum(blocks) == work(lay, seq, rule, bounds)[r]


def test_causal_work_is_position_in_document_plus_one():
    lay = Zigzag(2)                                      # rank 0: chunks 0 and 3 of 4 (positions 0-2, 9-11)
    assert work(lay, 12, Rule(True), (0, 3, 10)) == [1 + 2 + 3 + 7, 4 + 5 + 6 + 1 + 2 + 3]
    assert work(DocZigzag(2, (0, 8)), 8, Rule(True)) == [18, 18]     # the layout's own documents
    assert work(Contiguous(2), 8, Rule(False)) == [32, 32]          # one document, everything visible
