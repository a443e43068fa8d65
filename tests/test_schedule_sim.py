"""Schedule invariants in a single-process simulator (ALGORITHMS.md §13.5): tokenring, tasp, double_ring.

For every rank and step the host plans say what is computed, which rows travel and where gradient
partials go. The simulator replays the messages on labels instead of tensors and checks: every visible
(query, key) pair is computed exactly once and nothing invisible is; every buffer holds what the plan
says it holds; every TASP link carries at most one sub-chunk per round; every gradient partial reaches
its owner exactly once.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from seqpar.layouts import Contiguous, Rule, Zigzag
from seqpar.layouts.blocks import visible_dense
from seqpar.layouts.subchunks import Subchunked
from seqpar.methods import _passq, _tasp, double_ring
from seqpar.methods._shared import row_hull

RULES = {"causal": (Rule(True), None, None), "full": (Rule(False), None, None),
         "window": (Rule(True, (5, 0)), None, None), "docs_pad": (Rule(True), "docs", "pad")}


def _cells(task):
    lo, hi = task.mask.lo, task.mask.hi
    return [(task.q_start + i, task.k_start + j) for i in range(task.rows) for j in range(task.cols)
            if (lo is None or j - i >= lo) and (hi is None or j - i <= hi)]


def _setup(layout, rule_name, S=None):
    rule, docs, pad = RULES[rule_name]
    S = S or layout.divisor * 2
    bounds = (0, S // 3, S // 2 + 1, S - 3) if docs else None
    valid = S - 3 if pad else None
    segs = [layout.segments(r, S).cut(bounds, valid) for r in range(layout.world)]
    pos = [s.positions() for s in segs]
    doc = [[r.doc for r in s.runs for _ in range(r.length)] for s in segs]
    allpos = [p for ps in pos for p in ps]
    alldoc = [d for ds in doc for d in ds]
    dense = visible_dense(allpos, allpos, rule, alldoc, alldoc)
    truth = {(allpos[i], allpos[j]) for i in range(len(allpos)) for j in range(len(allpos)) if dense[i][j]}
    return S, rule, bounds, valid, segs, pos, truth


def _assert_exactly_once(got, truth):
    dup = [c for c, n in Counter(got).items() if n > 1]
    assert not dup, f"computed twice: {dup[:5]}"
    assert set(got) == truth, f"missing {sorted(truth - set(got))[:5]}, extra {sorted(set(got) - truth)[:5]}"


# ---------------------------------------------------------------------------------------------- tokenring
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("layout_cls", [Zigzag, Contiguous])
@pytest.mark.parametrize("rule_name", list(RULES))
def test_tokenring_schedule(world, layout_cls, rule_name):
    layout = layout_cls(world)
    S, rule, bounds, valid, segs, pos, truth = _setup(layout, rule_name)
    sp = _passq.schedule(layout, S, rule, bounds, valid)
    W, n = world, sp.n_steps
    got = []
    for r in range(W):
        for t in sp.early[r] + sp.late[r]:
            got += [(pos[r][i], pos[r][j]) for i, j in _cells(t)]
    for r, s in itertools.product(range(W), range(1, n)):
        i = (r + s) % W
        for t in sp.steps[r][s]:
            got += [(pos[i][a], pos[r][b]) for a, b in _cells(t)]
    _assert_exactly_once(got, truth)
    for i in range(W):                      # the rows a guest computes were delivered by the hop before it
        avail = (0, segs[i].length)
        for s in range(1, n):
            sent = sp.q_rows[i][s - 1]
            if sent is not None:
                assert avail[0] <= sent[0] and sent[1] <= avail[1]
                avail = sent
            need = row_hull(sp.steps[(i - s) % W][s])
            assert need == sp.res_rows[i][s]
            if need is not None:
                assert sent is not None and sent[0] <= need[0] and need[1] <= sent[1]
    deliveries = Counter()                   # partial (owner, step) from its host, as _passq._post_return posts it
    for t, r in itertools.product(range(1, n), range(W)):
        if sp.res_rows[(r + t) % W][t] is not None:
            deliveries[(r + t) % W, t, r] += 1
    want = {(i, t, (i - t) % W) for i in range(W) for t in range(1, n) if sp.res_rows[i][t] is not None}
    assert set(deliveries) == want and all(v == 1 for v in deliveries.values())


def test_tokenring_sends_back_halves_after_the_wrap():
    """Zigzag causal: Q rows on the wire are 3/4 of the ring's KV rows over a pass (ALGORITHMS.md §7.2)."""
    for W in (2, 3, 4, 8):
        layout, S = Zigzag(W), 16 * W
        L = S // W
        sp = _passq.schedule(layout, S, Rule(True), None, None)
        rows = sum(x[1] - x[0] for i in range(W) for s in range(sp.n_steps) if (x := sp.q_rows[i][s]))
        assert 4 * rows == 3 * W * (W - 1) * L
        for i in range(W):
            for s in range(sp.n_steps - 1):  # before the wrap all rows travel, after it the back half only
                assert sp.q_rows[i][s] == ((0, L) if (i - s - 1) % W < i else (L // 2, L))


# ---------------------------------------------------------------------------------------------- tasp
def _tasp_cases():
    for world in range(2, 9):
        for kind in ("direct", "cycles"):
            if kind == "cycles" and world in (4, 6):
                continue
            for base, rule_name in [(Zigzag, "causal"), (Zigzag, "full"), (Contiguous, "full"),
                                    (Zigzag, "window"), (Zigzag, "docs_pad")]:
                yield world, kind, base, rule_name


def _match(out_hops, in_hop, what):
    """The sender's half of a hop, and the check that both ends agree on the link's message order."""
    mine = [h for h in out_hops if h.dst == in_hop.dst]
    found = [h for h in mine if h.piece == in_hop.piece]
    assert len(found) == 1, f"{what}: {len(found)} sends for one receive"
    return found[0], [h.piece for h in mine]


@pytest.mark.parametrize("size", ["even", "uneven", "tiny"])
@pytest.mark.parametrize("world,kind,base,rule_name", list(_tasp_cases()))
def test_tasp_schedule(world, kind, base, rule_name, size):
    """Uneven: one base divisor more than equal sub-chunks take, so the parts differ by a row; tiny: two base
    divisors, pieces shorter than their parts (empty ones) - Note [Uneven sub-chunks]."""
    layout = Subchunked(world, base=base(world), parts=max(world - 1, 1))
    even = layout.divisor * layout.parts * 2
    S = {"even": even, "uneven": even + layout.divisor, "tiny": 2 * layout.divisor}[size]
    S, rule, bounds, valid, segs, pos, truth = _setup(layout, rule_name, S)
    W, L = world, segs[0].length
    tp = [_tasp.schedule(layout, r, S, rule, bounds, valid, kind) for r in range(W)]
    own = [[(r, i) for i in range(L)] for r in range(W)]
    got = [(pos[r][i], pos[r][j]) for r in range(W) for t in tp[r].early + tp[r].late for i, j in _cells(t)]
    bufs = {}
    for t in range(1, W):
        for r in range(W):
            rd = tp[r].rounds[t - 1]
            buf = [None] * rd.rows
            links = Counter()
            for h in rd.kv_in:
                sent, order = _match(tp[h.src].rounds[t - 1].kv_out, h, "kv")
                assert order == [x.piece for x in rd.kv_in if x.src == h.src], "link order differs"
                src = own[h.src] if sent.from_own else bufs[t - 1, h.src]
                buf[h.dst_rows[0]:h.dst_rows[1]] = src[sent.src_rows[0]:sent.src_rows[1]]
                links[h.src, h.piece.sub] += 1
            assert len({s for s, _ in links}) == len(links), "a link carries two sub-chunks in one round"
            for p, (a, b) in zip(rd.held, rd.held_rows):
                assert buf[a:b] == [(p.origin, i) for i in range(*p.rows)]
            bufs[t, r] = buf
            for task in rd.tasks:
                got += [(pos[r][i], pos[buf[j][0]][buf[j][1]]) for i, j in _cells(task)]
            if kind == "cycles":             # every link of the mesh is busy in every round
                assert sorted({h.src for h in rd.kv_in}) == [p for p in range(W) if p != r]
            if base is Zigzag and rule_name in ("causal", "full"):
                assert len(rd.tasks) <= 2, "TASP's M/P split: at most two kernel calls per round"
        sends = sum(len(tp[r].rounds[t - 1].kv_out) for r in range(W))
        assert sends == sum(len(tp[r].rounds[t - 1].kv_in) for r in range(W))
    _assert_exactly_once(got, truth)
    # gradients: every (round, holder, piece) contribution reaches the piece's origin exactly once
    run, want, home = {}, Counter(), Counter()
    for t in range(1, W):
        for r in range(W):
            rd = tp[r].rounds[t - 1]
            for p, (a, b) in zip(rd.held, rd.held_rows):
                hit = any(x.k_start < b and a < x.k_stop for x in rd.tasks)
                run[t, r, p] = Counter({(t, r): 1}) if hit else Counter()
                want[p, t, r] += hit
        for r in range(W):                   # relays of round t-1 partials, added after round t's compute
            for h in tp[r].rounds[t - 2].grad_in if t >= 2 else ():
                if not h.home:
                    sent, _ = _match(tp[h.src].rounds[t - 2].grad_out, h, "relay")
                    assert h.dst_rows == tp[r].rounds[t - 1].held_rows[tp[r].rounds[t - 1].held.index(h.piece)]
                    run[t, r, h.piece] += run[t - 1, h.src, h.piece]
    for t in range(1, W):
        for r in range(W):
            for h in tp[r].rounds[t - 1].grad_in:
                if h.home:
                    sent, order = _match(tp[h.src].rounds[t - 1].grad_out, h, "home")
                    assert order == [x.piece for x in tp[r].rounds[t - 1].grad_in if x.src == h.src]
                    assert h.dst == r == h.piece.origin and h.dst_rows == h.piece.rows
                    for tok, n in run[t, h.src, h.piece].items():
                        home[(h.piece, *tok)] += n
    assert home == +want
    outs = sum(len(tp[r].rounds[t - 1].grad_out) for r in range(W) for t in range(1, W))
    assert outs == sum(len(tp[r].rounds[t - 1].grad_in) for r in range(W) for t in range(1, W))


# ---------------------------------------------------------------------------------------------- double ring
@pytest.mark.parametrize("world,node_size", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 3), (8, 2),
                                             (8, 4), (8, 8)])
