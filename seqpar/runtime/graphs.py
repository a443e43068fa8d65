"""A planned call's engine captured as CUDA graphs and replayed: the host cost of a call becomes one launch.

    engine = Graphed(engine)          # same interface: forward(q, k, v), backward(BackwardInputs), saves

Note [Graphed calls]
    At 2-4K tokens per rank a call's kernels take a few hundred microseconds and the Python that launches them
    (ring steps, merges, transfers) takes several milliseconds: the GPU idles most of a call (the emulated
    W = 8 ring at 2K per rank: 89 launches, 4 ms of host time for 0.9 ms of GPU work). A planned call fixes
    every shape, so its engine's work is the same sequence of launches on every call: it is captured once
    as a CUDA graph and replayed.

    * Static buffers: the graph reads its inputs from buffers it owns; a call copies ``q, k, v`` (backward:
      ``dO, O, lse, q, k, v`` and what the engine saved) into them, replays, and returns clones of the graph's
      outputs, since the next replay (the next layer, which shares the plan) overwrites them - except a saving
      engine's saved tensors, which stay in a slot per forward in flight (Note [Saved slots]). The copies cost
      a few percent of the call at the sizes where graphs pay; above ``GRAPH_ROWS`` rows per rank a call is
      not host-bound and runs eagerly.
    * Capture: the first call of a plan runs eagerly (it builds cuDNN plans, compiles Triton kernels, opens
      NCCL connections - none of which may happen inside a capture); with ``graphs=True`` the second is
      captured and replayed, under auto two eager calls and two replays are timed and the cheaper way kept
      (Note [Which calls graph]); later calls replay or run eagerly. Forward and backward are separate graphs
      sharing one memory pool (they never run concurrently and their outputs are copied out at once). A
      backward whose optional inputs differ (an lse gradient present or not) gets its own graph.
    * Transfers: P2P and collectives are captured with the kernels (NCCL supports capture; the fake group of
      the emulated world does nothing). The agreement round runs before the engine, outside the graph.
    * Never inside another capture: under ``torch.compile(mode="reduce-overhead")`` or a user's own graph,
      the call is already being captured, and the engine runs eagerly into that capture.
    * A capture that fails (an engine that reads a device value on the host, or compiles) raises, under auto
      as under ``graphs=True``, with the advice to pass ``graphs=False``: running on eagerly is not safe,
      since a failed capture can leave CUDA's RNG bookkeeping inconsistent for kernels that draw from it
      (measured: FA2 then fails with "Offset increment outside graph capture"). Engines are capturable by
      construction (``tests/test_gpu_emulated.py`` captures every method). On real NCCL groups (2 and 4 H100s,
      2026-11-26) graphed calls ran the real tables; shutdown and one allocator setting need care (Note [Graphs
      and shutdown]). On 2 H100s at 4K tokens per GPU (GQA 8K), graphs made ring, Ulysses and all-gather calls
      1.19-1.40x faster than eager; at 8K per GPU (MHA 16K) only the ring's forward gained (1.39x), the rest
      within 0.94-1.00 (``benchmarks/results/2026-11-26-h100x2-graphs-real/``).
    * One thread per plan: the static buffers are the plan's, so two threads replaying one plan at once would
      overwrite each other's inputs (calls on distinct signatures are independent).

Note [Graph copies]
    The copies into the static buffers and the clones out cost a fifth of a graphed call's GPU work at 2K tokens
    per rank (a Ulysses forward+backward copies 8 inputs and clones 3 outputs in backward, 3 and 7 in forward) and
    a launch each. Tried 2026-11-26 and not kept: one ``torch._foreach_copy_`` per dtype each way (PyTorch's
    multi-tensor kernel). It cut 1-10 GPU operations per call, but its copies ran slower than the per-tensor
    ones - the calls' GPU busy time +2.5% (median of 80 configurations, emulated on an H100) - and efficiency
    did not move (median ratio 0.997; ``benchmarks/results/2026-11-26-h100-graph-copies/``).
    What is copied is kept to what is read (twelfth session): a strided output (Ulysses' saved ``q, k, v`` are
    views into its receive buffer) is cloned with 16-byte elements (Note [Wide copies] in
    ``seqpar.comm.all_to_all``: half the time of the generic strided copy, 24 -> 12 us for 16 MiB on an H100); a
    call no backward follows (``run``'s no-grad path: ``keep_saved=False``) replays a saving engine's forward
    captured without its saved tensors, so none is cloned out (a graph of its own: the same plan may serve a
    compiled model's op, which returns them); and a saving engine's backward takes no ``out`` (it reads dO and
    dlse of the final rows only, Note [Engines] in ``seqpar.methods.base``). Since the thirteenth session a saving
    engine's saved tensors are neither cloned out nor copied back in (Note [Saved slots]).

Note [Staged calls]
    A graph reads its inputs from static buffers and its outputs are cloned out, but an engine whose first operation
    on its inputs is a copy - Ulysses packs q, k and v into one all-to-all buffer - and whose last is one - it lays
    out its output from the all-to-all's receive buffer - copies each twice: at 4K tokens per rank (a packed row,
    GQA 32/8 over 8, one H100) 37 us of copies in and 25 us of clones out around a call of ~420 us. Such an engine
    says so (``stages``) and splits its forward: ``stage(q, k, v, out=)`` runs the first copy eagerly into a buffer
    the engine's graphs read where it lies (``in_place``, one buffer per ``Graphed``, allocated once outside the
    pool: a call's all-to-all has read it before the next call's stage writes it, on the same stream), the graph
    runs ``forward_staged`` from there up to the receive buffer, which is not cloned (``raw`` outputs), and
    ``unstage`` lays the output out of it eagerly into a new tensor - before any later replay can overwrite it, on
    the same stream. The eager path runs the same three parts, so every test of the method runs them.
    Emulated on one H100 (rank 0 of W, steady, base and staged trees in one device call, twice, in either order;
    ``benchmarks/results/2026-11-27-h100-twenty-first/staged``), Ulysses' forward: packed 32K lognormal over 8
    0.68-0.69 -> 0.77-0.78, packed 128K lognormal 0.83-0.84 -> 0.85; GQA 16K over 8 0.72-0.73 -> 0.76-0.77, over
    4 0.85-0.86 -> 0.87; MHA 16K over 8 0.68-0.70 -> 0.71-0.74, over 4 0.81 -> 0.87; forward+backward within
    -0.03..+0.06 (the backward still copies in and clones out).

Note [Saved slots]
    A saving engine (Ulysses, USP: ``saves = True``) hands its backward tensors of its own - the head-sharded q, k,
    v, out and lse - which a graph writes into its pool. Cloned out after every replay and copied into the
    backward's graph before its replay, they were most of a graphed Ulysses call's copies: 4 x 16 MiB each way per
    layer at 2K tokens per rank (MHA over 8), a tenth of the call's GPU time. Slots take both copies out. A slot is
    the forward captured once more, its saved tensors left where its graph wrote them and handed to autograd as
    fresh views; the slot's backward graph reads them there. Autograd holds the views until the layer's backward
    (or drops them with its graph), so a slot is free exactly when no tensor but the slot's own views its saved
    tensors' storages: PyTorch counts a storage's users (``torch._C._storage_Use_Count``, which cudagraph trees
    use for the same question), and the slot knows its own (its outputs and the bases its views keep alive). A
    forward replays into a free slot and captures a new one when none is free, so a model's L layers in flight
    hold L slots - the memory eager calls hold for the same tensors between forward and backward, kept here
    between steps too - and the next step reuses them. The slots of a plan share their static inputs, and their
    backward graphs theirs (dO, lse), so only the saved tensors are per slot. Past ``MAX_SLOTS`` forwards in
    flight, for a saved tensor that is a static input (an engine that saves what it was given: the next copy-in
    would overwrite it), and for a backward whose saved tensors are no slot's (a forward that ran eagerly, or
    tensors moved by a saved-tensor hook), the kind's one graph serves as before, copying. A replay overwrites
    a slot only after every view of it is gone, and on the stream its backward ran on (autograd runs a backward on
    its forward's stream).

Note [Slots and scratch]
    A plan's graphs share one memory pool: memory a capture frees at its end (its scratch: send buffers, kernel
    workspaces) is the pool's to hand out again, to the next capture's scratch or to a later slot's saved tensors.
    A graph replayed while a slot captured after it is in use may then write its scratch over that slot's saved
    tensors. A plain training step never does (slots are taken in the order they were captured, and a layer's
    backward runs after the later layers' have freed theirs), but a pipeline's interleaved micro-batches, or a
    reference model's no-grad forward between a policy's forward and backward on the same plan, would. So every
    graph carries the order of its capture (``seq``), and a graph is replayed only if no slot in use was captured
    after it: a forward takes a free slot captured after every slot in use, else captures a new one; any other
    graph captured too early is captured anew, once, at that call. Eager calls allocate outside the pool and never
    meet a slot's memory. The slots are kept in capture order, so the check scans back from the newest only to the
    first slot captured before the graph (none for a plain step's backward graphs), and a backward finds its slot
    by the address of its first saved tensor: a few C calls per call, not a pass over every slot.

Note [Graphs and shutdown]
    A graph that holds NCCL transfers holds NCCL's persistent work on the communicator, and ``ncclCommDestroy``
    waits for that work to be released: ``dist.destroy_process_group()`` after capturing NCCL transfers hangs
    until the graphs are destroyed (pytorch#115388; Megatron-Bridge deletes its graphs before it). Both real
    W = 4 tables of 2026-11-26 (4x H200, 4x H100) hung in the benchmark's final ``destroy_process_group`` after
    every record was written, until the call's limit killed them. So the first capture installs two guards:
    ``ProcessGroup.shutdown`` - which ``destroy_process_group`` calls for every group it tears down, however the
    user imported it - first runs ``release_all`` (synchronize the devices, destroy every graph seqpar holds,
    synchronize again), and so does ``atexit`` for a process that never destroys its groups. Every group's
    shutdown releases every graph (a graph does not record which communicators it holds); a plan called again
    afterwards - its group alive, another one destroyed - warms up and captures anew, into a new pool (PyTorch drops a
    pool with its last graph, and a capture into a dropped pool fails an internal assert; found 2026-11-26 when auto
    destroyed every graph of USP's plan - its slots - and then captured its backward). Measured on 2 H100s
    (``benchmarks/gpu/exit_check.py``, ``benchmarks/results/2026-11-26-h100x2-graphs-real/``): graphed ring,
    Ulysses and all-gather calls, then ``destroy_process_group`` - returns; no destroy - the process exits; the
    real 2-GPU bench exits on its own.

    A second hazard, found in the same runs: with the CUDA allocator's expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, which long-context training often sets) and NCCL's
    graph buffer registration on (``NCCL_GRAPH_REGISTER`` unset, NCCL's default), the second graphed Ulysses
    call's backward never got past the device synchronize that starts its capture, on both ranks (the
    forward's captured all-to-all never completed); with ``NCCL_GRAPH_REGISTER=0`` the same case ran and exited,
    as did every case without expandable segments. So auto (``capture_hazard``) runs such calls eagerly on a
    group with an NCCL backend when both are on, with one warning that names the fix, and ``graphs=True`` there
    raises. The fake group of the emulated world moves nothing and is never affected.

Note [Which calls graph]
    A graph saves host time and costs device time: the copies into its static buffers and the clones out (Note
    [Graph copies]). Ulysses launches a few large operations per call, so its eager host time is often below its
    device time, and then the copies are pure loss. Emulated on one H100 (rank 0 of W on a fake group,
    ``benchmarks/results/2026-11-26-h100x2-exit-and-graphs/graphs``), graphs added 6-19% to Ulysses' device time
    per call; at 4K tokens per rank (W = 4) eager ran the steady state faster - forward 0.81 / 0.80 / 0.92 against
    0.75 / 0.68 / 0.86 graphed (GQA causal, MHA causal, MHA full), forward+backward 0.89 / 0.90 / 1.12 against
    0.90 / 0.84 / 1.03 - where its host took 0.4-0.6 of the device's time; at 2K per rank (W = 8) the eager host
    time passed the device's and graphs won (GQA forward 0.65 against 0.32).
    So under auto (not ``graphs=True``) each kind of call of a plan (forward, or backward with the same optional
    inputs) is timed both ways and keeps the cheaper: after the warm-up call, ``TIMED_CALLS`` (2) eager calls, then
    the capture and ``TIMED_CALLS`` replays (the copies in and the clones out included), each timed twice over: on
    the host (the engine's own time, ``time.perf_counter``) and on the device, between two CUDA events that follow
    a spin kernel holding the device for ``HOLD_MS`` (3 ms). The host queues the call while the device still spins,
    so the events bracket the device's own time, not the host's lag (a call whose host takes longer than the spin
    is host-bound, and its host time sets its cost anyway). The spin is the same on every rank: a first version
    held each rank a quarter longer than its own last host time, and on four real H100s a rank with a shorter spin
    waited inside its eager call's transfers for the others' longer ones, which made eager calls look slow (auto
    graphed Ulysses' forward at 4K tokens per GPU, MHA, and it fell 0.53 -> 0.45;
    ``benchmarks/results/2026-11-26-h100x4-real-thirteenth/``). A call's cost is the larger of its least device
    time and ``HOST_MARGIN`` (1.25) times its least host time - what a run of such calls takes, the host's work
    around the engine (autograd, the op's plumbing) counted by the margin. The next call compares the two costs and
    either keeps replaying or destroys the graph (its memory goes back) and runs that kind of call eagerly from then
    on. A plan's seventh call of a kind runs as decided (warm-up, two timed eager, the capture, two timed replays);
    the bench warms up six. Each decision is logged by ``seqpar.runtime`` at INFO. Ranks decide on their own
    measurements; a captured and an eager rank issue the same transfers in the same order. The spins cost the
    device 24 ms once per plan (four timed calls of each of two kinds); a packed batch's plan takes the decisions
    of the batch before it instead (Note [Graphed batches]).
    Before: the tenth session captured when the host took at least 0.6 of the device's time in the second call
    (``benchmarks/results/2026-11-26-h100-auto-measured/``), which still paid one-time host work; the eleventh first
    decided on the lighter of two calls' host shares (``2026-11-26-h100-graph-decision/``): within noise, calls near
    the bar flipping either way between runs. The twelfth compared the spans of the two ways from the call's start,
    with nothing ahead of it on the device: an eager call's span then held the host's lag before its first long
    kernel, which a run of calls hides behind the previous call's kernels, and auto graphed Ulysses' backward at 2K
    tokens per rank (MHA over 8, emulated on an H100) that ran faster eagerly back to back (2.01 ms a call against
    1.86, ``2026-11-26-h100-host-probe/``).

Note [Graphed batches]
    A packed batch (``Call.packed``) is a plan of its own, used by every layer of one training step - forward, the
    recompute and backward - and then never again (Note [Bounded plan cache] in ``seqpar.runtime.call``). Its calls of a
    kind warm up, are timed, captured and replayed as for any plan (Note [Which calls graph]): a step of L layers runs a
    few calls of each kind eagerly or capturing and the rest, about 3L of them, as replays. When a plan for another
    packed batch (other ``cu_seqlens``) is made, the graphs of the packed plans of every other batch are retired
    (``Graphed.retire``): their memory goes back, and a call that still comes for such a plan (a pipeline's earlier
    micro-batch) runs eagerly, with the same result. Plans of the same batch (layers of other shapes: sliding and
    global, say) keep theirs. So one packed batch's graphs are held at a time, where the cache keeps
    ``BATCH_CACHE_SIZE`` batch plans. A plan that differs from the retired one only in its documents also takes
    its graph decisions (``Graphed.inherit``: the kinds of call kept graphed or eager), so after the first batch
    no call is timed - its first call of a kind still runs eagerly, for the new block shapes' kernel plans, and
    the second captures or runs eagerly as decided. (A padded batch without documents - one plan per valid
    length, the same lengths coming back - keeps its graphs while cached.) Until 2026-11-26 auto left packed calls
    eager, and at 4K tokens per rank they were host-bound (Ulysses at 0.36 / 0.52 of the kernel over 8 ranks,
    emulated); before and after: ``benchmarks/results/2026-11-26-h100-graphed-batches/``.

Note [Graphs under compile]
    A call from a compiled model (the ``seqpar::attention`` op, Note [Tracing seqpar.attention] in
    ``seqpar.runtime.op``) is never graphed by auto: under ``torch.compile(mode="reduce-overhead")`` inductor's
    cudagraph trees run the compiled step once eagerly with every allocation of the thread routed to their
    pool (their warm-up, not a capture, so nothing tells it from a plain call), then record it. A graph seqpar
    captured during that warm-up kept its static buffers in their pool past the step, and cudagraph trees
    refused the step ("7 tensor(s) in the cudagraph pool not tracked as outputs", emulated W = 4 on an H100,
    2026-11-25); a plain compiled model loses only seqpar's own graphs, and the mode that graphs the whole step
    includes seqpar's op in it. ``graphs=True`` is kept as asked (not under reduce-overhead). Device tensors
    seqpar keeps between calls follow the same rule: the merge's block lists are kept on the host, pinned, and
    copied per call (Note [Covered rows] in ``seqpar.kernels.combine``).

    Auto (``graphs=None``): CUDA, more than one rank, at most ``GRAPH_ROWS`` local rows (packed documents
    included: Note [Graphed batches]), not the single-kernel direct path (W = 1 has no steps to save), and not
    a call from a compiled model (Note [Graphs under compile]), nor an NCCL group with expandable segments and
    NCCL's graph registration on (Note [Graphs and shutdown]). A valid length short of the padded one is
    graphed: its plan is one per length, reused by every layer of a step, and a method that pads for its own
    layout (TASP's multiples of 2W(W-1), before Note [Uneven sub-chunks]) meets the same length every call -
    counted as varying, TASP at 2K tokens per rank over 8 ran ungraphed at 0.18 / 0.19 of the kernel, against
    0.50 / 0.43 graphed (emulated, H100).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm.all_to_all import contiguous
from ..comm.link import cycles_per_ms
from ..errors import rank_suffix
from ..kernels.combine import keep_tables
from ..methods.base import BackwardInputs
from ..numerics import GradRows

__all__ = ["GRAPH_ROWS", "Graphed", "capture_hazard", "release_all", "wanted"]

GRAPH_ROWS = 8192
"""Auto graphs a call with at most this many local rows (batch x sequence) per rank (Note [Graphed calls])."""

TIMED_CALLS = 2
"""Eager calls, then replays, auto times before it keeps the cheaper of the two (Note [Which calls graph])."""

HOST_MARGIN = 1.25
"""Auto weighs an engine call's host time by this: the call's host work around the engine (autograd, the op's
plumbing) is not in the bracket (Note [Which calls graph])."""

MAX_SLOTS = 64
"""The most forwards of a saving engine a plan keeps in flight in slots of their own (Note [Saved slots])."""

HOLD_MS = 3.0
"""How long auto holds the device before a timed call, in ms: one value on every rank, so that no rank's transfers
wait on another rank's longer spin (Note [Which calls graph])."""


