"""The emulated world (rank r of W on torch's fake process group, one process) on CPU: the step program of each
method - kernel calls per step, merges per call - and the benchmark's ``--emulate-world`` mode as a smoke run.

A fake group moves no data, so nothing here checks values (the oracle tests do, on gloo); what it pins down is
the per-rank path's structure, so a regression to per-step merges or extra kernel calls cannot come back
silently (Note [One merge per call] in ``seqpar.kernels.combine``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.kernels import combine, merge
from seqpar.kernels.executor import TaskRunner, split_band
from seqpar.layouts import make_layout
from seqpar.layouts.blocks import Band, Rule, Task
from seqpar.layouts.packing import packed_row
from seqpar.methods import _passq
from seqpar.methods._shared import split_own
from seqpar.runtime import call as _call

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_world():
    """``start(W, rank)``: this process becomes rank ``rank`` of a W-rank fake group (torn down after)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int, rank: int = 0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
    _call.cache_clear()


@pytest.fixture
def counts(monkeypatch):
    """Counts of kernel calls (forward, backward), step-by-step merges, one-pass merges and sums."""
    seen: Counter = Counter()

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(TaskRunner, "forward", counting("kernel_fwd", TaskRunner.forward))
    monkeypatch.setattr(TaskRunner, "backward", counting("kernel_bwd", TaskRunner.backward))
    monkeypatch.setattr(merge, "merge_", counting("merge_step", merge.merge_))
    monkeypatch.setattr(combine, "merge_parts", counting("merge_once", combine.merge_parts))
    monkeypatch.setattr(combine, "sum_parts", counting("sum_once", combine.sum_parts))
    return seen


def _call_once(method: str, layout: str | None, world: int, causal: bool = True, **options):
    L, H, Hkv, D = 4 * world * max(world - 1, 1), 4, 2, 16
    q = torch.randn(1, L, H, D, requires_grad=True)
    k = torch.randn(1, L, Hkv, D, requires_grad=True)
    v = torch.randn(1, L, Hkv, D, requires_grad=True)
    out = seqpar.attention(q, k, v, method=method, layout=layout, causal=causal, check_ranks=False, kernel="reference",
                           **options)
    return out, (q, k, v)


