"""Graphed calls (Note [Graphed calls] in ``seqpar.runtime.graphs``) on CPU: when auto graphs a call, and the
argument's errors. Capture and replay need CUDA: ``tests/test_gpu_runtime.py`` checks values against eager at
W = 1 and ``tests/test_gpu_emulated.py`` captures every method as rank 0 of 8."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.runtime import call as _call
from seqpar.runtime.graphs import GRAPH_ROWS, wanted

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("kw,expect", [
    (dict(device=CUDA, world=8, rows=2048, direct=False), True),                      # short chunks (packed too)
    (dict(device=CUDA, world=8, rows=GRAPH_ROWS + 1, direct=False), False),           # not host-bound
    (dict(device=CUDA, world=1, rows=2048, direct=False), False),                     # one rank: one step
    (dict(device=CUDA, world=8, rows=2048, direct=True), False),                      # one aten call
    (dict(device=CPU, world=8, rows=2048, direct=False), False),                      # no graphs on CPU
])
def test_auto_graphs_only_host_bound_calls(kw, expect):
    assert wanted(None, **kw) is expect
    assert wanted(True, **kw) is True and wanted(False, **kw) is False


@pytest.mark.parametrize("cfg,vary", [
    (dict(), False),
    (dict(cu_seqlens=(0, 16)), False),                   # one document over the whole sequence: fixed shapes
    (dict(cu_seqlens=(0, 5, 16)), True),                 # documents: shapes from the batch
    (dict(cu_seqlens=(0, 12)), True),                    # one document and padding past the divisor (4)
    (dict(seq_len=12), True),
    (dict(seq_len=13), False),                           # padding up to the divisor: at most 4 valid lengths
    (dict(cu_seqlens=(0, 14)), False),
])
def test_shapes_vary_only_with_the_batch(cfg, vary):
    """Graphs and cuDNN's per-shape plans are kept for calls whose block shapes come from the signature alone
    (Note [Plans per shape]): a balanced layout's one document ``(0, S)`` is such a call."""
    from types import SimpleNamespace

    from seqpar.config import AttentionConfig
    from seqpar.methods.base import Call

    call = SimpleNamespace(cfg=AttentionConfig(layout="balanced" if "cu_seqlens" in cfg else "zigzag", **cfg),
                           seq_len=16, layout=SimpleNamespace(divisor=4))
    call.packed = Call.packed.fget(call)
    assert Call.shapes_vary.fget(call) is vary
    # graphs (Note [Graphed calls]) leave out packed documents only: a valid length's plan recurs every layer
    assert call.packed is (len(cfg.get("cu_seqlens", ())) > 2)


@pytest.fixture
def fake2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()
    _call.cache_clear()


@pytest.mark.parametrize("graphs,err,match", [
    (True, ValueError, r"graphs=True needs CUDA tensors .*device cpu \(rank 0 of 2\)"),
    ("yes", TypeError, r"graphs must be None \(auto\), True or False, got 'yes' \(rank 0 of 2\)"),
])
def test_bad_graphs_argument_names_it(fake2, graphs, err, match):
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(err, match=match):
        seqpar.attention(q, q, q, method="ring", graphs=graphs, check_ranks=False)


def test_graphs_false_and_auto_run_on_cpu(fake2):
    q = torch.randn(1, 8, 2, 4)
    for graphs in (None, False):
        assert seqpar.attention(q, q, q, method="ring", graphs=graphs, check_ranks=False).shape == q.shape