def capture_hazard(groups: Any) -> str | None:
    """Why capturing the NCCL transfers of a call over ``groups`` (of several ranks) could deadlock, or None
    (Note [Graphs and shutdown])."""
    import torch.distributed as dist

    pgs = [g for g in (groups.group, groups.ulysses, groups.ring) if g is not None] or [None]
    if not any("nccl" in str(dist.get_backend(g)) for g in pgs):
        return None
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = " ".join([get() if get is not None else "", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                         os.environ.get("PYTORCH_ALLOC_CONF", "")]).replace(" ", "").lower()
    if "expandable_segments:true" not in settings or os.environ.get("NCCL_GRAPH_REGISTER") == "0":
        return None
    return ("the CUDA allocator's expandable segments with NCCL's graph buffer registration (NCCL_GRAPH_REGISTER "
            "unset or 1) deadlock a captured NCCL transfer")


_WARNED = False


def wanted(graphs: bool | None, *, device: torch.device, world: int, rows: int, direct: bool,
           hazard: str | None = None) -> bool:
    """Whether a planned call runs as graphs: ``graphs=True`` (then CUDA is required), False, or auto - which
    declines a call whose capture could deadlock (``hazard``, from ``capture_hazard``), once with a warning."""
    if graphs is not None:
        return graphs
    want = device.type == "cuda" and world > 1 and rows <= GRAPH_ROWS and not direct
    if want and hazard is not None:
        global _WARNED
        if not _WARNED:
            _WARNED = True
            warnings.warn(f"seqpar: short calls run without CUDA graphs here: {hazard} (Note [Graphs and shutdown] "
                          f"in seqpar.runtime.graphs). Set NCCL_GRAPH_REGISTER=0 to graph them.", stacklevel=4)
        return False
    return want