#: method, layout, options -> (kernel calls per forward, per backward) at W ranks: one call per ring step
STEP_PROGRAMS = {
    ("ring", "zigzag"): lambda W: (W, W),
    ("ring", "contiguous"): lambda W: (W, W),
    ("double_ring", "zigzag"): lambda W: (W, W),
}


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("method,layout", sorted(STEP_PROGRAMS))
def test_ring_family_step_program(fake_world, counts, method, layout, world):
    """A pass-KV ring's forward is one kernel call per step and ONE merge per call (never one per step); its
    backward one kernel call per step and one sum each of dQ, dK and dV (the double ring: one dQ sum, one dK and
    one dV sum per pass)."""
    fake_world(world, rank=world - 1)              # the busiest rank of a contiguous ring, any rank of zigzag
    options = {"node_size": 2} if method == "double_ring" else {}
    out, leaves = _call_once(method, layout, world, **options)
    fwd, bwd = STEP_PROGRAMS[(method, layout)](world)
    assert counts["kernel_fwd"] == fwd and counts["merge_once"] == 1 and counts["merge_step"] == 0, counts
    counts.clear()
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert counts["kernel_bwd"] == bwd and counts["merge_step"] == 0, counts
    # ring: its dQ, dK and dV, each once (Note [Partials home]); double ring (nodes of 2): its dQ, and each pass's dK
    # and dV of the block it began with, with the total that arrived (Note [Double-ring partials home])
    assert counts["sum_once"] == (3 if method == "ring" else 2 * (world // 2) + 1), counts


@pytest.mark.parametrize("node_size,dtype,path", [
    (1, torch.bfloat16, "_backward_owner"), (2, torch.bfloat16, "_backward_owner"),
    (4, torch.bfloat16, "_backward_home"), (2, torch.float32, "_backward_home")])
def test_double_ring_backward_path(fake_world, monkeypatch, node_size, dtype, path):
    """Note [Double-ring partials home]: at short chunks the partials go straight to their owners where a pass's w
    of them in the inputs' dtype weigh no more than the fp32 total they replace on the outer link (nodes of 1 or 2,
    bf16), else to the pass's first holder; one path on every rank, whatever each rank's steps hold."""
    from seqpar.methods import double_ring

    taken = []
    for name in ("_backward_owner", "_backward_home"):
        fn = getattr(double_ring._Engine, name)
        monkeypatch.setattr(double_ring._Engine, name, lambda self, b, fn=fn, name=name: taken.append(name) or fn(
            self, b))
    for rank in (0, 3):
        _call.cache_clear()                     # a planned call holds the group of the world before
        fake_world(4, rank=rank)
        q, k, v = (torch.randn(1, 16, h, 16, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
        out = seqpar.attention(q, k, v, method="double_ring", layout="contiguous", causal=True, check_ranks=False,
                               kernel="reference", node_size=node_size)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert taken == [path, path], taken


@pytest.mark.parametrize("method,layout", [("tasp", "zigzag"), ("ulysses", None), ("usp", "zigzag")])
def test_other_methods_merge_once(fake_world, counts, method, layout):
    """TASP, Ulysses and USP merge their partials once per call, whatever the step count."""
    fake_world(4)
    options = {"mesh": seqpar.make_mesh(ulysses=2, device_type="cpu")} if method == "usp" else {}
    _call_once(method, layout, 4, **options)
    assert counts["merge_step"] == 0 and counts["merge_once"] <= 1, counts
    assert counts["kernel_fwd"] >= 1


@pytest.mark.parametrize("world", [4, 8])
def test_tasp_forward_step_program(fake_world, counts, world):
    """TASP's forward at short chunks runs its own block whole - one causal call - and one call per gathered group
    (Notes [TASP forward at short chunks]); its backward splits the own block in two (Note [Hiding the tail])."""
    from seqpar.layouts import Rule
    from seqpar.methods import _tasp, tasp

    fake_world(world, rank=1)
    _, leaves = _call_once("tasp", "zigzag", world)
    L = leaves[0].shape[1]
    tp = _tasp.schedule(tasp._placement("zigzag", tasp.GroupSizes(world))[0], 1, L, Rule(True), None, None,
                        "direct", True)
    assert len(tp.own) == 1 and len(tp.early) == len(tp.late) == 1
    assert counts["kernel_fwd"] == 1 + sum(map(len, tp.gathered.tasks)) and counts["merge_once"] == 1, counts


@pytest.mark.parametrize("world", [4, 8])
def test_allgather_zigzag_step_program(fake_world, counts, world):
    """Note [Gather by parts]: all-gather over zigzag is three kernel calls and ONE merge per head chunk forward
    (one per round with heads_k_stride), three backward calls per round, and no merge step by step."""
    fake_world(world)
    out, leaves = _call_once("allgather", "zigzag", world)
    assert (counts["kernel_fwd"], counts["merge_once"], counts["merge_step"]) == (3, 1, 0), counts
    counts.clear()
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert counts["kernel_bwd"] == 3 and counts["merge_step"] == 0, counts
    counts.clear()
    _call_once("allgather", "zigzag", world, heads_k_stride=1)            # two KV heads: two rounds
    assert (counts["kernel_fwd"], counts["merge_once"]) == (6, 2), counts


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_allgather_with_local_keys_posts_no_collective(fake_world, counts, monkeypatch, layout):
    """Note [Local keys]: Llama 4's chunks inside every rank's rows - no rank reads another's keys - run as pass-KV's
    single step: no gather, all-to-all or reduce-scatter forward or backward, one kernel call each way."""
    from seqpar import masks
    from seqpar.comm import all_gather as ag

    def refuse(*args, **kwargs):
        raise AssertionError("a collective was posted")
    monkeypatch.setattr(ag.AllToAllV, "exchange", refuse)
    monkeypatch.setattr(ag, "_GATHER", refuse)
    monkeypatch.setattr(ag, "_REDUCE_SCATTER", refuse)
    world = 4
    fake_world(world, 1)
    L = 4 * world * (world - 1)
    chunk = L if layout == "contiguous" else L // 2
    out, leaves = _call_once("allgather", layout, world, mask_mod=masks.chunked(chunk))
    assert counts["kernel_fwd"] == (1 if layout == "contiguous" else 2), counts
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    counts.clear()
    fake_world(world, 1)                                 # a chunk across two ranks: the gather is back
    with pytest.raises(AssertionError, match="collective"):
        _call_once("allgather", layout, world, mask_mod=masks.chunked(2 * chunk))


def test_auto_plans_a_named_mask_by_its_blocks(fake_world, monkeypatch):
    """Note [Masked problems]: ``method="auto"`` hands the planner a named mask (its blocks are ranked), and a
    generic ``mask_mod`` as none (it declares no blocks); both calls run."""
    from seqpar import masks, planner

    seen = []
    real = planner.choose

    def spy(*args, **kwargs):
        seen.append(kwargs.get("mask"))
        return real(*args, **kwargs)
    monkeypatch.setattr(planner, "choose", spy)
    world = 4
    fake_world(world, 1)
    L = 4 * world * (world - 1)
    named = masks.chunked(L)
    _call_once("auto", "contiguous", world, mask_mod=named)

    def generic(b, h, q, k):
        return (q - k) % 3 == 0
    _call_once("auto", "contiguous", world, mask_mod=generic)
    assert seen == [named, None], seen


def test_allgather_by_parts_posts_one_coalesced_collective_per_round(fake_world, monkeypatch):
    """Note [Coalesced parts]: zigzag's two parts (fronts, backs) go out as one coalesced all-gather per round
    forward and in backward - K and V of a batch of one as messages of their own (Note [K and V apart]), four
    gathers in one - and their dK/dV as one coalesced reduce-scatter: never a collective per part."""
    import contextlib

    from seqpar.comm import all_gather as ag

    posted, managers = Counter(), []
    real = ag.dist._coalescing_manager

    @contextlib.contextmanager
    def counting(*args, **kwargs):
        managers.append(1)
        with real(*args, **kwargs) as cm:
            yield cm

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            posted[name, len(managers)] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(ag.dist, "_coalescing_manager", counting)
    monkeypatch.setattr(ag, "_GATHER", spy("gather", ag._GATHER))
    monkeypatch.setattr(ag, "_REDUCE_SCATTER", spy("reduce_scatter", ag._REDUCE_SCATTER))
    fake_world(4)
    out, leaves = _call_once("allgather", "zigzag", 4)
    assert len(managers) == 1 and posted == {("gather", 1): 4}, (managers, posted)
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert len(managers) == 3 and posted[("gather", 2)] == 4 and posted[("reduce_scatter", 3)] == 2, posted


@pytest.mark.parametrize("method", ["ring", "tokenring"])
def test_travelling_tensors_start_as_the_callers(fake_world, monkeypatch, method):
    """Note [K and V apart]: the pass-KV ring's forward hop is two messages, K then V, the first hop sending the
    caller's tensors themselves (no pack); pass-Q's first hop sends the caller's queries (no copy), its rows
    sliced from them."""
    from seqpar.comm import ring as ring_mod

    sent = []
    real = ring_mod.Exchange.send

    def spy(self, tensor, peer):
        sent.append(tensor)
        return real(self, tensor, peer)

    monkeypatch.setattr(ring_mod.Exchange, "send", spy)
    world = 4
    fake_world(world)
    _, (q, k, v) = _call_once(method, "zigzag", world)
    if method == "ring":
        assert len(sent) == 2 * (world - 1), len(sent)
        assert (sent[0].data_ptr(), sent[1].data_ptr()) == (k.data_ptr(), v.data_ptr())
    else:
        first = sent[0]
        assert first.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()


def test_allgather_packs_k_and_v_only_where_they_do_not_lie_as_rows(fake_world, monkeypatch):
    """Note [K and V apart]: one head round of a batch of one gathers K and V as they lie, with no send buffer;
    head rounds (``heads_k_stride``) pack each round's K and V into one."""
    from seqpar.methods import allgather as agm

    posted = []
    real = agm._Gathered.post

    def spy(self, c):
        posted.append((self.apart, self.send is None))
        return real(self, c)

    monkeypatch.setattr(agm._Gathered, "post", spy)
    fake_world(4)
    _call_once("allgather", "zigzag", 4)
    _call_once("allgather", "zigzag", 4, heads_k_stride=1)
    assert posted == [(True, True), (False, False), (False, False)], posted


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_own_block_splits_into_two_single_calls(layout, world):
    """Note [Hiding the tail]: pass-Q's and TASP's own causal block runs as two tasks split at a key row, each one
    top-left causal call - no band of full keys beside an offset diagonal, which cuDNN runs as two calls
    (``split_band``): every query against the front keys (100 of the block's 136 pairs here), the back queries
    against the back keys."""
    for r in range(world):
        seg = make_layout(layout, world).segments(r, 16 * world)
        early, late = split_own(seg, Rule(causal=True), front_first=True)
        assert early == (Task(0, 16, 0, 8, Band(None, 0)),) and late == (Task(8, 16, 8, 16, Band(None, 0)),)
        assert not any(split_band(t) for t in early + late)
        assert split_own(seg, Rule(causal=True), front_first=False) == (late, early)
    plan = _passq.schedule(make_layout(layout, world), 16 * world, Rule(causal=True), None, None)
    assert all((plan.early[r], plan.late[r]) == split_own(make_layout(layout, world).segments(r, 16 * world),
                                                          Rule(causal=True), front_first=True) for r in range(world))


@pytest.mark.parametrize("method", ["tokenring", "tasp"])
def test_pass_q_and_tasp_backward_sum_their_partials_in_one_pass(fake_world, counts, method):
    """Note [Pass-Q sums] / Note [TASP sums]: the backward's gradient partials go through the one-pass sums (dQ, dK
    and dV each summed once at the end, a guest step's rows summed into their buffer), never a merge per step; at
    most one pass per step plus the three results. TASP at short chunks (Note [TASP backward at short chunks]): the
    gathered backward's calls; its partials (exact here: fp32) go home as the kernels' own dK and dV, with no pass
    at all before they go (Note [TASP K and V apart])."""
    from seqpar.layouts import Rule
    from seqpar.methods import _tasp, tasp

    world = 4
    fake_world(world)
    out, leaves = _call_once(method, "zigzag", world)
    counts.clear()
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert counts["merge_step"] == 0, counts
    if method == "tokenring":
        assert counts["kernel_bwd"] >= world and 3 <= counts["sum_once"] <= 2 * world + 3, counts
        return
    L = leaves[0].shape[1]
    tp = _tasp.schedule(tasp._placement("zigzag", tasp.GroupSizes(world))[0], 0, L, Rule(True), None, None,
                        "direct", True)
    calls = len(tp.early + tp.late) + sum(map(len, tp.gathered.tasks))
    assert counts["kernel_bwd"] == calls < len(tp.early + tp.late) + sum(len(rd.tasks) for rd in tp.rounds), counts
    assert counts["sum_once"] == 3, counts


@pytest.mark.parametrize("kernel,dtype,sent", [("cpu_flash", torch.bfloat16, {torch.bfloat16}),
                                               ("reference", torch.bfloat16, {torch.float32}),
                                               ("cpu_flash", torch.float32, {torch.float32})])
def test_tasp_gathered_partials_travel_in_the_inputs_dtype_where_exact(fake_world, monkeypatch, kernel, dtype, sent):
    """Note [TASP backward at short chunks]: the gathered backward's partials go home in the inputs' dtype on a link
    whose every piece is exact in it - each key row in one call of a kernel that returns that dtype (CPU's fused
    kernel) - as the kernels' own dK and dV, two messages a piece (Note [TASP K and V apart]); and summed, dK and dV
    side by side in the wire's dtype (fp32 by default) where not (the reference kernel returns fp32)."""
    from seqpar.comm import ring

    world, L, sends = 4, 4 * 4 * 3, []
    fake_world(world, rank=1)
    q = torch.randn(1, L, 4, 16, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, L, 2, 16, dtype=dtype, requires_grad=True) for _ in range(2))
    out = seqpar.attention(q, k, v, method="tasp", layout="zigzag", causal=True, check_ranks=False, kernel=kernel)
    real_send = ring.Exchange.send
    monkeypatch.setattr(ring.Exchange, "send", lambda ex, t, peer: sends.append(t) or real_send(ex, t, peer))
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    from seqpar.layouts import Rule
    from seqpar.methods import _tasp, tasp

    g = _tasp.schedule(tasp._placement("zigzag", tasp.GroupSizes(world))[0], 1, L, Rule(True), None, None, "direct",
                       True).gathered
    exact = sent == {dtype}
    n = len(g.grad_out) * (2 if exact else 1)
    home = sends[len(sends) - n:]                            # the last exchange: every held piece's partial home
    assert len(g.grad_out) >= world - 1 and {t.dtype for t in home} == sent, sends
    assert {t.shape[-1] for t in home} == ({16} if exact else {32}), [t.shape for t in home]


@pytest.mark.parametrize("method,layout,options", [
    ("allgather", "zigzag", {}), ("allgather", "contiguous", {"window_size": (7, 0)}), ("ulysses", None, {}),
    ("usp", "zigzag", {"ulysses": 2})])
def test_fake_group_collectives_copy_nothing(fake_world, monkeypatch, method, layout, options):
    """Note [Fake groups copy]: on a fake group every all-gather, reduce-scatter and all-to-all of a call,
    forward and backward, is posted with empty buffers (torch's fake group would otherwise copy its input into
    the output: work no real backend does on the rank's stream); the selective gather (a window) included."""
    from seqpar.comm import all_gather as ag

    fake_world(4)
    posted: list[tuple[str, int]] = []

    def spy(name, fn):
        def wrapped(out, inp, *args, **kwargs):
            posted.append((name, out.numel() + inp.numel()))
            return fn(out, inp, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(ag, "_GATHER", spy("all_gather", ag._GATHER))
    monkeypatch.setattr(ag, "_REDUCE_SCATTER", spy("reduce_scatter", ag._REDUCE_SCATTER))
    monkeypatch.setattr(dist, "all_to_all_single", spy("all_to_all", dist.all_to_all_single))
    if options.pop("ulysses", None):
        options["mesh"] = seqpar.make_mesh(ulysses=2, device_type="cpu")
    out, leaves = _call_once(method, layout, 4, **options)
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert posted and all(n == 0 for _, n in posted), posted


def test_bench_emulated_world_smoke(tmp_path):
    """``python -m seqpar.bench --emulate-world 4`` on CPU: one process, records with the emulation fields for
    the busiest rank of each configuration (and ``--graphs``, recorded); the auto row names what auto ran in each
    mode (Note [Auto rows] in ``seqpar.bench``)."""
    cmd = [sys.executable, "-m", "seqpar.bench", "--emulate-world", "4", "--preset", "tiny-causal", "--device",
           "cpu", "--methods", "ring/contiguous,ulysses,tasp,auto", "--warmup", "0", "--iters", "1", "--graphs", "off",
           "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    recs = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    ours = [r for r in recs if not r["method"].startswith("limit")]
    assert {r["method"] for r in ours} == {"ring/contiguous", "ulysses", "tasp/zigzag", "auto/zigzag",
                                           "auto/contiguous"}
    autos = [r for r in ours if r["method"].startswith("auto/")]
    assert sorted((r["method"], r["mode"]) for r in autos) == [(f"auto/{lay}", m) for lay in ("contiguous", "zigzag")
                                                              for m in ("fwd", "fwd+bwd")], autos
    assert all(r["auto_pick"].split()[0] in seqpar.methods.available() for r in autos), autos
    for r in ours:
        for key in ("emulated_world", "tokens_per_rank", "method", "mode", "causal", "heads", "kv_heads",
                    "compute_efficiency", "host_ms_per_call", "emulated_rank", "steady_ms",
                    "steady_compute_efficiency"):
            assert key in r, (key, r)
        assert r["steady_ms"] > 0 and r["steady_compute_efficiency"] == pytest.approx(r["limit_ms"] / r["steady_ms"])
        assert r["emulated_world"] == 4 and r["tokens_per_rank"] == 128 and r["backend"] == "fake"
        assert r["graphs"] == "off"                            # --graphs: every configuration's graphs=False
    ranks = {(r["method"], r["mode"]): r["emulated_rank"] for r in ours}
    # the busiest rank of a causal contiguous ring; zigzag gives every rank the same work, TASP's middle ranks run
    # two calls a round (Method.slowest_rank)
    want = {"ring/contiguous": 3, "ulysses": 0, "tasp/zigzag": 1, "auto/zigzag": 0, "auto/contiguous": 3}
    assert ranks == {(m, mode): r for m, r in want.items() for mode in ("fwd", "fwd+bwd")}, ranks


def test_bench_emulated_packed_smoke(tmp_path):
    """The packed suite emulated (CPU, 1/64 sizes): the single-GPU varlen limit is this process's own (a fake
    group broadcasts nothing), records carry packed, row and the busiest rank; ``method="auto"`` on a balanced
    layout names what it ran (Note [Auto rows])."""
    cmd = [sys.executable, "-m", "seqpar.bench", "--emulate-world", "4", "--preset", "packed", "--small", "--device",
           "cpu", "--methods", "ring/balanced,auto/balanced", "--modes", "fwd", "--warmup", "0", "--iters", "1",
           "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    recs = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    for label in ("ring/balanced", "auto/balanced"):
        rows = [r for r in recs if r.get("method") == label]
        assert len(rows) == 4 and all(r["packed"] and r["row"].startswith("packed-") and r["emulated_world"] == 4
                                      and r["compute_efficiency"] > 0 for r in rows), rows
        # issue 23's record fields, and the row named well enough to regenerate it
        for r in rows:
            assert (r["heads"], r["kv_heads"], r["causal"]) == (32, 8, True) and r["tokens_per_rank"] > 0, r
            cu = packed_row(r["seq_len"], r["distribution"], seed=r["packing_seed"], multiple=r["packing_multiple"])
            assert len(cu) - 1 == r["documents"] and cu[-1] <= r["seq_len"], r
    picks = {r.get("auto_pick") for r in recs if r.get("method") == "auto/balanced"}
    assert picks and None not in picks and all(p.split()[0] in seqpar.methods.available() for p in picks), picks


def test_bench_emulated_mask_smoke(tmp_path):
    """A masked preset (``tiny-mask``: a prefix tree) emulated on CPU, forward and forward+backward: the limit is
    the same mask on the whole sequence (flex on a GPU; dense math SDPA on CPU, where flex has no backward), the
    busiest rank is chosen under the mask, and the record names the mask."""
    cmd = [sys.executable, "-m", "seqpar.bench", "--emulate-world", "4", "--preset", "tiny-mask", "--device", "cpu",
           "--methods", "ring/contiguous,ulysses", "--warmup", "0", "--iters", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    recs = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert [r["method"] for r in recs if r.get("method", "").startswith("limit")] == ["limit:flex-1gpu"] * 2
    ours = [r for r in recs if r.get("method") in ("ring/contiguous", "ulysses")]
    assert len(ours) == 4 and all(r["mask"] == "tree" and r["compute_efficiency"] > 0 for r in ours), ours
    assert {r["mode"] for r in ours} == {"fwd", "fwd+bwd"}


def test_packed_limit_runs_in_head_groups_when_the_whole_call_does_not_fit(monkeypatch):
    """Note [The limit in head groups]: the single-GPU varlen limit runs on H / g heads g times, g the least whose
    estimated memory fits the free memory (the 1M row: 77 GB at 32 / 8 heads, so two groups on an 80 GB GPU); its
    records name g; g calls are timed back to back."""
    from types import SimpleNamespace

    from seqpar.bench import suites

    GiB = 2**30
    assert suites.limit_bytes(1 << 20, 32, 8, 128) == 72 * GiB                 # about 77 GB: the real run's count
    assert suites.limit_head_groups(1 << 20, 32, 8, 128, 79 * GiB) == 2
    assert suites.limit_head_groups(1 << 20, 32, 8, 128, 100 * GiB) == 1
    assert suites.limit_head_groups(1 << 20, 32, 8, 128, 20 * GiB) == 4
    assert suites.limit_head_groups(1 << 20, 32, 8, 128, None) == 1            # CPU: no bound
    with pytest.raises(MemoryError, match="no head group"):                    # 12 / 6 heads: groups 1 and 2 only
        suites.limit_head_groups(1 << 20, 12, 6, 128, 10 * GiB)

    recs, seen = [], []
    bench = SimpleNamespace(measures_limit=True, emulated=True, device=torch.device("cpu"), write=recs.append,
                            args=SimpleNamespace(modes=""))
    monkeypatch.setattr(suites, "limit_head_groups", lambda *a: 4)
    monkeypatch.setattr(suites, "_time_limit", lambda b, total, cu, H, Hkv, D, g: seen.append((H, Hkv, g))
                        or {"fwd": 1.0, "fwd+bwd": 3.0})
    assert suites._varlen_limit(bench, 64, (0, 40, 64), 32, 8, 16) == {"fwd": 1.0, "fwd+bwd": 3.0}
    assert seen == [(8, 2, 4)] and {r["head_groups"] for r in recs} == {4} and len(recs) == 2
    monkeypatch.undo()

    calls = []
    monkeypatch.setattr(suites, "_reference_varlen", lambda *a: (lambda: calls.append("f"), lambda: calls.append("b")))
    monkeypatch.setattr(suites, "time_ms", lambda fn, dev, **kw: fn() or 0.5)
    assert suites._time_limit(bench, 64, (0, 40, 64), 8, 2, 16, 3) == {"fwd": 0.5, "fwd+bwd": 0.5}
    assert calls == ["f"] * 3 + ["b"] * 3