def test_a_new_packed_batch_retires_the_graphs_of_the_ones_before(monkeypatch):
    """Note [Graphed batches]: inserting a packed batch's plan retires the graphs (their engines' ``retire``) of
    the packed plans of other batches - never its own, another plan of its batch, a padded plan's or a plan
    outside the batch tier."""
    from types import SimpleNamespace

    class Engine:
        def __init__(self):
            self.retired = 0

        def retire(self):
            self.retired += 1

    monkeypatch.setattr(_call, "footprint", lambda plan: 0)
    _call.cache_clear()
    try:
        def plan(cu):
            packed = cu is not None and len(cu) > 2
            return SimpleNamespace(engine=Engine(), call=SimpleNamespace(packed=packed),
                                   cfg=SimpleNamespace(cu_seqlens=cu))
        fixed, padded = plan(None), plan((0, 12))
        first, first_other_layer, second = plan((0, 5, 16)), plan((0, 5, 16)), plan((0, 9, 16))
        _call._insert("fixed", False, fixed)
        _call._insert("padded", True, padded)
        _call._insert("first", True, first)
        _call._insert("first, another layer shape", True, first_other_layer)
        assert [p.engine.retired for p in (fixed, padded, first, first_other_layer)] == [0, 0, 0, 0]
        _call._insert("second", True, second)
        assert [p.engine.retired for p in (fixed, padded, first, first_other_layer, second)] == [0, 0, 1, 1, 0]
        _call._insert("padded again", True, plan((0, 13)))              # not packed: retires nothing
        assert second.engine.retired == 0
    finally:
        _call.cache_clear()


def test_auto_declines_a_capture_that_could_deadlock_with_one_warning(monkeypatch):
    """Note [Graphs and shutdown]: an NCCL group with expandable segments and NCCL graph registration runs eagerly."""
    from seqpar.runtime import graphs as g

    monkeypatch.setattr(g, "_WARNED", False)
    kw = dict(device=CUDA, world=8, rows=2048, direct=False, hazard="a reason")
    with pytest.warns(UserWarning, match="short calls run without CUDA graphs here: a reason .*NCCL_GRAPH_REGISTER=0"):
        assert wanted(None, **kw) is False
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # once per process
        assert wanted(None, **kw) is False
    assert wanted(True, **kw) is True and wanted(False, **kw) is False


@pytest.mark.parametrize("backend,conf,register,hazard", [
    ("nccl", "expandable_segments:True", None, True),
    ("cpu:gloo,cuda:nccl", "max_split_size_mb:64,expandable_segments:True", None, True),
    ("nccl", "expandable_segments:True", "0", False),              # NCCL registers no captured buffers
    ("nccl", "expandable_segments:True", "1", True),
    ("nccl", "", None, False),                                     # plain cudaMalloc segments
    ("fake", "expandable_segments:True", None, False),             # the emulated world moves nothing
    ("gloo", "expandable_segments:True", None, False),
])
def test_capture_hazard(monkeypatch, backend, conf, register, hazard):
    from types import SimpleNamespace

    from seqpar.runtime.graphs import capture_hazard

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if register is None:
        monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    else:
        monkeypatch.setenv("NCCL_GRAPH_REGISTER", register)
    why = capture_hazard(SimpleNamespace(group=object(), ulysses=None, ring=None))
    assert (why is not None) is hazard
    if hazard:
        assert "expandable segments" in why and "NCCL_GRAPH_REGISTER" in why


_SHUTDOWN_CHECK = """
import tempfile, torch.distributed as dist
from seqpar.runtime import graphs as g
class Held:                                     # a Graphed's stand-in: holds one "graph"
    def __init__(self): self._graphs, self._slots, self.devices = {"fwd": object()}, [], {None}
    def release(self): n = len(self._graphs); self._graphs.clear(); order.append("released"); return n
order, held = [], Held()
g._LIVE.add(held)
g.torch.cuda.synchronize = lambda device=None: None
shutdown = dist.ProcessGroup.shutdown
def traced(self, *a, **k):
    order.append("shutdown")
    return shutdown(self, *a, **k)
dist.ProcessGroup.shutdown = traced             # torch's shutdown, logging its calls, beneath the guard
g._guard_shutdown(); g._guard_shutdown()        # idempotent
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
dist.destroy_process_group()
print(order)
"""


