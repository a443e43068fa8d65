"""All-gather KV ("llama3") against the dense oracle, its plan, its communication layer and its errors.

PEERS.md §1 defect 4 (llama3 reduce-scatters dK/dV in bf16, blocking): our wire is fp32 by default and the
bf16 error does not grow with the world size; ``grad_dtype`` is honoured, not ignored. Defect 7 (llama3 is
contiguous, hence causally imbalanced): zigzag gives every rank the same work.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import assert_all_ok, run_cases

from seqpar import masks
from seqpar.layouts import Contiguous, Rule, Zigzag, make_layout
from seqpar.layouts.blocks import Task, visible_dense
from seqpar.masks import Band
from seqpar.methods.allgather import SELECT_AT, gather_plan, local_keys, needed_keys
from seqpar.testing import Case

LAYOUTS = ["contiguous", "zigzag"]
AG = "allgather"


def _grid(world: int, layout: str) -> list[Case]:
    seq = 4 * world if world < 8 else 32
    base = Case(method=AG, layout=layout, seq_len=seq, heads=4, head_dim=8, seed=world)
    cases = []
    for causal in (True, False):
        cases += [base.with_(causal=causal, kv_heads=4),
                  base.with_(causal=causal, kv_heads=2, dtype="bfloat16", options=(("heads_k_stride", 1),)),
                  base.with_(causal=causal, kv_heads=1, seed=world + 1)]
    cases += [base.with_(batch=2, kv_heads=4, options=(("heads_k_stride", 2),)),
              base.with_(heads=2, kv_heads=1, head_dim=16, dtype="float64"),
              base.with_(heads=2, kv_heads=2, dtype="float16", scale=0.3)]
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_allgather_matches_oracle(pools, world):
    assert_all_ok(run_cases(pools(world), [c for lay in LAYOUTS for c in _grid(world, lay)]))


def test_bf16_error_does_not_grow_with_world_size(pools):
    """PEERS §1 defect 4: dK/dV partials are summed in fp32 on the wire, so W = 8 is no worse than W = 2."""
    cases = [Case(method=AG, layout=lay, seq_len=64, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16", seed=3,
                  options=(("heads_k_stride", 1),)) for lay in LAYOUTS]
    r8 = run_cases(pools(8), cases)
    r2 = run_cases(pools(2), cases)
    for a, b in zip(r2, r8):
        assert a.ok and b.ok, f"{a}\n{b}"
        for f in ("out", "dq", "dk", "dv"):
            e2, e8 = a.verdicts[f].error, b.verdicts[f].error
            assert e8 <= 1.25 * e2 + 1e-4, f"{a.case.layout} {f}: error {e8:.2e} at W=8 vs {e2:.2e} at W=2"


def test_grad_dtype_is_the_wire_dtype(pools):
    """grad_dtype=bf16 puts dK/dV partials on the wire in bf16 (bigger dk/dv error); fp32 is the default."""
    case = Case(method=AG, layout="zigzag", seq_len=32, heads=4, kv_heads=2, head_dim=16, seed=5)
    fp32, bf16 = run_cases(pools(2), [case, case.with_(options=(("grad_dtype", torch.bfloat16),))])
    assert fp32.ok, fp32
    for f in ("out", "lse", "dq"):
        assert bf16.verdicts[f].error == pytest.approx(fp32.verdicts[f].error, abs=1e-9), f
    for f in ("dk", "dv"):
        assert 1e-4 < bf16.verdicts[f].error < 2e-2, bf16
        assert bf16.verdicts[f].error > 10 * fp32.verdicts[f].error, (bf16, fp32)


def test_lse_gradient_and_head_dim_256(pools):
    cases = [Case(method=AG, layout="zigzag", seq_len=8, heads=4, kv_heads=2, lse_grad=True,
                  options=(("heads_k_stride", 1),)),
             Case(method=AG, layout="contiguous", causal=False, seq_len=8, lse_grad=True, dtype="float64"),
             Case(method=AG, layout="zigzag", seq_len=4, heads=2, kv_heads=1, head_dim=256)]
    assert_all_ok(run_cases(pools(2), cases))


# ---- the plan (single process) ----

def _cells(task) -> int:
    lo, hi = task.mask.lo, task.mask.hi
    return sum(1 for i in range(task.rows) for j in range(task.cols)
               if (lo is None or j - i >= lo) and (hi is None or j - i <= hi))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_gathers_by_parts_in_three_calls(world):
    """Note [Gather by parts]: zigzag gathers its front chunks and its back chunks separately (no permutation of
    the gathered keys), and every rank runs three calls - its front chunk bottom-right against the fronts it
    sees, its back chunk's diagonal block, the rest of what the back chunk sees in one full call - whose (query,
    key) pairs are exactly the causal ones, each once."""
    h = 3
    lay = Zigzag(world)
    seq = 2 * world * h
    for r in range(world):
        gp = gather_plan(lay, r, seq, Rule(True), None, None)
        assert gp.order is None and len(gp.slots) == 2 and len(gp.tasks) == 3
        assert sorted((a, n) for a, n, _ in gp.slots) == [(0, h), (h, h)]
        assert sorted(o for _, _, o in gp.slots) == [0, world * h]
        qpos = lay.segments(r, seq).positions()
        pairs = []
        for t in gp.tasks:
            assert t.mask in (Band(None, None), Band(None, t.cols - t.rows)), "full or bottom-right causal"
            keys = gp.key_positions(t)
            pairs += [(qpos[i], keys[j]) for i in range(t.q_start, t.q_stop) for j in range(t.cols)
                      if t.mask == Band(None, None) or j - i + t.q_start <= t.cols - t.rows]
        assert sorted(pairs) == sorted((p, k) for p in qpos for k in range(p + 1))
        assert len(gather_plan(lay, r, seq, Rule(False), None, None).tasks) == 1
        cgp = gather_plan(Contiguous(world), r, seq, Rule(True), None, None)
        assert cgp.order is None and cgp.slots is None and len(cgp.tasks) == 1


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_rank_zero_runs_three_kernel_calls_on_a_kernel_that_splits_bands(world):
    """Note [Split bands as tasks]: a band of full keys and a causal rest reaches cuDNN (here CPU flash, which splits
    the same way) as two tasks of the call, never a split inside the kernel; rank 0's parts order leaves it none to
    split (three calls), every other rank one (its front chunk against the fronts it sees: four)."""
    from seqpar.kernels.executor import TaskRunner, split_band

    h = 64
    lay = Zigzag(world)
    seq = 2 * world * h
    for r in range(world):
        gp = gather_plan(lay, r, seq, Rule(True), None, None)
        assert sum(map(split_band, gp.tasks)) == (0 if r == 0 else 1)
        runner = TaskRunner("auto", 1.0)
        calls = runner.kernels(gp.tasks, (1, 2 * h, 4, 8), (1, 2 * h, 2, 8), torch.float32, "cpu")
        assert {name for _, name in calls} == {"cpu_flash"} and not any(split_band(t) for t, _ in calls)
        assert len(calls) == (3 if r == 0 else 4), (r, calls)
    band = (Task(0, h, 0, 3 * h, Band(None, 2 * h)),)
    split = TaskRunner("auto", 1.0).kernels(band, (1, h, 4, 8), (1, 3 * h, 2, 8), torch.float32, "cpu")
    assert [t.mask for t, _ in split] == [Band(None, None), Band(None, 0)]
    assert [(t.k_start, t.k_stop) for t, _ in split] == [(0, 2 * h), (2 * h, 3 * h)]
    whole = TaskRunner("reference", 1.0).kernels(band, (1, h, 4, 8), (1, 3 * h, 2, 8), torch.float32, "cpu")
    assert [t for t, _ in whole] == list(band)        # a kernel that serves the band in one call keeps it whole


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_chunk_permutations_are_a_few_copies(world):
    """Note [Chunk copies]: zigzag's rank-order -> global-order map is one strided copy of the fronts and one
    copy per back chunk (W + 1), its inverse one strided copy per rank (W); both equal ``index_select``; an
    order of more than ``COPY_RUNS`` runs (a per-batch layout's) stays one ``index_select``."""
    from seqpar.methods import allgather

    _, order = allgather._chunk_order(make_layout("zigzag", world), 4 * world)
    maps = allgather._ChunkIndex.of(order, torch.device("cpu"))
    assert (len(maps.to_global.runs), len(maps.to_rank.runs)) == (world + 1, world)
    src = torch.randn(2 * world * 3, 5, 2)
    for m in (maps.to_global, maps.to_rank):
        index = [s + step * i for _, s, step, n in m.runs for i in range(n)]
        assert sorted(index) == list(range(2 * world))
        dst = torch.empty_like(src)
        m.apply(src, dst)
        assert torch.equal(dst, src.view(2 * world, -1)[index].view_as(src))
    rng = random.Random(world)
    for n in (7, allgather.COPY_RUNS * 3):
        perm = list(range(n))
        rng.shuffle(perm)
        m = allgather._ChunkMap.of(perm, torch.device("cpu"))
        assert (m.runs is None) == (n > allgather.COPY_RUNS)
        src = torch.randn(n * 2, 3)
        dst = torch.empty_like(src)
        m.apply(src, dst)
        assert torch.equal(dst, src.view(n, -1)[perm].view_as(src))


def test_first_touch_copies_where_no_call_wrote_and_zeroes_the_rest():
    """Note [First touch]: applying each call's pieces (copy where no earlier call wrote, add where one did) and
    zeroing the unwritten rows gives the zero-then-add sum bit for bit, for random overlapping calls; zigzag by
    parts writes every row it does not zero with a copy first."""
    from seqpar.methods.allgather import _first_touch

    rng = random.Random(3)
    for _ in range(200):
        rows = rng.randint(1, 40)
        tasks = []
        for _ in range(rng.randint(0, 5)):
            a = rng.randrange(rows)
            tasks.append(Task(0, 1, a, rng.randint(a + 1, rows), Band(None, None)))
        touch, zero = _first_touch(tuple(tasks), rows)
        grads = [torch.randn(t.k_stop - t.k_start, dtype=torch.float32).bfloat16() for t in tasks]
        want = torch.zeros(rows)
        for t, g in zip(tasks, grads):
            want[t.k_start:t.k_stop] += g
        got = torch.full((rows,), float("nan"))
        for a, z in zero:
            got[a:z].zero_()
        for t, pieces, g in zip(tasks, touch, grads):
            assert [p[:2] for p in pieces] == sorted(p[:2] for p in pieces)
            assert pieces[0][0] == t.k_start and pieces[-1][1] == t.k_stop
            for a, z, add in pieces:
                src = g[a - t.k_start:z - t.k_start]
                if add:
                    got[a:z] += src
                else:
                    got[a:z] = src
        assert torch.equal(got, want)
    world, h = 8, 4
    for r in range(world):
        gp = gather_plan(Zigzag(world), r, 2 * world * h, Rule(True), None, None)
        touch, zero = _first_touch(gp.tasks, 2 * world * h)
        assert sum(z - a for a, z in zero) == 2 * world * h - sum(z - a for p in touch for a, z, add in p if not add)


def test_overlapping_calls_sum_in_one_pass_within_the_accumulators_memory():
    """Note [Overlapping calls in one pass]: only where some call adds to rows an earlier one wrote, and only while
    the calls' gradients take no more memory than the fp32 accumulator; disjoint calls stay first touch. The
    bf16 balanced case of ``test_selective_gather_matches_oracle`` takes this path (its fp32 twin does not)."""
    from seqpar.methods.allgather import _in_one_pass

    full = Band(None, None)
    overlap = (Task(0, 4, 0, 40, full), Task(4, 8, 10, 60, full))          # 90 key rows of 64
    disjoint = (Task(0, 4, 0, 30, full), Task(4, 8, 30, 64, full))
    assert _in_one_pass(overlap, 64, 2, 4)                                  # bf16 grads: 180 <= 256 bytes
    assert not _in_one_pass(overlap, 64, 4, 4)                              # fp32 grads: 360 > 256
    assert not _in_one_pass(disjoint, 64, 2, 4)
    assert not _in_one_pass(overlap[:1], 64, 2, 4)
    many = tuple(Task(i, i + 1, 0, 64, full) for i in range(3))            # 3 x 64 rows of bf16 > 64 of fp32
    assert _in_one_pass(many[:2], 64, 2, 4) and not _in_one_pass(many, 64, 2, 4)
    for world in (2, 3, 4, 8):          # the oracle's bf16 balanced case reaches the path on some rank (a split
        case = _selective_cases(world)[-1]                     # band's two tasks keep its keys and its overlaps)
        assert case.layout == "balanced" and case.dtype == "bfloat16"
        lay, rule = make_layout("balanced", world, case.cu_seqlens), Rule(True)
        plans = [gather_plan(lay, r, case.seq_len, rule, case.cu_seqlens, None) for r in range(world)]
        assert any(_in_one_pass(gp.tasks, gp.selection.rows, 2, 4) for gp in plans), world


def test_zigzag_balances_causal_work_contiguous_does_not():
    """PEERS §1 defect 7: llama3's contiguous split is causally imbalanced; zigzag is exact."""
    world, seq = 4, 32
    for lay, balanced in ((Zigzag(world), True), (Contiguous(world), False)):
        work = [sum(_cells(t) for t in gather_plan(lay, r, seq, Rule(True), None, None).tasks) for r in range(world)]
        assert sum(work) == seq * (seq + 1) // 2
        assert (len(set(work)) == 1) == balanced, (lay, work)


def test_documents_one_call_per_piece_and_no_shared_rows():
    world, seq = 3, 24
    bounds = (0, 1, 2, 9, 10, 20, 24)               # length-1 documents, one spanning three chunks
    for lay in (Contiguous(world), Zigzag(world)):
        for rule in (Rule(True), Rule(False), Rule(True, (2, -1)), Rule(False, (1, 3))):
            for r in range(world):
                gp = gather_plan(lay, r, seq, rule, bounds, None)
                pieces = lay.segments(r, seq).cut(bounds).runs
                assert len(gp.tasks) <= len(pieces)
                rows = sorted((t.q_start, t.q_stop) for t in gp.tasks)
                assert all(a[1] <= b[0] for a, b in itertools.pairwise(rows)), "a query row in two calls"
                for t in gp.tasks:                   # keys never leave the query's document
                    qpos = lay.segments(r, seq).positions()[t.q_start]
                    doc = max(d for d in range(len(bounds) - 1) if bounds[d] <= qpos)
                    keys = gp.key_positions(t)
                    assert bounds[doc] <= keys[0] and keys[-1] < bounds[doc + 1]


# ---- the selective gather (Note [Selective gather]) ----

def _packed(rng: random.Random, seq: int, pad: int, longest: int) -> tuple[int, ...]:
    """Random document bounds over ``seq - pad`` tokens: lengths 1..longest (so some are shorter than a block)."""
    cu = [0]
    while cu[-1] < seq - pad:
        cu.append(min(seq - pad, cu[-1] + rng.randint(1, longest)))
    return tuple(cu)


def _positions(spans) -> list[int]:
    return [g for a, b in spans for g in range(a, b)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_selection_reads_exactly_the_visible_keys_and_ranks_agree(world):
    """Every rank's compact buffer is exactly the keys its queries see (dense truth), its calls read only
    it, and what rank j sends rank r is what r expects from j, row for row, in the same order."""
    rng = random.Random(world)
    seq = 12 * world
    rules = (Rule(True), Rule(False), Rule(True, (3, -1)), Rule(False, (2, 1)),
             Rule(False, mask=masks.sink_window(3, 2)), Rule(True, mask=masks.chunked(5)),
             Rule(False, mask=masks.shared_prefix(seq // 3, [seq // 4, seq // 3])))
    for trial in range(6):
        name = ("contiguous", "zigzag", "balanced", "balanced", "doc_zigzag", "doc_contiguous")[trial]
        div = {"doc_zigzag": 2 * world, "doc_contiguous": world}.get(name, 1)
        cu = tuple(div * -(-c // div) for c in _packed(rng, seq, 2 * div if trial % 2 else 0, 5))
        cu = tuple(sorted(set(cu)))
        lay = make_layout(name, world, cu)
        for rule in rules:
            plans = [gather_plan(lay, r, seq, rule, cu, None) for r in range(world)]
            if any(p.selection is None for p in plans):
                assert max(len(_positions(needed_keys(lay, r, seq, rule, cu, None)))
                           for r in range(world)) > SELECT_AT * seq
                continue
            for r, gp in enumerate(plans):
                q_pos = lay.segments(r, seq).positions()
                k_pos = list(range(seq))
                doc = [next((d for d in range(len(cu) - 1) if cu[d] <= p < cu[d + 1]), -1) for p in range(seq)]
                dense = visible_dense(q_pos, k_pos, rule, [doc[p] for p in q_pos], doc)
                seen = sorted({k_pos[j] for row in dense for j, v in enumerate(row) if v})
                assert _positions(gp.keys) == seen, (name, rule, r)
                assert gp.selection.rows == len(seen)
                for t in gp.tasks:
                    assert set(gp.key_positions(t)) <= set(seen)
                for j in range(world):       # j's pieces for r, as positions, against r's pieces from j
                    held = plans[j]
                    local = lay.segments(j, seq).positions()
                    sent = [local[a + i] for a, n in held.selection.send[r] for i in range(n)]
                    compact = _positions(gp.keys)
                    got = [compact[a + i] for a, n in gp.selection.recv[j] for i in range(n)]
                    assert sent == got, (name, rule, j, r)


@pytest.mark.parametrize("layout,share", [("zigzag", 0.26), ("balanced", 0.5)])
def test_selection_on_a_packed_row_moves_a_fraction_of_the_sequence(layout, share):
    """The bench's 128K lognormal row (seed 0) at W = 8: the busiest reader needs a quarter (zigzag) or half
    (balanced: long documents are split over every rank, so their last chunks read the whole document) of the
    keys; the full all-gather moves every rank the whole sequence."""
    from seqpar.layouts.packing import packed_row

    S = 1 << 17
    cu = packed_row(S, "lognormal", seed=0)
    lay = make_layout(layout, 8, cu)
    needs = [len(_positions(needed_keys(lay, r, S, Rule(True), cu, None))) for r in range(8)]
    assert max(needs) < share * S, needs
    assert gather_plan(lay, 0, S, Rule(True), cu, None).selection is not None


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_selection_widens_to_tiles_where_runs_start_on_them(layout):
    """Note [Selective gather on tiles]: where every run starts on a 128-key tile, each gathered interval is whole
    tiles, so compact rows keep their global positions' offsets in a tile (the kernels' diagonals stay on tiles);
    it holds every visible key. Runs off tiles keep exactly the visible keys."""
    from seqpar.methods.allgather import KEY_TILE

    world = 4
    for seq, tiled in ((world * 2 * KEY_TILE, True), (world * 2 * 100, False)):
        for rule in (Rule(False, mask=masks.sink_window(200, 3)), Rule(True, (300, -1))):
            lay = make_layout(layout, world, None)
            for r in range(world):
                gp = gather_plan(lay, r, seq, rule, None, None)
                assert gp.selection is not None, (seq, rule, r)
                q_pos = lay.segments(r, seq).positions()
                dense = visible_dense(q_pos, list(range(seq)), rule)
                seen = sorted({j for row in dense for j, v in enumerate(row) if v})
                got = _positions(gp.keys)
                if tiled:
                    assert set(seen) <= set(got) and len(got) < seq
                    assert all(a % KEY_TILE == 0 and (b % KEY_TILE == 0 or b == seq) for a, b in gp.keys), gp.keys
                else:
                    assert got == seen


def test_sink_window_gathers_its_window_not_the_sequence():
    """The sink window at 128K over 8 (contiguous): the busiest reader receives its sinks' tile and its 4095-key
    halo widened to a tile (4224 rows) where the full all-gather moved 7/8 of the sequence; Llama 4's chunks of
    8K inside 16K per rank need no key from another rank; a mask of more than ``SELECT_PIECES`` pieces gathers
    everything."""
    from seqpar.methods.allgather import selected_rows

    S, W = 1 << 17, 8
    lay = make_layout("contiguous", W, None)
    assert selected_rows(lay, S, Rule(False, mask=masks.sink_window(4095, 4)), None) == (20608, 4224)
    assert selected_rows(lay, S, Rule(True, mask=masks.chunked(8192)), None) == (16384, 0)
    # past SELECT_PIECES pieces every rank's plan over the sequence costs seconds of host time: the full gather
    from seqpar.methods.allgather import SELECT_PIECES
    M = 1 << 20
    assert selected_rows(lay, M, Rule(True, mask=masks.chunked(M // SELECT_PIECES)), None) == (M // W, 0)
    assert selected_rows(lay, M, Rule(False, mask=masks.block_causal(M // (2 * SELECT_PIECES))), None) is None


def _selective_cases(world: int) -> list[Case]:
    S = 12 * world
    docs = list(range(2 * world + 1))              # 2W documents of one token, then of three, then a long one
    while docs[-1] < S - 4 - 3 * world:
        docs.append(docs[-1] + 3)
    padded, whole = (*docs, S - 4), (*docs, S)
    base = Case(method=AG, seq_len=S, heads=4, kv_heads=2, head_dim=8, seed=world, cu_seqlens=whole)
    return [base.with_(layout="balanced", lse_grad=True),
            base.with_(layout="balanced", causal=False, window=(2, 3), cu_seqlens=padded, valid_len=S - 4,
                       kv_heads=1),
            base.with_(layout="zigzag", cu_seqlens=None, window=(3, 0), options=(("heads_k_stride", 1),)),
            base.with_(layout="contiguous", dtype="float64", cu_seqlens=padded, valid_len=S - 4, value_dim=4,
                       sinks=True),
            base.with_(layout="balanced", dtype="bfloat16", options=(("heads_k_stride", 1),))]


def _tiled_cases(world: int) -> list[Case]:
    """Named masks' selective gathers widened to whole tiles (Note [Selective gather on tiles]): W = 4, 256 rows per
    rank, zigzag's chunks of 128."""
    if world != 4:
        return []
    base = Case(method=AG, seq_len=1024, heads=2, kv_heads=1, head_dim=8, seed=world, causal=False)
    return [base.with_(layout="contiguous", mask=masks.sink_window(50, 3)),
            base.with_(layout="contiguous", mask=masks.chunked(128), causal=True, lse_grad=True),
            base.with_(layout="zigzag", mask=masks.sink_window(100, 2))]


def _local_cases(world: int) -> list[Case]:
    """Note [Local keys]: Llama 4's chunks inside every rank's rows (contiguous) or zigzag's pieces, with documents,
    padding, the lse gradient and head rounds; short documents placed whole on ranks."""
    S = 12 * world
    base = Case(method=AG, seq_len=S, heads=4, kv_heads=2, head_dim=8, seed=world + 7)
    return [base.with_(layout="contiguous", mask=masks.chunked(12), lse_grad=True),
            base.with_(layout="zigzag", mask=masks.chunked(6), causal=False, cu_seqlens=(0, 4, S - 2),
                       valid_len=S - 2, options=(("heads_k_stride", 1),)),
            base.with_(layout="balanced_whole", cu_seqlens=tuple(range(0, S + 1, 3)), lse_grad=True)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_selective_gather_matches_oracle(pools, world):
    """Documents (shorter than a block, one over every rank), windows, padding, the lse gradient, MLA head dims,
    sinks, head chunks, a bf16 wire, named masks on tiles and keys that stay local, with the selective gather
    (or, where no rank reads another's keys, none) taken on every rank."""
    cases = [*_selective_cases(world), *_tiled_cases(world), *_local_cases(world)]
    for c in cases:
        lay = make_layout(c.layout, world, c.cu_seqlens)
        rule = Rule(c.causal, c.window, mask=c.mask)
        for r in range(world):
            assert gather_plan(lay, r, c.seq_len, rule, c.cu_seqlens, c.valid_len).selection is not None, c
    for c in _local_cases(world):
        rule = Rule(c.causal, c.window, mask=c.mask)
        assert local_keys(make_layout(c.layout, world, c.cu_seqlens), c.seq_len, rule, c.cu_seqlens, c.valid_len)
    wire = cases[0].with_(options=(("grad_dtype", torch.bfloat16),))       # partials on the wire in bf16
    *reports, bf16 = run_cases(pools(world), [*cases, wire])
    assert_all_ok(reports)
    for f in ("out", "lse", "dq"):
        assert bf16.verdicts[f].ok, bf16
    for f in ("dk", "dv"):
        assert 1e-4 < bf16.verdicts[f].error < 2e-2, bf16


# ---- communication layer and errors (distributed workers) ----

def _comm_worker(world_unused: int) -> dict:
    import torch.distributed as dist

    from seqpar.comm.all_gather import AllGather, AllToAllV

    ag = AllGather(None)
    r, w = dist.get_rank(), dist.get_world_size()
    send = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r
    recv = torch.empty(2 * w, 3)
    h = ag.gather(send, recv)
    h.wait()
    h.wait()                                          # idempotent
    big = torch.ones(2 * w, 3, dtype=torch.float64) * (r + 1)
    big[2 * r:2 * r + 2] += 10
    small = torch.empty(2, 3, dtype=torch.float64)
    ag.reduce_scatter(big, small).wait()
    a2a = AllToAllV(None)                             # rank j sends rank d (j + d + 1) rows of value 10 j + d
    rows = [r + d + 1 for d in range(w)]
    out_rows = [j + r + 1 for j in range(w)]
    x = torch.cat([torch.full((n, 2), 10.0 * r + d) for d, n in enumerate(rows)])
    y = torch.empty(sum(out_rows), 2)
    a2a.exchange(x, y, rows, out_rows).wait()
    errors = []
    for bad in (lambda: a2a.exchange(x, y, [*rows[::-1], 1], out_rows),
                lambda: a2a.exchange(x, y.double(), rows, out_rows),
                lambda: ag.gather(send, torch.empty(2 * w + 1, 3)),
                lambda: ag.gather(send, torch.empty(2 * w, 3, dtype=torch.float64)),
                lambda: ag.reduce_scatter(torch.empty(2 * w, 3).t(), torch.empty(3, 2))):
        try:
            bad()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return {"recv": recv, "small": small, "a2a": y, "errors": errors}


def test_all_gather_reduce_scatter_and_uneven_all_to_all(pools):
    w = 2
    res = pools(w).run(_comm_worker, w)
    want = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * j for j in range(w)])
    total = sum(range(1, w + 1))
    for got in res:
        assert torch.equal(got["recv"], want)
        assert torch.equal(got["small"], torch.full((2, 3), float(total + 10), dtype=torch.float64))
        assert all(e is not None for e in got["errors"]), got["errors"]
    for r, got in enumerate(res):
        want_a2a = torch.cat([torch.full((j + r + 1, 2), 10.0 * j + r) for j in range(w)])
        assert torch.equal(got["a2a"], want_a2a)


def _error_worker(_: int) -> list[str]:
    import seqpar

    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 4, 4, 8)
    out = []
    for kw in ({"heads_k_stride": 3}, {"heads_k_stride": 0}, {"heads_k_stride": True}, {"heads_k_stride": 2.0},
               {"node_size": 2}, {"layout": "stripe"}):
        try:
            seqpar.attention(q, k, k, method=AG, **{"layout": "zigzag", **kw})
            out.append("no error")
        except (ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_bad_options_raise_before_any_collective(pools):
    msgs = pools(2).run(_error_worker, 0)[1]
    for m in msgs[:4]:
        assert m.startswith("ValueError: heads_k_stride must be None or a positive divisor of the KV heads (4)"), m
        assert "(rank 1 of 2)" in m
    assert msgs[4].startswith("TypeError: method='allgather' takes options ['heads_k_stride']"), msgs[4]
    assert msgs[5].startswith("ValueError: layout must be one of ['contiguous', 'zigzag', 'balanced'"), msgs[5]


def _one_rank_worker(_: int) -> list[tuple[int, int]]:
    """The heads each kernel call sees at W = 1 with ``heads_k_stride=1`` (recorded by wrapping the runner)."""
    import seqpar
    from seqpar.kernels.executor import TaskRunner

    seen = []
    forward = TaskRunner.forward

    def spy(self, q, k, v, task):
        seen.append((q.shape[2], k.shape[2]))
        return forward(self, q, k, v, task)

    TaskRunner.forward = spy
    try:
        q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)
        seqpar.attention(q, k, k, method=AG, layout="zigzag", heads_k_stride=1)
    finally:
        TaskRunner.forward = forward
    return seen


def test_heads_k_stride_bounds_the_kernel_calls_at_one_rank(pools):
    """At W = 1 there is no gather to chunk, but the option still bounds the kernel's workspace (never ignored):
    one call per KV head with its query heads."""
    assert pools(1).run(_one_rank_worker, 0)[0] == [(2, 1), (2, 1)]
