"""The planner on packed batches (Note [Packed batches] in ``seqpar.cost.model``) and its inference cases.

Work per rank and per ring step against ``seqpar.layouts.work`` and the block planner; a single document is
the dense model; the busiest rank sets the compute; document layouts are ranked only with documents and
refused with the layout's reason; ``choose`` with ``cu_seqlens`` keeps the caller's layout, is pure, cached
and cheap for a new batch (no O(S)); ``method="auto"`` on a packed batch matches the oracle and agrees on
every rank; ``plan(cached=...)`` reports prefill (pass-KV or pass-Q, with the reason) and decode.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import random
import time

import pytest
import torch
from conftest import assert_all_ok

import seqpar
from seqpar.cost.model import Machine, block_matrix, steps, whole
from seqpar.cost.profile import load_profile
from seqpar.cost.topology import Network, get_topology
from seqpar.cost.work import Block
from seqpar.inference import plan_inference
from seqpar.layouts import Rule, make_layout
from seqpar.layouts.work import block_work, work
from seqpar.planner import Candidate, Problem, choose, plan, predict, search
from seqpar.testing import Case, check_case, make_inputs

H200 = load_profile("h200-nvswitch")
M = Machine(H200, Network(get_topology(None, H200), H200), H200.default_kernel)


def _documents(S: int, seed: int, mean_log: float = 7.0) -> tuple[int, ...]:
    """Lognormal document lengths (about e^mean_log tokens) filling S."""
    rnd, cuts = random.Random(seed), [0]
    while cuts[-1] < S:
        cuts.append(min(S, cuts[-1] + int(rnd.lognormvariate(mean_log, 1.0)) + 1))
    return tuple(cuts)


def _seen(pos_q: list[int], pos_k: list[int], docs: tuple[int, ...], rule: Rule) -> tuple[int, int, int]:
    """Brute force: (visible pairs, query rows that see a key, keys seen) of two ranks' positions."""
    lo, hi = rule.delta_bounds()
    dq, dk = ([bisect.bisect_right(docs, x) if x < docs[-1] else -1 for x in pos] for pos in (pos_q, pos_k))
    vis = {(i, j) for i, a in enumerate(pos_q) for j, b in enumerate(pos_k) if dq[i] == dk[j] >= 0
           and (lo is None or b - a >= lo) and (hi is None or b - a <= hi)}
    return len(vis), len({i for i, _ in vis}), len({j for _, j in vis})