def test_destroying_a_group_releases_the_graphs_first():
    """Note [Graphs and shutdown]: after the first capture, ``destroy_process_group`` releases every graph before
    any group shuts down (NCCL waits for graphs holding its work), once; run in a process of its own, since the
    guard patches ``ProcessGroup.shutdown`` for the process."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHUTDOWN_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['released', 'shutdown']"


@pytest.mark.parametrize("eager,graph,keeps", [
    (((0.2, 1.0), (0.2, 0.9)), ((0.1, 0.5), (0.1, 0.6)), True),       # the device faster replayed
    (((0.2, 1.0), (0.2, 1.0)), ((0.1, 1.1), (0.1, 1.2)), False),      # the copies cost more than the host saves
    (((2.4, 1.0), (2.6, 1.0)), ((0.1, 1.1), (0.1, 1.2)), True),       # eager: host-bound (1.25 x 2.4 ms)
    (((0.9, 1.2), (0.9, 1.2)), ((0.1, 1.15), (0.1, 1.3)), True),      # host 1.125 ms with its margin, < 1.2
    (((0.2, 1.0), (0.2, 1.0)), ((0.1, 1.0), (0.1, 1.0)), False),      # a tie stays eager
])
def test_auto_times_both_ways_and_keeps_the_cheaper(monkeypatch, eager, graph, keeps):
    """Note [Which calls graph]: under auto the first call is eager, the next TIMED_CALLS eager and timed (host ms,
    device ms after a spin), then the capture and TIMED_CALLS timed replays; the next call compares the costs (the
    larger of the least device time and HOST_MARGIN x the least host time) and keeps replaying, or destroys the
    graph and runs that kind of call eagerly for good (a tie stays eager). graphs=True captures the second call and
    replays from then on, untimed."""
    from seqpar.runtime import graphs as g

    class Event:
        def __init__(self, ms=0.0):
            self.ms = ms

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.ms - self.ms

    made, resets, timings = [], [], []

    class Captured:
        def __init__(self, fn, inputs, pool, **kw):
            made.append(fn)
            self.graph = type("Graph", (), {"reset": lambda _: resets.append(1)})()

        def __call__(self, inputs, raw=frozenset()):
            return "replayed"

    times = iter([])

    def timed(store, inputs, run):
        host, device = next(times)
        timings.append(host)
        store.append((host, Event(), Event(device)))
        return run()

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(g, "_guard_shutdown", lambda: None)
    monkeypatch.setattr(g, "_Captured", Captured)
    monkeypatch.setattr(g, "_timed", timed)
    monkeypatch.setattr(g, "_LIVE", weakref.WeakSet())              # stand-ins that release_all must not meet
    assert g.TIMED_CALLS == 2 and g.HOST_MARGIN == 1.25
    engine = type("Engine", (), {"saves": False, "forward": lambda self, q, k, v: "eager"})()
    x = torch.zeros(1)
    for required in (False, True):
        made.clear()
        resets.clear()
        timings.clear()
        times = iter([*eager, *graph])
        graphed = g.Graphed(engine, required=required)
        got = [graphed.forward(x, x, x) for _ in range(8)]
        if required:
            assert got == ["eager"] + ["replayed"] * 7 and len(made) == 1 and not resets and not timings
            continue
        assert len(timings) == 2 * g.TIMED_CALLS
        if keeps:
            assert got == ["eager"] * 3 + ["replayed"] * 5 and len(made) == 1 and not resets
            assert "fwd" in graphed._kept and not graphed._timed and not graphed._replays
        else:
            assert got == ["eager"] * 3 + ["replayed"] * 2 + ["eager"] * 3 and len(made) == 1 and resets == [1]
            assert "fwd" in graphed._eager and "fwd" not in graphed._graphs


def test_a_packed_batch_plan_takes_the_last_batch_decisions(monkeypatch):
    """Note [Graphed batches]: the plan of the next packed batch, the same in all but its documents, takes the graph
    decisions of the one it retires (no timed calls after the first batch); a plan of other shapes does not."""
    from dataclasses import replace
    from types import SimpleNamespace

    from seqpar.config import AttentionConfig
    from seqpar.runtime import graphs as g

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(g, "_LIVE", weakref.WeakSet())
    engine = type("Engine", (), {"saves": False})()
    method, groups = object(), object()

    def plan(cu, q_shape=(1, 64, 8, 16)):
        call = SimpleNamespace(q_shape=q_shape, k_shape=(1, 64, 2, 16), v_shape=(1, 64, 2, 16), dtype=torch.bfloat16,
                               device=CUDA, grad=True, lse_grad=False, groups=groups)
        cfg = replace(AttentionConfig(layout="balanced"), cu_seqlens=cu)
        return SimpleNamespace(method=method, call=call, cfg=cfg, engine=g.Graphed(engine, required=False))

    old = plan((0, 100, 512))
    old.engine._kept.add("fwd")
    old.engine._eager.add(("bwd", (False,)))
    same, other = plan((0, 300, 512)), plan((0, 200, 512), q_shape=(1, 64, 4, 16))
    assert _call._same_but_batch(old, same) and not _call._same_but_batch(old, other)
    monkeypatch.setattr(_call, "footprint", lambda plan: 0)
    for p in (old, same, other):
        p.call.packed = True
    _call.cache_clear()
    try:                                                      # inserting the next batch's plans: inherit, retire
        _call._insert("old", True, old)
        _call._insert("same", True, same)
        assert old.engine.retired and not same.engine.retired
        assert same.engine._kept == {"fwd"} and same.engine._eager == {("bwd", (False,))}
        assert not same.engine._seen                          # its first call still runs eagerly (kernel plans)
        _call._insert("other", True, other)
    finally:
        _call.cache_clear()
    assert same.engine.retired and not other.engine._kept and not other.engine._eager    # other shapes: its own


def test_release_all_destroys_the_graphs_and_a_plan_called_again_captures_anew(monkeypatch):
    """Note [Graphs and shutdown]: ``release_all`` synchronizes, resets every held graph, and a plan called again
    afterwards warms up and captures again (a destroyed subgroup leaves the other plans graphed)."""
    from seqpar.runtime import graphs as g

    resets, syncs = [], []

    class Captured:
        def __init__(self, fn, inputs, pool, **kw):
            self.device = torch.device("cpu")
            self.graph = type("Graph", (), {"reset": lambda _: resets.append(1)})()

        def __call__(self, inputs, raw=frozenset()):
            return "replayed"

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    monkeypatch.setattr(g, "_guard_shutdown", lambda: None)
    monkeypatch.setattr(g, "_Captured", Captured)
    monkeypatch.setattr(g, "_LIVE", weakref.WeakSet())              # this test's graphs alone
    engine = type("Engine", (), {"saves": False, "forward": lambda self, q, k, v: "eager"})()
    graphed = g.Graphed(engine, required=True)
    x = torch.zeros(1)
    assert [graphed.forward(x, x, x) for _ in range(3)] == ["eager", "replayed", "replayed"]
    assert g.release_all() == 1 and resets == [1] and len(syncs) == 2
    assert g.release_all() == 0 and resets == [1]                    # nothing left to release
    assert not graphed.retired
    assert [graphed.forward(x, x, x) for _ in range(3)] == ["eager", "replayed", "replayed"]
    graphed.retire()                                                 # a passed batch: eager for good
    assert resets == [1, 1] and [graphed.forward(x, x, x) for _ in range(2)] == ["eager", "eager"]


class _SavingEngine:
    """A saving engine on CPU (Ulysses' shape of one): the saved tensors are views into one buffer, as Ulysses'
    q, k and v are into its receive buffer, beside an output of their own."""

    saves = True

    def forward(self, q, k, v):
        recv = torch.cat([q + 1, k * 3])
        return q * 2, q.sum(-1), (recv[: len(q)], recv[len(q):], q - v)

    def backward(self, b):
        a, c, d = b.saved
        return b.rows.do * a, b.rows.do * c, b.rows.do * d


@pytest.fixture
def cpu_graphs(monkeypatch):
    """``seqpar.runtime.graphs`` with graphs emulated on CPU: a "capture" runs the function once on the static
    inputs, a "replay" runs it again and writes its results into the captured outputs - what a CUDA graph's replay
    does to the same buffers."""
    import contextlib

    from seqpar.runtime import graphs as g

    class CpuCaptured(g._Captured):
        made: list = []

        def __init__(self, fn, inputs, pool, *, shared=None, in_place=frozenset()):
            self.device, self.in_place = None, in_place
            self.static = g._statics(inputs, shared, in_place)
            self.flat, self.spec = g._flatten(fn(*self.static))
            me = self

            class Graph:
                def replay(_):
                    for dst, src in zip(me.flat, g._flatten(fn(*me.static))[0]):
                        dst.copy_(src)

                def reset(_):
                    pass
            self.graph = Graph()
            CpuCaptured.made.append(self)

    CpuCaptured.made = []
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(g, "_guard_shutdown", lambda: None)
    monkeypatch.setattr(g, "_Captured", CpuCaptured)
    monkeypatch.setattr(g, "_LIVE", weakref.WeakSet())
    return g, CpuCaptured


def _backward_inputs(do, saved):
    from seqpar.methods.base import BackwardInputs
    from seqpar.numerics import GradRows

    return BackwardInputs(GradRows(do, do + 1, None), do.sum(-1), None, None, None, tuple(saved), None, False)


def test_saved_slots_keep_every_forward_in_flight_and_are_reused_once_free(cpu_graphs):
    """Note [Saved slots]: a graphed saving engine's forward replays into a free slot, its saved tensors left where
    the graph wrote them (no clone out) and handed out as views; while a forward's views are held (a layer awaiting
    its backward) the next forward takes another slot, captured when none is free; a slot whose views are all gone
    is free again. A backward given a slot's saved tensors replays that slot's backward graph, which reads them
    in place (no copy in). Values: those of the eager engine, every layer."""
    g, _ = cpu_graphs
    engine = _SavingEngine()
    graphed = g.Graphed(engine, required=True)
    layers = [[torch.randn(4, 3) for _ in range(4)] for _ in range(3)]          # q, k, v, dO per layer
    for step in range(3):
        held = []
        for q, k, v, _ in layers:                                               # forward: every layer in flight
            got, want = graphed.forward(q, k, v), engine.forward(q, k, v)
            for x, y in zip((*got[:2], *got[2]), (*want[:2], *want[2])):
                assert torch.equal(x, y)
            held.append(got[2])
        assert len(graphed._slots) == (2 if step == 0 else 3)     # the first call eager; a slot per forward in flight
        for (q, k, v, do), saved in reversed(list(zip(layers, held))):         # backward, last layer first
            want = engine.backward(_backward_inputs(do, engine.forward(q, k, v)[2]))
            got = graphed.backward(_backward_inputs(do, saved))
            assert all(torch.equal(x, y) for x, y in zip(got, want))
        del held, saved, got, x, y                             # (x: a view of the last forward's)
        assert all(s.free() for s in graphed._slots)
    slots = graphed._slots
    assert len(slots) == 3 and "fwd" not in graphed._graphs                    # slots, not the cloning graph
    for s in slots:                                                             # its saved tensors read in place
        (c,) = s.bwd.values()
        assert all(c.static[-3 + i] is s.saved[i] for i in range(3)) and c.in_place == frozenset({8, 9, 10})
    assert slots[0].fwd.static[0] is slots[1].fwd.static[0]                    # static inputs shared by slots
    (c0,), (c1,) = (slots[i].bwd.values() for i in (0, 1))
    assert c0.static[0] is c1.static[0]


class _StagingEngine(_SavingEngine):
    """A saving engine that stages (Note [Staged calls]): q, k and v packed into one buffer first, its output laid
    out of a receive buffer last."""

    stages = True

    def stage_shape(self):
        return (3, 4, 3)

    def stage(self, q, k, v, out=None):
        out = torch.empty(self.stage_shape()) if out is None else out
        out[0], out[1], out[2] = q, k, v
        return out

    def forward_staged(self, send):
        q, k, v = send
        recv = torch.cat([q + 1, k * 3])
        return q * 2 + 0, q.sum(-1), (recv[: len(q)], recv[len(q):], q - v)

    def unstage(self, raw):
        return raw.flip(0).clone()

    def forward(self, q, k, v):
        raw, lse, saved = self.forward_staged(self.stage(q, k, v))
        return self.unstage(raw), lse, saved


@pytest.mark.parametrize("keep_saved", [True, False])
def test_staged_calls_copy_nothing_in_and_clone_nothing_out(cpu_graphs, keep_saved):
    """Note [Staged calls]: an engine that stages runs its first copy into the ``Graphed``'s one buffer, which its
    graphs read where it lies (no copy in), and lays its output out of the graph's receive buffer itself (no clone
    out); every call's output is its own (a later replay does not change it) and equals the eager engine's."""
    g, made = cpu_graphs
    engine = _StagingEngine()
    graphed = g.Graphed(engine, required=True)
    calls = [[torch.randn(4, 3) for _ in range(3)] for _ in range(4)]
    outs = [graphed.forward(q, k, v, keep_saved=keep_saved) for q, k, v in calls]
    for (q, k, v), got in zip(calls, outs):
        want = engine.forward(q, k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert made.made and all(c.static[0] is graphed._staged and c.in_place == frozenset({0}) for c in made.made)
    graphed.retire()                                 # a batch gone: its plan keeps no buffer
    assert graphed._staged is None


def test_no_graph_replays_over_a_slot_captured_after_it(cpu_graphs):
    """Note [Slots and scratch]: a graph may have used, as scratch, memory a later slot's saved tensors took; so a
    forward skips a free slot captured before a slot in use (and captures a new one), and any other graph captured
    before a slot in use is captured anew at its call - a pipeline's interleaved micro-batches, a reference model's
    no-grad forward between a policy's forward and backward."""
    g, _ = cpu_graphs
    engine = _SavingEngine()
    graphed = g.Graphed(engine, required=True)
    q, k, v, do = (torch.randn(4, 3) for _ in range(4))
    for keep in (True, False, False):                      # warm-ups, then the no-grad kind's graph
        graphed.forward(q, k, v, keep_saved=keep)
    nosave = graphed._graphs["fwd-nosave"]
    a, b = graphed.forward(q, k, v)[2], graphed.forward(q, k, v)[2]
    first, second = graphed._slots
    assert nosave.seq < first.fwd.seq < second.fwd.seq
    del a                                                  # the first slot is free, but captured before the second
    c = graphed.forward(q, k, v)[2]
    assert len(graphed._slots) == 3 and graphed._slots[2].owns(c) and first.free()
    graphed.forward(q, k, v, keep_saved=False)             # no-grad, while slots captured after its graph are in use
    again = graphed._graphs["fwd-nosave"]
    assert again is not nosave and again.seq > graphed._slots[2].fwd.seq
    graphed.forward(q, k, v, keep_saved=False)
    assert graphed._graphs["fwd-nosave"] is again          # captured after every slot in use: replayed
    want = engine.backward(_backward_inputs(do, engine.forward(q, k, v)[2]))
    for saved in (c, b):
        assert all(torch.equal(x, y) for x, y in zip(graphed.backward(_backward_inputs(do, saved)), want))