log = logging.getLogger("seqpar.runtime")

_LIVE: weakref.WeakSet[Graphed] = weakref.WeakSet()      # every Graphed that may hold a captured graph
_GUARD = threading.Lock()
_GUARDED = False


def release_all() -> int:
    """Destroy every CUDA graph seqpar holds (Note [Graphs and shutdown]); a plan still called afterwards captures
    again. Returns how many graphs were destroyed."""
    live = [g for g in list(_LIVE) if g._graphs or g._slots]
    devices = {d for g in live for d in g.devices}
    for d in devices:                   # nothing captured may still be running when its graph goes
        torch.cuda.synchronize(d)
    freed = sum(g.release() for g in live)
    for d in devices:                   # NCCL releases a graph's persistent work when the graph is destroyed
        torch.cuda.synchronize(d)
    return freed


def _guard_shutdown() -> None:
    """Release seqpar's graphs before any process group shuts down, and at exit (Note [Graphs and shutdown])."""
    global _GUARDED
    with _GUARD:
        if _GUARDED:
            return
        _GUARDED = True
        from torch.distributed import ProcessGroup

        shutdown = ProcessGroup.shutdown

        def shutdown_after_release(self, *args, **kwargs):
            release_all()
            return shutdown(self, *args, **kwargs)
        ProcessGroup.shutdown = shutdown_after_release
        atexit.register(release_all)