@pytest.mark.parametrize("rule_name", ["causal", "full", "docs_pad"])
def test_double_ring_schedule(world, node_size, rule_name):
    layout = Zigzag(world)
    S, rule, bounds, valid, _segs, pos, truth = _setup(layout, rule_name)
    W, w, n_out = world, node_size, world // node_size
    got = []
    for R in range(W):
        tasks = double_ring.schedule(layout, R, S, rule, bounds, valid, w)
        srcs = [double_ring.source(R, j, s, W, w) for j in range(n_out) for s in range(w)]
        assert sorted(srcs) == list(range(W)), "every rank's KV is visited exactly once"
        for j, s in itertools.product(range(n_out), range(w)):
            src = double_ring.source(R, j, s, W, w)
            got += [(pos[R][a], pos[src][b]) for t in tasks[j][s] for a, b in _cells(t)]
    _assert_exactly_once(got, truth)
    # forward: the KV a rank holds is the one its neighbours passed it
    pr = [double_ring.peers(R, W, w) for R in range(W)]
    for R, j, s in itertools.product(range(W), range(n_out), range(w)):
        if s > 0:
            assert double_ring.source(R, j, s, W, w) == double_ring.source(pr[R].inner_prev, j, s - 1, W, w)
        elif j > 0:
            assert double_ring.source(R, j, 0, W, w) == double_ring.source(pr[R].outer_prev, j - 1, 0, W, w)
    # backward: replay the dK/dV routing of double_ring._backward_loop on token sets
    tot: dict[int, tuple[int, Counter]] = {}
    for j in range(n_out):
        running = {R: (double_ring.source(R, j, 0, W, w), Counter({(R, j, 0): 1})) for R in range(W)}
        for s in range(1, w):
            nxt = {}
            for R in range(W):
                block, toks = running[pr[R].inner_prev]
                assert block == double_ring.source(R, j, s, W, w)
                nxt[R] = (block, toks + Counter({(R, j, s): 1}))
            running = nxt
        new = {}
        for R in range(W):
            block, toks = running[R]
            if j > 0:
                prev_block, prev = tot[pr[R].outer_prev]
                assert prev_block == block
                toks = toks + prev
            new[R] = (block, toks)
        tot = new
    for R in range(W):
        block, toks = tot[pr[R].home_from]
        assert block == R
        want = Counter({(X, j, s): 1 for X in range(W) for j in range(n_out) for s in range(w)
                        if double_ring.source(X, j, s, W, w) == R})
        assert toks == want