def test_packed_calls_pay_whole_query_tiles():
    """Note [Query tiles of packed calls]: a run pair's tiles are its rows that see anything in 128-row tiles, its
    padded pairs its pairs on them; Ulysses' and all-gather's calls count each query run once; the tile cost is the
    profile's per tile and head, and nothing for a dense call."""
    cu = (0, 100, 300, 1024)
    lay = make_layout("contiguous", 1, cu)
    m = block_matrix(lay, 1024, Rule(True), cu)
    assert int(m[3, 0, 0]) == 1 + 2 + 6 and int(m[4, 0, 0]) == (5050 * 128 // 100 + 20100 * 256 // 200
                                                                 + 262450 * 768 // 724)
    p = Problem(seq_len=1024, heads=32, kv_heads=8, world=1, documents=cu)
    blk = whole(p)
    assert (blk.tiles, blk.pairs) == (9, 5050 + 20100 + 262450) and blk.padded == blk.pairs * 9 * 128 // 1024
    none, tiled = (Machine(M.profile.replace(varlen_tile_us=t), M.network, M.kernel) for t in ((), (("fwd", 0.5),)))
    assert tiled.kernel_ms(p, blk, 32) - none.kernel_ms(p, blk, 32) == pytest.approx(9 * 32 * 0.5e-3)
    dense = Block(1024, 1024, 1024 * 1025 // 2)
    assert tiled.kernel_ms(p, dense, 32) == none.kernel_ms(p, dense, 32)


def test_block_matrix_is_the_block_planners_count():
    """Pairs equal ``layouts.work.block_work`` (rows sum to ``work``); rows and keys that see anything are exact
    when a run meets one run of its document per rank (contiguous, stripe), an upper bound otherwise."""
    rnd = random.Random(0)
    for _ in range(30):
        W = rnd.choice([1, 2, 3, 4, 8])
        S = 2 * W * rnd.randint(2, 12)
        cu = tuple(sorted({0, S, *(rnd.randrange(1, S) for _ in range(rnd.randint(0, 6)))}))
        cu = cu[:-1] if rnd.random() < 0.3 and len(cu) > 2 else cu               # end padding
        for name, rule in itertools.product(["contiguous", "zigzag", "stripe", "balanced"],
                                            [Rule(True), Rule(False), Rule(True, (5, -1)), Rule(False, (3, 4))]):
            lay = make_layout(name, W, cu)
            m = block_matrix(lay, S, rule, cu)
            segs = [lay.segments(r, S).cut(cu) for r in range(W)]
            assert m[0].tolist() == [[block_work(segs[a], segs[b], rule) for b in range(W)] for a in range(W)]
            assert m[0].sum(1).tolist() == work(lay, S, rule, cu)
            pos = [segs[r].positions() for r in range(W)]
            for a, b in itertools.product(range(W), repeat=2):
                _, rows, keys = _seen(pos[a], pos[b], cu, rule)
                got = (int(m[1, a, b]), int(m[2, a, b]))
                assert got == (rows, keys) if name in ("contiguous", "stripe") else got >= (rows, keys), (name, a, b)


def test_one_document_is_the_dense_model():
    p = Problem(seq_len=65536, heads=32, kv_heads=8, world=4)
    for c in (Candidate("ring", "zigzag"), Candidate("allgather", "zigzag"), Candidate("ulysses", "contiguous"),
              Candidate("tokenring", "zigzag"), Candidate("usp", "zigzag", 2)):
        one = Problem(seq_len=65536, heads=32, kv_heads=8, world=4, documents=(0, 65536))
        assert one.documents is None and predict(one, c, M) == predict(p, c, M)
    with pytest.raises(ValueError, match="must start at 0"):
        Problem(seq_len=64, heads=4, kv_heads=4, world=2, documents=(1, 64))


def test_busiest_rank_sets_each_step():
    """Step s of a ring costs its busiest rank's pairs; imbalance and lockstep are the layouts' numbers."""
    S, W = 65536, 8
    cu = _documents(S, 1)
    p = Problem(seq_len=S, heads=32, kv_heads=8, world=W, documents=cu)
    lay = make_layout("zigzag", W, cu)
    segs = [lay.segments(r, S).cut(cu) for r in range(W)]
    want = [max(block_work(segs[r], segs[(r - s) % W], p.rule) for r in range(W)) for s in range(W)]
    got = [0 if b is None else b.pairs for b in steps(p, "zigzag", W)]
    assert got == want[:len(got)] and not any(want[len(got):])
    w = work(lay, S, p.rule, cu)
    pr = predict(p, Candidate("ring", "zigzag"), M)
    assert pr.work_imbalance == pytest.approx(max(w) / (sum(w) / W))
    assert pr.lockstep == pytest.approx(sum(want) / (sum(w) / W))
    assert pr.lockstep >= pr.work_imbalance > 1.2                              # zigzag blind to documents
    dense = predict(Problem(seq_len=S, heads=32, kv_heads=8, world=W), Candidate("ring", "zigzag"), M)
    assert pr.comm_bytes <= dense.comm_bytes and pr.compute_ms < dense.compute_ms  # documents: fewer pairs
    long = Problem(seq_len=262144, heads=32, kv_heads=8, world=W, documents=_documents(262144, 2, 8.0))
    zz, bal = (predict(long, Candidate("ring", lay), M) for lay in ("zigzag", "balanced"))
    assert bal.work_imbalance < 1.001 and bal.lockstep < 1.1 < 2 < zz.lockstep     # 47 documents of ~3K
    assert bal.fwd_bwd_ms < 0.8 * zz.fwd_bwd_ms and bal.comm_bytes == zz.comm_bytes  # its pieces pay query tiles
    assert zz.compute_ms / bal.compute_ms < zz.lockstep / bal.lockstep
    uly = predict(p, Candidate("ulysses", "contiguous"), M)
    assert (uly.work_imbalance, uly.lockstep) == (1.0, 1.0)                     # every rank the whole sequence


def test_plan_ranks_layouts_on_the_batch():
    S, W = 65536, 4
    cu = _documents(S, 2)
    r = plan(seq_len=S, heads=32, kv_heads=8, world=W, cu_seqlens=cu)
    ok = {e.label for e in r.entries if e.ok}
    assert {"ring/zigzag", "ring/balanced", "tokenring/stripe", "usp/u2r2/balanced", "ulysses"} <= ok
    assert not any(e.candidate.layout == "balanced" for e in r.entries if e.candidate.method in ("ulysses", "tasp"))
    odd = [e for e in r.entries if e.candidate.layout == "doc_zigzag"]
    assert odd and all(not e.ok and "not a multiple of 2W" in e.why_not[0] for e in odd)
    text = r.table()
    assert "documents=" in text and "work max/mean" in text and "MiB/rank" in text
    dense = plan(seq_len=S, heads=32, kv_heads=8, world=W)
    assert not any(e.candidate.layout in ("balanced", "doc_zigzag") for e in dense.entries)
    assert "work max/mean" not in dense.table()
    assert plan(seq_len=S, heads=32, kv_heads=8, world=W, cu_seqlens=torch.tensor(cu)) is r      # cached


def test_choose_keeps_the_layout_pure_and_cheap():
    S, W = 131072, 8
    q = (1, S // W, 32, 128)
    for layout in ("zigzag", "balanced", "doc_contiguous", "contiguous"):
        cu = (0, S // 2, S) if layout == "doc_contiguous" else _documents(S, 3)
        a = choose(q, 8, True, (-1, -1), W, 1, layout, cu_seqlens=cu)
        assert a == choose(q, 8, True, (-1, -1), W, 1, layout, cu_seqlens=list(cu))
        assert layout in seqpar.methods.get(a[0]).layouts
    t0 = time.perf_counter()
    for seed in range(10):                                                    # a new batch every step
        choose(q, 8, True, (-1, -1), W, 1, "balanced", cu_seqlens=_documents(S, 100 + seed))
    assert (time.perf_counter() - t0) / 10 < 0.05
    t0 = time.perf_counter()
    choose((1, (1 << 24) // W, 4, 64), 1, True, (-1, -1), W, 1, "zigzag", cu_seqlens=_documents(1 << 24, 4, 12.0))
    assert time.perf_counter() - t0 < 0.5                                     # 16M tokens: no O(S)


def _auto_packed(case: Case) -> dict:
    """Worker side: ``method="auto"`` on a packed batch in ``case.layout``; local results and the choice."""
    q, k, v, do, _ = make_inputs(case)
    where = {"method": "auto", "layout": case.layout, "cu_seqlens": case.cu_seqlens}
    ql, kl, vl = (seqpar.shard(t, **where).requires_grad_() for t in (q, k, v))
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())           # type: ignore[method-assign]
    log = logging.getLogger("seqpar.planner")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    search._choose.cache_clear()                                              # logged once per signature
    try:
        res = seqpar.attention(ql, kl, vl, causal=case.causal, kernel="reference", return_lse=True, **where)
    finally:
        log.removeHandler(handler)
    (res.out.float() * seqpar.shard(do, **where).float()).sum().backward()
    choice = choose(tuple(ql.shape), kl.shape[2], case.causal, (-1, -1), torch.distributed.get_world_size(), 1,
                    case.layout, device="cpu", dtype=ql.dtype, kernel="reference", features=["varlen"],
                    cu_seqlens=case.cu_seqlens)
    local = {n: t.detach() for n, t in {"out": res.out, "lse": res.lse, "dq": ql.grad, "dk": kl.grad,
                                        "dv": vl.grad}.items()}
    local["positions"] = seqpar.positions(case.seq_len, **where)
    local["times"] = (0.0, 0.0)
    local["choice"] = choice
    local["heard"] = heard
    return local


def test_auto_on_a_packed_batch(pools):
    reports = []
    for layout in ("balanced", "zigzag"):
        case = Case(layout=layout, seq_len=48, heads=4, kv_heads=2, head_dim=8, cu_seqlens=(0, 5, 6, 30, 48))
        results = pools(2).run(_auto_packed, case)
        choices = [r.pop("choice") for r in results]
        assert all(c == choices[0] for c in choices) and layout in seqpar.methods.get(choices[0][0]).layouts
        heard = results[0].pop("heard") + results[1].pop("heard")            # the runtime planned on the batch
        assert any(f"-> {choices[0][0]} " in h and "4 documents" in h for h in heard), heard
        reports.append(check_case(case, results))
    assert_all_ok(reports)


def test_inference_cases():
    """Prefill of the uncached tokens picks the pass by bytes (a first prompt: pass-KV; a short turn after
    a long context under MHA: pass-Q), decode reports the cache per rank at the full context."""
    kw = dict(heads=32, kv_heads=32, world=8, head_dim=128)
    first = plan(seq_len=131072, cached=0, layers=32, **kw).inference
    assert first is not None and first.prefill.choice == "kv" and "pass-KV" in first.prefill.reason
    turn = plan(seq_len=131072, cached=126976, layers=32, **kw)
    case = turn.inference
    assert case is not None and case.prefill.choice == "q" and "pass-Q" in case.prefill.reason
    ref = plan_inference(context=131072, new_tokens=1, world=8, layers=32, heads=32, kv_heads=32, head_dim=128)
    assert case.kv_bytes_per_rank == ref.kv_bytes_per_rank
    assert case.decode_bytes_per_layer == ref.decode_bytes_per_layer
    text = turn.table()
    assert "prefill of 4096 new tokens" in text and "decode at 131072 tokens" in text and "choice:" in text
    gqa = plan(seq_len=131072, cached=126976, heads=32, kv_heads=4, world=8).inference
    assert gqa is not None and gqa.prefill.choice == "q"
    with pytest.raises(ValueError, match="cached must be"):
        plan(seq_len=1024, cached=1024, heads=8, world=2)


def test_allgather_on_documents_prices_the_selective_gather():
    """Note [Selective gather]: the planner's bytes and gathered memory are the busiest reader's share."""
    from seqpar.layouts.packing import packed_row
    from seqpar.methods.allgather import selected_rows

    S, W = 1 << 17, 8
    cu = packed_row(S, "lognormal", seed=0)
    dense = predict(Problem(seq_len=S, heads=32, kv_heads=8, world=W), Candidate("allgather", "zigzag"), M)
    packed = predict(Problem(seq_len=S, heads=32, kv_heads=8, world=W, documents=cu),
                     Candidate("allgather", "zigzag"), M)
    rows, foreign = selected_rows(make_layout("zigzag", W, cu), S, Rule(True), cu)
    assert foreign < rows < 0.3 * S
    assert packed.comm_bytes == pytest.approx(dense.comm_bytes * foreign / ((W - 1) * S / W))
    assert packed.peak_mem_bytes < dense.peak_mem_bytes
    assert any("selective gather" in n for n in packed.notes), packed.notes


def test_document_layouts_over_one_document_are_their_plain_counterparts():
    """``layouts.ONE_DOCUMENT``: each document layout places one causal document where its plain counterpart puts
    the same tokens, so the planner (whose ``Problem`` keeps no documents for one) ranks it as that layout, and
    ``method="auto"`` on a document layout over one document picks a method that takes it (before: no candidate,
    an empty reason)."""
    from seqpar.layouts import DOCUMENT_LAYOUTS, ONE_DOCUMENT

    for name in DOCUMENT_LAYOUTS:
        for W in (2, 3, 4, 8):
            S = 2 * W * 24
            doc, plain = make_layout(name, W, (0, S)), make_layout(ONE_DOCUMENT[name], W)
            for r in range(W):
                mine = [p for run in doc.segments(r, S).runs for p in range(run.glob, run.glob + run.length)]
                theirs = [p for run in plain.segments(r, S).runs for p in range(run.glob, run.glob + run.length)]
                assert mine == theirs, (name, W, r)
        method, _, reason = choose((1, 128, 4, 16), 1, True, (-1, -1), 4, 1, name, device="cpu", mode="fwd",
                                   cu_seqlens=(0, 512))
        assert name in seqpar.methods.get(method).layouts and reason, (name, method, reason)
        ranked = plan(seq_len=512, heads=4, kv_heads=1, world=4, head_dim=16, layout=name, cu_seqlens=(0, 512))
        assert ranked.entries and all(name in seqpar.methods.get(e.candidate.method).layouts
                                      for e in ranked.entries), name    # TASP takes zigzag, not a document layout
    empty = plan(seq_len=512, heads=4, kv_heads=1, world=4, head_dim=16, methods=["ulysses"], layout="zigzag")
    assert empty.best is None and "no method offers a configuration" in empty.reason


def test_validate_predicts_packed_records_with_their_documents():
    """A packed-suite record is predicted with its row's documents: regenerated from the fields it names, or - for
    records written before it named them - from its row's name and the suite's shape; a packed row costs less than
    the dense one of its length (every token sees only its document)."""
    from seqpar.layouts.packing import packed_row
    from seqpar.planner.validate import packed_documents, predict_record

    old = {"method": "ring/balanced", "world_size": 8, "seq_len": 32768, "packed": True,
           "row": "packed-32k-lognormal", "gpu": "NVIDIA H100 80GB HBM3", "mode": "fwd", "time_ms": 1.0}
    new = old | {"heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True, "distribution": "lognormal",
                 "packing_seed": 7, "packing_multiple": 16}
    cu = packed_row(32768, "lognormal", seed=7, multiple=16)
    assert packed_documents(old) == packed_documents(new) == cu
    assert packed_documents({"method": "ring", "seq_len": 8}) is None
    packed = predict_record(new).time_ms("fwd")
    assert predict_record(old).time_ms("fwd") == packed
    dense = predict_record({k: v for k, v in new.items() if k != "packed"} | {"method": "ring/zigzag"})
    assert 0 < packed < dense.time_ms("fwd")


def test_validate_prices_a_mask_by_its_recorded_spec():
    """A bench row under a named mask is priced with the mask (``mask_spec``); one recorded with the mask's name
    only (before 2026-11-28) is not modelled - it used to be priced as the unmasked call - and
    ``benchmarks/planner_masks.py`` fills the spec in from the bench's preset."""
    from seqpar.bench.presets import PRESETS
    from seqpar.planner.validate import check, modelled, predict_record

    spec = PRESETS["mask-sink-window-16k"].mask
    old = {"preset": "mask-sink-window-16k", "method": "ring/contiguous", "world_size": 8, "seq_len": 16384,
           "heads": 32, "kv_heads": 8, "head_dim": 128, "causal": False, "mask": "sink_window",
           "gpu": "NVIDIA H200", "mode": "fwd", "time_ms": 0.5, "emulated_world": 8}      # compute, no links
    new = old | {"mask_spec": list(spec)}                 # as JSON gives it back
    assert not modelled(old) and modelled(new)
    (row,), _, _ = check([old])
    assert row.predicted_ms is None and row.note == "mask: its spec not recorded"
    unmasked = predict_record({k: v for k, v in old.items() if k != "mask"}).time_ms("fwd")
    assert 0 < predict_record(new).time_ms("fwd") < 0.6 * unmasked     # a quarter of the pairs, the calls kept


def test_ring_critical_path_equal_ranks_is_the_lock_step_sum():
    """Note [Ring critical path]: ranks doing the same work at every step take the lock-step sum of Note [Step
    time], hop by hop; with free hops each rank runs its own calls, held only by neighbours not yet at the step."""
    from seqpar.cost.model import _ring_time

    comps, comms, loss = [[2.0, 1.0, 0.5]] * 4, [1.5, 1.5, 0.0], 0.1
    want = sum(max(c, m) + loss * min(c, m) for c, m in zip(comps[0], comms))
    assert _ring_time(comps, comms, (0.0,) * 3, loss) == pytest.approx(want)
    # free hops: rank r's one heavy step on step r (a sink block per rank) costs each rank once, not every step
    heavy = [[5.0 if s == r else 1.0 for s in range(4)] for r in range(4)]
    assert _ring_time(heavy, (0.0,) * 4, (0.0,) * 4, 0.0) < sum(max(col) for col in zip(*heavy))
    assert _ring_time(heavy, (0.0,) * 4, (0.0,) * 4, 0.0) >= max(sum(row) for row in heavy)
    # slow hops hold every rank: each step at least its hop
    assert _ring_time(heavy, (10.0,) * 3 + (0.0,), (0.0,) * 4, 0.0) >= 30.0


def test_ring_under_the_sink_window_prices_each_ranks_own_steps(monkeypatch):
    """Note [Ring critical path]: the sink window at 128K over 8 on a contiguous layout gives each rank one 4-key
    sink step, on a different step for each; the ring's forward is priced at a rank's own calls, not the lock-step
    sum of every step's busiest call (which charged five sink blocks more), and a dense problem is unchanged."""
    from seqpar import masks
    from seqpar.cost import model
    from seqpar.cost.model import rank_steps

    emulated = load_profile("h100-emulated")
    m = Machine(emulated, Network(get_topology(None, emulated), emulated), emulated.default_kernel)
    p = Problem(seq_len=131072, heads=32, kv_heads=8, world=8, causal=False, mask=masks.sink_window(4095, 4))
    per = rank_steps(p, "contiguous", 8, len(steps(p, "contiguous", 8)))
    assert [sum(b is not None for b in row) for row in per] == [1, 2, 3, 3, 3, 3, 3, 3]   # band, corner, sinks
    lock = sum(m.kernel_ms(p, b, 32) for b in steps(p, "contiguous", 8))
    own = max(sum(m.kernel_ms(p, b, 32) for b in row) for row in per)
    pr = predict(p, Candidate("ring", "contiguous"), m)
    sinks = [b for b in steps(p, "contiguous", 8) if b is not None and b.cols == 4]
    assert len(sinks) == 6                          # steps 2-7: a rank's own sink step is one of them
    assert lock - own >= 5 * m.kernel_ms(p, sinks[0], 32)                            # at least the others' sinks
    with monkeypatch.context() as mp:               # the lock-step sum instead of the ranks' own calls
        mp.setattr(model, "rank_steps", lambda *a: None)
        stepped = predict(p, Candidate("ring", "contiguous"), m)
    assert stepped.fwd_ms - pr.fwd_ms >= 5 * m.kernel_ms(p, sinks[0], 32)
    assert rank_steps(Problem(seq_len=131072, heads=32, kv_heads=8, world=8), "zigzag", 8, 8) is None