class _Captured:
    """One captured function: static inputs (None where absent), flat static outputs, the graph.

    ``shared``: static input buffers to read instead of allocating (one per input, None to allocate), so that the
    captures of one kind of call (the slots of Note [Saved slots]) read the same ones; ``in_place``: positions of
    inputs the graph reads where they lie, never copied (a slot's own saved tensors)."""

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor | None], pool: Any, *,
                 shared: Sequence[torch.Tensor | None] | None = None, in_place: frozenset[int] = frozenset()):
        self.device = next(x.device for x in inputs if x is not None)
        self.in_place = in_place
        self.static = _statics(inputs, shared, in_place)
        self.graph = torch.cuda.CUDAGraph()
        self.tables: list[torch.Tensor] = []          # Note [Tables under capture] in seqpar.kernels.combine
        with torch.cuda.device(self.device), keep_tables(self.tables), \
                torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            res = fn(*self.static)
        self.flat, self.spec = _flatten(res)

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> None:
        """Copy ``inputs`` into the static buffers (those read in place are the very tensors) and replay."""
        for i, (s, x) in enumerate(zip(self.static, inputs)):
            if s is not None and i not in self.in_place:
                s.copy_(x)
        with torch.cuda.device(self.device):
            self.graph.replay()

    def __call__(self, inputs: Sequence[torch.Tensor | None], raw: frozenset[int] = frozenset()) -> Any:
        """Replay; the outputs cloned, but for those at the positions in ``raw`` (Note [Staged calls])."""
        self.replay(inputs)
        return _unflatten([t if i in raw else _clone(t) for i, t in enumerate(self.flat)], self.spec)