def test_saved_slots_fall_back_to_clones_when_full_or_unusable(cpu_graphs, monkeypatch):
    """Note [Saved slots]: past ``MAX_SLOTS`` forwards in flight, or for an engine that saves a tensor it was given
    (a saved tensor aliasing a static input, which the next copy-in would overwrite), a forward replays the kind's
    one graph and clones its saved tensors out, as before slots; its backward copies them into its own graph."""
    g, _ = cpu_graphs
    monkeypatch.setattr(g, "MAX_SLOTS", 1)
    engine = _SavingEngine()
    graphed = g.Graphed(engine, required=True)
    q, k, v, do = (torch.randn(4, 3) for _ in range(4))
    graphed.forward(q, k, v)                                                    # warm-up
    first, second = graphed.forward(q, k, v), graphed.forward(q, k, v)
    assert len(graphed._slots) == 1 and "fwd" in graphed._graphs              # the second one: cloned
    assert graphed._slots[0].owns(first[2]) and not graphed._slots[0].owns(second[2])
    want = engine.backward(_backward_inputs(do, engine.forward(q, k, v)[2]))
    for saved in (second[2], first[2], second[2]):
        got = graphed.backward(_backward_inputs(do, saved))
        assert all(torch.equal(x, y) for x, y in zip(got, want))

    class Aliasing(_SavingEngine):
        def forward(self, q, k, v):
            return q * 2, q.sum(-1), (q, k * 3, v)
    graphed = g.Graphed(Aliasing(), required=True)
    graphed.forward(q, k, v)
    graphed.forward(q, k, v)
    assert not graphed._slots and not graphed._slotted and "fwd" in graphed._graphs


