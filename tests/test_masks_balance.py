"""``balanced`` under named masks: the affine work pieces are exact, and the busiest of 8 ranks does at most
1.05x the mean visible pairs for every named mask (Note [Balanced layout], ``seqpar.layouts.profile``)."""

import itertools

import pytest

from seqpar import masks
from seqpar.layouts import make_layout
from seqpar.layouts.blocks import Rule, visible_dense
from seqpar.layouts.profile import affine_pieces
from seqpar.layouts.work import block_work

S = 131072
NAMED = {
    "chunked": (True, masks.chunked(8192)),
    "spans": (False, masks.spans([(i * 4096 + 100, i * 4096 + 1124) for i in range(0, 32, 3)])),
    "spans_window": (False, masks.spans([(i * 8192, i * 8192 + 2048) for i in range(0, 16, 2)], window=4095)),
    "prefix_lm": (False, masks.prefix_lm(S // 4)),
    "block_causal": (False, masks.block_causal(4096)),
    "shared_prefix": (False, masks.shared_prefix(65536, [8192] * 8)),
    "tree": (False, masks.tree((0, 16384, 24576, 40960, 65536, 98304, S), (-1, 0, 1, 0, 3, -1))),
    "sink_window": (False, masks.sink_window(4095, 4)),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_affine_pieces_count_every_query_exactly(name):
    causal = NAMED[name][0]
    small = {"chunked": masks.chunked(5), "spans": masks.spans([(3, 7), (12, 20)]),
             "spans_window": masks.spans([(3, 7), (12, 20)], window=4), "prefix_lm": masks.prefix_lm(6),
             "block_causal": masks.block_causal(4), "shared_prefix": masks.shared_prefix(9, [5, 6, 4]),
             "tree": masks.tree((0, 6, 10, 15, 24), (-1, 0, 1, 0)), "sink_window": masks.sink_window(4, 2)}[name]
    bounds = (0, 11, 17, 24)
    rule = Rule(causal, mask=small)
    pos = list(range(24))
    docs = [next(d for d, (a, b) in enumerate(itertools.pairwise(bounds)) if a <= p < b) for p in pos]
    truth = [sum(row) for row in visible_dense(pos, pos, rule, docs, docs)]
    got = [0] * 24
    covered = []
    for start, length, c, slope in affine_pieces(bounds, rule):
        for i in range(length):
            got[start + i] = c + slope * i
        covered += range(start, start + length)
    assert covered == pos
    assert got == truth


@pytest.mark.parametrize("layout", ["balanced", "balanced_whole"])
@pytest.mark.parametrize("name", sorted(NAMED))
def test_balanced_spreads_the_visible_pairs_of_every_named_mask(name, layout):
    causal, m = NAMED[name]
    W, cu = 8, (0, S)
    rule = Rule(causal, mask=m)
    lay = make_layout(layout, W, cu, rule)
    segs = [lay.segments(r, S).cut(cu) for r in range(W)]
    work = [sum(block_work(segs[r], segs[j], rule) for j in range(W)) for r in range(W)]
    ratio = max(work) / (sum(work) / W)
    assert ratio <= 1.05, (name, ratio, work)
    assert all(s.length == S // W for s in segs)