def _statics(inputs: Sequence[torch.Tensor | None], shared: Sequence[torch.Tensor | None] | None,
             in_place: frozenset[int]) -> list[torch.Tensor | None]:
    """A capture's static inputs, filled with ``inputs``: ``shared`` ones where given, the input itself at the
    positions read in place, new buffers elsewhere (``_Captured``)."""
    static: list[torch.Tensor | None] = []
    for i, x in enumerate(inputs):
        if x is None or i in in_place:
            static.append(x)
        else:
            s = shared[i] if shared is not None and shared[i] is not None else torch.empty_like(x)
            static.append(s.copy_(x))
    return static


def _as_captured(inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """``inputs`` laid out as a capture's static copies are (``empty_like``: dense tensors keep their strides, others
    become contiguous), so eager calls and the capture meet the same compiled variants (Note [Layouts under
    capture])."""
    return [x if x is None or x.is_contiguous() or _dense(x) else contiguous(x) for x in inputs]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense and non-overlapping (a permutation of a contiguous tensor): ``empty_like`` keeps its
    strides.

    Note [Layouts under capture]
        A capture reads static copies of a call's inputs, and ``empty_like`` gives a tensor that is not dense and
        non-overlapping - a loss's expanded gradient (``out.sum().backward()``: every stride 0), a slice of a fused
        projection - contiguous strides. Compiled kernels key on strides (dynamo's guards, the variants of flex's
        backward from the final rows), so the eager calls before the capture compiled for one layout and the
        capture met another, and compiling inside a capture fails: graphs=True raised in the backward of a
        softcap or ``mask_mod`` call whose gradient was a sum's (an H200, ``benchmarks/gpu/probe_capture.py``).
        A graphed engine's calls therefore see such inputs contiguous, as the capture does (one copy, which the
        capture's copy-in makes anyway); its own saved tensors are read where they lie."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.is_contiguous() else contiguous(t)


class _Slot:
    """A saving engine's forward captured with its saved tensors left where the graph wrote them, and the backward
    graphs that read them there (Note [Saved slots]). The slot is free when no tensor but its own views its
    saved tensors' storages."""

    def __init__(self, fwd: _Captured):
        self.fwd = fwd
        self.saved = fwd.flat[len(fwd.flat) - fwd.spec[-1]:]      # (out, lse, saved): the last part
        self.bwd: dict[Any, _Captured] = {}
        held = {id(t): t for t in fwd.flat}         # the slot's own tensors, and the bases its views keep alive
        held.update({id(t._base): t._base for t in fwd.flat if t._base is not None})
        mine: dict[int, int] = {}                   # their references, by storage (its StorageImpl's address)
        for t in held.values():
            key = t.untyped_storage()._cdata
            mine[key] = mine.get(key, 0) + 1
        # PyTorch's count includes the reference its own query takes: one more than the users
        self._own = tuple((key, mine[key] + 1) for key in dict.fromkeys(t.untyped_storage()._cdata
                                                                          for t in self.saved))
        inputs = {x.untyped_storage()._cdata for x in fwd.static if x is not None}
        self.usable = bool(self._own) and not any(key in inputs for key, _ in self._own)
        """False when a saved tensor is a static input (an engine that saves its input as it came): the next
        replay's copy-in would overwrite it, so such a kind of call clones its saved tensors (Note [Saved slots]);
        and when there are none to keep."""

    def free(self) -> bool:
        """No tensor but the slot's own uses its saved tensors' storages (PyTorch's count of a storage's users;
        the slot's tensors keep the storages, and so their addresses, alive)."""
        return all(torch._C._storage_Use_Count(key) == n for key, n in self._own)

    def owns(self, saved: Sequence[torch.Tensor]) -> bool:
        return len(saved) == len(self.saved) and all(
            x.data_ptr() == t.data_ptr() and x.shape == t.shape and x.stride() == t.stride()
            for x, t in zip(saved, self.saved))

    def forward(self, inputs: Sequence[torch.Tensor | None], raw: frozenset[int] = frozenset()) -> tuple:
        """Replay into this slot: clones of out and lse (but for those in ``raw``), fresh views of the saved tensors
        (each one held counts against the slot)."""
        self.fwd.replay(inputs)
        out, lse = (t if i in raw else _clone(t) for i, t in enumerate(self.fwd.flat[:2]))
        return out, lse, tuple(t.view(t.shape) for t in self.saved)

    def reset(self) -> int:
        graphs = [self.fwd, *self.bwd.values()]
        for c in graphs:
            c.graph.reset()
        self.bwd.clear()
        return len(graphs)


def _timed(store: list, inputs: Sequence[torch.Tensor | None], run: Callable[[], Any]) -> Any:
    """``run()`` with the device held busy first (a spin kernel of ``HOLD_MS``), so that the host queues the call's
    work while the device still spins and the two CUDA events around it bracket the device's own time; appends
    ``(host ms, start, end)`` to ``store`` (read when auto decides, Note [Which calls graph])."""
    device = next(x.device for x in inputs if x is not None)
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(HOLD_MS * cycles_per_ms(device)))
        start.record()
        t0 = time.perf_counter()
        res = run()
        host = (time.perf_counter() - t0) * 1e3
        end.record()
    store.append((host, start, end))
    return res