def test_a_saving_engine_clones_no_saved_tensors_without_a_backward_and_copies_no_out_into_it(cpu_graphs):
    """Note [Graph copies]: a call no backward follows replays a saving engine's forward captured without its saved
    tensors (nothing to clone out; a graph of its own beside the slots that keep them), and a saving engine's
    graphed backward takes no ``out`` (Note [Engines]: it reads dO and dlse of the final rows only)."""
    g, cap = cpu_graphs
    graphed = g.Graphed(_SavingEngine(), required=True)
    q, k, v, do = (torch.randn(4, 3) for _ in range(4))
    for _ in range(2):
        saved = graphed.forward(q, k, v, keep_saved=False)[2]
    assert saved == () and cap.made[-1].spec[-1] == 0 and set(graphed._graphs) == {"fwd-nosave"}
    graphed.forward(q, k, v)
    saved = graphed.forward(q, k, v)[2]
    graphed.backward(_backward_inputs(do, saved))
    graphed.backward(_backward_inputs(do, saved))
    assert cap.made[-1].static[1] is None                                           # no out copied in


def test_eager_calls_see_inputs_laid_out_as_the_capture_does(cpu_graphs):
    """Note [Layouts under capture]: a capture's static copies of an expanded gradient or a sliced q are contiguous
    (``empty_like``), so a graphed engine's eager calls get them contiguous too - every call of a kind, eager or
    captured, meets one layout (compiled kernels key on strides) - while dense tensors, permuted ones included, and
    the engine's own saved tensors pass as they are. Values: those of the engine on the original tensors."""
    from seqpar.runtime.graphs import _dense

    g, _ = cpu_graphs
    seen = []

    class Recording(_SavingEngine):
        def forward(self, q, k, v):
            seen.append(("fwd", q.stride(), k.stride()))
            return super().forward(q, k, v)

        def backward(self, b):
            seen.append(("bwd", b.rows.do.stride()))
            return super().backward(b)
    engine, plain = Recording(), _SavingEngine()
    graphed = g.Graphed(engine, required=True)
    fused = torch.randn(4, 9)
    q, k, v = fused[:, 0:3], fused[:, 3:6], fused[:, 6:9]                  # slices of a fused projection
    do = torch.ones(()).expand(4, 3)                                         # a sum's gradient: every stride 0
    assert not _dense(q) and not _dense(do) and _dense(torch.randn(3, 4).t()) and _dense(torch.randn(4, 1, 3))
    for _ in range(3):                                                       # eager, captured, replayed
        out, lse, saved = graphed.forward(q, k, v)
        want = plain.forward(q, k, v)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        got = graphed.backward(_backward_inputs(do, saved))
        assert all(torch.equal(x, y) for x, y in zip(got, plain.backward(_backward_inputs(do, want[2]))))
    assert {s for s in seen if s[0] == "fwd"} == {("fwd", (3, 1), (3, 1))}
    assert {s for s in seen if s[0] == "bwd"} == {("bwd", (3, 1))}