def _cost_ms(store: list) -> float:
    """What ``_timed``'s calls cost a run of such calls, in ms: the least device time, or the least host time
    (scaled by ``HOST_MARGIN`` for the host work around the engine) where the host is the slower."""
    store[-1][2].synchronize()
    device = min(start.elapsed_time(end) for _, start, end in store)
    return max(device, HOST_MARGIN * min(host for host, _, _ in store))


def _flatten(res: Any) -> tuple[list[torch.Tensor], list[int]]:
    """Tensors of an engine's result (a tuple of tensors and tuples/lists of tensors) and its shape."""
    flat, spec = [], []
    for x in res:
        if isinstance(x, torch.Tensor):
            flat.append(x)
            spec.append(-1)
        else:
            flat.extend(x)
            spec.append(len(x))
    return flat, spec


def _unflatten(flat: list[torch.Tensor], spec: list[int]) -> tuple:
    out: list[Any] = []
    i = 0
    for n in spec:
        if n < 0:
            out.append(flat[i])
            i += 1
        else:
            out.append(tuple(flat[i:i + n]))
            i += n
    return tuple(out)


class Graphed:
    """``engine`` run as CUDA graphs (Note [Graphed calls]); ``required``: a failed capture raises."""

    def __init__(self, engine: Any, *, required: bool):
        self.engine, self.required = engine, required
        self.saves = engine.saves
        self.pool = torch.cuda.graph_pool_handle()
        self._seen: set[Any] = set()                 # kinds of call run once
        self._timed: dict[Any, list] = {}           # eager calls timed by kind: (host ms, start, end)
        self._replays: dict[Any, list] = {}         # replays timed
        self._eager: set[Any] = set()                # auto measured these calls faster eager
        self._kept: set[Any] = set()                 # auto measured these calls faster as graphs
        self._graphs: dict[Any, _Captured] = {}
        self._slots: list[_Slot] = []                # a saving engine's forwards, in capture order (Note [Saved slots])
        self._by_saved: dict[int, _Slot] = {}        # the slots by the address of their first saved tensor
        self._seq = 0                                # captures so far: each graph's ``seq`` (Note [Slots and scratch])
        self._slotted = True                         # False once a slot turned out unusable for this engine
        self._staged: torch.Tensor | None = None     # the buffer a staging engine's graphs read (Note [Staged calls])
        self.retired = False
        _LIVE.add(self)

    @property
    def devices(self) -> set[torch.device]:
        """The devices of the graphs held."""
        return {c.device for c in self._graphs.values()} | {s.fwd.device for s in self._slots}

    def inherit(self, other: Graphed) -> None:
        """Decide as ``other`` decided, untimed: the plan of the batch before this one, of the same shapes (Note
        [Graphed batches])."""
        self._kept |= other._kept
        self._eager |= other._eager

    def retire(self) -> None:
        """Free the graphs; later calls run eagerly (a batch plan whose batch has passed: Note [Graphed batches])."""
        self.retired = True
        self.release()

    def release(self) -> int:
        """Destroy the graphs; the plan's next calls warm up and capture again (Note [Graphs and shutdown]).
        Returns how many were destroyed."""
        n = len(self._graphs) + sum(s.reset() for s in self._slots)
        for c in self._graphs.values():
            c.graph.reset()
        self._graphs.clear()
        self._slots.clear()
        self._by_saved.clear()
        self._staged = None                          # a retired batch's plan keeps no buffer
        for memo in (self._seen, self._timed, self._replays, self._kept):
            memo.clear()
        return n

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, keep_saved: bool = True):
        """The engine's forward; ``keep_saved=False`` (a call no backward follows) captures a saving engine's
        forward without its saved tensors, a graph of its own: nothing saved is cloned out (Note [Graph copies]);
        with them, a saving engine's forward replays into a free slot (Note [Saved slots])."""
        q, k, v = _as_captured((q, k, v))
        if getattr(self.engine, "stages", False):
            return self._forward_staged(q, k, v, keep_saved)
        if self.saves and not keep_saved:
            return self._run("fwd-nosave", lambda q, k, v: (*self.engine.forward(q, k, v)[:2], ()), [q, k, v])

        def fwd(q, k, v):
            return self.engine.forward(q, k, v)
        return self._run("fwd", fwd, [q, k, v], self._into_slot(fwd) if self.saves else None)

    def _forward_staged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep_saved: bool):
        """``forward`` of an engine that stages (Note [Staged calls]): its first copy into this ``Graphed``'s buffer,
        the graph (or the eager call) from there, its last copy out of the graph's receive buffer."""
        if self._staged is None:                   # a plan's shapes are fixed: allocated at its first call
            self._staged = q.new_empty(self.engine.stage_shape())
        send = self.engine.stage(q, k, v, out=self._staged)
        eng, here, raw = self.engine, frozenset({0}), frozenset({0})
        if self.saves and not keep_saved:
            res = self._run("fwd-nosave", lambda s: (*eng.forward_staged(s)[:2], ()), [send], in_place=here, raw=raw)
        else:
            fwd = eng.forward_staged
            res = self._run("fwd", fwd, [send], self._into_slot(fwd, here, raw) if self.saves else None,
                            in_place=here, raw=raw)
        return (eng.unstage(res[0]), *res[1:])

    def backward(self, b: BackwardInputs):
        r = b.rows
        out = None if self.saves else r.out           # an engine that saves reads dO and dlse of the rows only
        inputs = [*_as_captured((r.do, out, r.dlse, b.lse, b.q, b.k, b.v, b.sinks)), *b.saved]
        n_saved, lse_grad = len(b.saved), b.lse_grad

        def bwd(do, out, dlse, lse, q, k, v, sinks, *saved):
            assert len(saved) == n_saved
            return self.engine.backward(BackwardInputs(GradRows(do, out, dlse), lse, q, k, v, tuple(saved), sinks,
                                                       lse_grad))
        key = ("bwd", tuple(x is None for x in inputs))
        slot = self._by_saved.get(b.saved[0].data_ptr()) if b.saved else None
        if slot is not None and not slot.owns(b.saved):
            slot = None
        return self._run(key, bwd, inputs, None if slot is None else self._from_slot(slot, key, bwd))

    def _capture(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor | None], **kw: Any) -> _Captured:
        _guard_shutdown()
        if not self._graphs and not self._slots:
            # PyTorch drops a pool when the last graph in it is destroyed, and a capture into a dropped pool fails
            # an internal assert (use_count > 0): after a release or a kind found faster eager, a new pool
            self.pool = torch.cuda.graph_pool_handle()
        try:
            c = _Captured(fn, inputs, self.pool, **kw)
        except Exception as err:
            how = "graphs=True" if self.required else "graphs=None (auto: CUDA, several ranks, short chunks)"
            raise RuntimeError(f"{how}: capturing this call as a CUDA graph failed ({err}); pass graphs=False "
                               f"to run it eagerly{rank_suffix()}") from err
        self._seq += 1
        c.seq = self._seq
        return c

    def _in_use_after(self, seq: int) -> int | None:
        """The index of the latest slot in use captured after ``seq``, or None: a graph captured at ``seq`` may
        have taken that slot's saved tensors' memory as scratch (Note [Slots and scratch]). Slots are kept in the
        order of their captures, so the scan stops at the first one captured before."""
        for i in range(len(self._slots) - 1, -1, -1):
            s = self._slots[i]
            if s.fwd.seq < seq:
                return None
            if not s.free():
                return i
        return None

    def _fresh(self, graphs: dict[Any, _Captured], key: Any) -> _Captured | None:
        """``graphs[key]``, or None where there is none or it was captured before a slot in use (then destroyed, to be
        captured anew: Note [Slots and scratch])."""
        g = graphs.get(key)
        if g is not None and self._in_use_after(g.seq) is not None:
            graphs.pop(key).graph.reset()
            return None
        return g

    def _one_graph(self, key: Any, fn: Callable[..., Any], in_place: frozenset[int] = frozenset(),
                   raw: frozenset[int] = frozenset()) -> Callable[[list], Callable[[], Any]]:
        """The kind's one graph (captured at its first use): copies in, replay, clones out (Note [Staged calls]: the
        inputs in ``in_place`` read where they lie, the outputs in ``raw`` not cloned)."""
        def prepare(inputs: list) -> Callable[[], Any]:
            g = self._fresh(self._graphs, key)
            if g is None:
                g = self._graphs[key] = self._capture(fn, inputs, in_place=in_place)
            return lambda: g(inputs, raw)
        return prepare

    def _into_slot(self, fwd: Callable[..., Any], in_place: frozenset[int] = frozenset(),
                   raw: frozenset[int] = frozenset()) -> Callable[[list], Callable[[], Any]]:
        """A saving engine's forward replayed into a free slot, one captured when none is free (up to
        ``MAX_SLOTS``; past that, or where slots cannot serve, the kind's one graph, its saved tensors cloned)."""
        def prepare(inputs: list) -> Callable[[], Any]:
            # a free slot captured after every slot in use (Note [Slots and scratch])
            last = self._in_use_after(0)
            slot = next((s for s in self._slots[0 if last is None else last + 1:] if s.free()), None)
            if slot is None and self._slotted and len(self._slots) < MAX_SLOTS:
                shared = self._slots[0].fwd.static if self._slots else None
                slot = _Slot(self._capture(fwd, inputs, shared=shared, in_place=in_place))
                if slot.usable:
                    self._slots.append(slot)
                    self._by_saved[slot.saved[0].data_ptr()] = slot
                else:
                    slot.reset()
                    self._slotted, slot = False, None
            if slot is None:
                return self._one_graph("fwd", fwd, in_place, raw)(inputs)
            return lambda: slot.forward(inputs, raw)
        return prepare

    def _from_slot(self, slot: _Slot, key: Any, bwd: Callable[..., Any]) -> Callable[[list], Callable[[], Any]]:
        """The backward of a forward replayed into ``slot``: a graph of the slot's that reads its saved tensors
        where they lie (its other static inputs shared by every slot's graph of this kind)."""
        def prepare(inputs: list) -> Callable[[], Any]:
            g = self._fresh(slot.bwd, key)
            if g is None:
                n = len(inputs) - len(slot.saved)
                shared = next((s.bwd[key].static for s in self._slots if key in s.bwd), None)
                g = slot.bwd[key] = self._capture(bwd, [*inputs[:n], *slot.saved], shared=shared,
                                                  in_place=frozenset(range(n, len(inputs))))
            return lambda: g(inputs)
        return prepare

    def _drop(self, key: Any) -> None:
        """Destroy the graphs of one kind of call (auto found it faster eager)."""
        g = self._graphs.pop(key, None)
        if g is not None:
            g.graph.reset()
        if key == "fwd":
            for s in self._slots:
                s.reset()
            self._slots.clear()
        self._by_saved.clear()
        for s in self._slots:
            c = s.bwd.pop(key, None)
            if c is not None:
                c.graph.reset()

    def _run(self, key: Any, fn: Callable[..., Any], inputs: list[torch.Tensor | None],
             prepare: Callable[[list], Callable[[], Any]] | None = None, *, in_place: frozenset[int] = frozenset(),
             raw: frozenset[int] = frozenset()):
        """One call of a kind: eager, timed, or replayed (``prepare(inputs)`` gives the replay, capturing first
        where needed; by default the kind's one graph, ``in_place`` and ``raw`` as in ``_one_graph``)."""
        if self.retired or key in self._eager or torch.cuda.is_current_stream_capturing():
            return fn(*inputs)
        if key not in self._seen:              # the first call runs eagerly: plans, compiles, connections
            self._seen.add(key)
            return fn(*inputs)
        auto = not self.required and key not in self._kept
        timed = self._timed.setdefault(key, []) if auto else []
        if auto and len(timed) < TIMED_CALLS:  # auto: time eager calls first (Note [Which calls graph])
            return _timed(timed, inputs, lambda: fn(*inputs))
        replay = (prepare or self._one_graph(key, fn, in_place, raw))(inputs)
        if not auto:
            return replay()
        replays = self._replays.setdefault(key, [])
        if len(replays) < TIMED_CALLS:                              # auto: time replays, then keep the cheaper
            return _timed(replays, inputs, replay)
        eager_ms, graph_ms = _cost_ms(self._timed.pop(key)), _cost_ms(self._replays.pop(key))
        faster = graph_ms < eager_ms
        log.info("graphs auto: %s of %s costs %.3f ms eagerly, %.3f ms replayed (the larger of the device's and "
                 "%.2fx the host's time, the least of %d calls each): %s", key if isinstance(key, str) else key[0],
                 type(self.engine).__name__, eager_ms, graph_ms, HOST_MARGIN, TIMED_CALLS,
                 "graphed" if faster else "eager")
        if faster:
            self._kept.add(key)
            return replay()
        self._drop(key)
        self._eager.add(key)
        return fn(*inputs)
