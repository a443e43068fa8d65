"""Which kernels run a mask's blocks, decided without a GPU (selection is a pure function of the ``KernelCall``, the
device's compute capability included), and the flex pieces that serve them checked on CPU (eager flex):

* Note [Bands on flex]: in an sm90 training call ``auto`` runs wide windowed bands (``WIDE_ROWS`` rows or more) on
  flex and joins a step's band and thin blocks into one flex call (the sink window is one call, the direct path);
  narrow bands (spans' images, block_causal's frames) keep FA2 and their step is not joined; other GPUs, calls
  without a backward (wide or not), bare calls, calls whose shapes vary and deterministic ones keep FA2; thick
  blocks keep cuDNN;
* the chunked mask at 128K plans per-chunk causal blocks on cuDNN, not a varlen call on FA2 (plan only);
* a joined step computes what its blocks compute apart (forward and backward, W = 1 and a ring step);
* flex's block masks of bands and joined calls, derived from row intervals, equal ``create_block_mask``'s.
"""

from __future__ import annotations

import random

import pytest
import torch

from seqpar import masks
from seqpar.kernels import KERNELS, KernelCall, base, select
from seqpar.kernels import executor as executor_mod
from seqpar.kernels import flex as flex_mod
from seqpar.kernels.executor import TaskRunner
from seqpar.kernels.merge import Accumulator
from seqpar.layouts import make_layout
from seqpar.layouts.blocks import Rule
from seqpar.masks import Band, Joined, Varlen, dense
from seqpar.masks.forms import Modded
from seqpar.methods._passkv import schedule
from seqpar.numerics import GradRows

H, HKV, D = 32, 8, 128
BF16 = torch.bfloat16


def steps(S: int, causal: bool, mask=None, window=(-1, -1), world: int = 1, layout: str = "contiguous", rank: int = 0):
    lay = make_layout(layout, world, None, None)
    return schedule(lay, rank, S // world * world, Rule(causal, window, mask=mask), None, None).steps


@pytest.fixture
def sm90(monkeypatch):
    """Plan as on an H100: compute capability 9.0, a PyTorch build with cuDNN and flex's TMA option (declarations
    otherwise unchanged)."""
    monkeypatch.setattr(executor_mod, "device_arch", lambda device: 90)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(flex_mod, "_has_tma_option", lambda: True)
    select.cache_clear()
    base._fastest.cache_clear()
    yield
    select.cache_clear()
    base._fastest.cache_clear()


def chosen(tasks, S: int, **runner) -> list[tuple[str, int, int, str]]:
    """(mask form, rows, cols, kernel) of each call one step of ``tasks`` runs as, on CUDA bf16 GQA 32/8."""
    r = TaskRunner(runner.pop("kernel", "auto"), 0.1, **{"training": True, **runner})
    return [(type(t.mask).__name__, t.rows, t.cols, k)
            for t, k in r.kernels(tasks, (1, S, H, D), (1, S, HKV, D), BF16, "cuda")]


def test_flex_compiles_for_every_shape_where_shapes_need_not_recur():
    """Note [Flex recompiles]: flex for a training call with fixed shapes is the per-shape compile; without a
    backward, or with blocks shaped by the batch (a generic mask_mod's blocks under packed documents), it is the
    variant compiled once for every shape - the same kernel by name, asked for explicitly too."""
    mod = KernelCall("cuda", BF16, D, H, HKV, "mod", arch=90, training=True)
    assert not select("auto", mod).dynamic
    for other in (dict(training=False), dict(shapes_vary=True)):
        kern = select("flex", KernelCall(**{**mod.__dict__, **other}))
        assert kern.name == "flex" and kern.dynamic and kern is select("auto", KernelCall(**{**mod.__dict__, **other}))


def test_flex_variant_compiles_its_first_shapes_per_shape_then_once_for_all(monkeypatch):
    """Note [Flex recompiles]: the variant for calls whose shapes need not recur runs the per-shape compile for its
    first STATIC_SHAPES shapes (and whenever one of them recurs), the compile for every shape after them."""
    variant = flex_mod._DynamicFlex()
    monkeypatch.setattr(flex_mod, "STATIC_SHAPES", 3)
    band = Band(-64, 0)

    def call(n: int) -> bool:
        return variant._dynamic_for(torch.empty(1, n, 4, 16), torch.empty(1, n, 2, 16), band)
    assert [call(n) for n in (100, 200, 100, 300, 400, 500, 200)] == [False, False, False, False, True, True, False]
    assert not KERNELS["flex"]._dynamic_for(torch.empty(1, 900, 4, 16), torch.empty(1, 900, 2, 16), band)


def test_flex_options_ask_tma_for_forward_kernels_on_sm90_only(monkeypatch):
    """Note [Flex on TMA]: a forward kernel of 128+ query rows on sm90 asks for USE_TMA; backward kernels, other
    archs, CPU and calls under 128 rows (the standard Triton kernel, not the decoding one) do not."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(flex_mod, "device_arch", lambda device: 90)
    assert flex_mod._options(cuda, 4096, tma=True) == {"kernel_options": {"USE_TMA": True}}
    assert flex_mod._options(cuda, 4096) == {}
    assert flex_mod._options(cuda, 127, tma=True) == {"kernel_options": {"BACKEND": "TRITON"}}
    assert flex_mod._options(torch.device("cpu"), 4096, tma=True) == {}
    monkeypatch.setattr(flex_mod, "device_arch", lambda device: 80)
    assert flex_mod._options(cuda, 4096, tma=True) == {}


def test_only_flex_forward_kernels_ask_for_tma(monkeypatch):
    """Note [Flex on TMA]: ``FlexKernel.forward`` runs its kernel with ``tma``; its backward (the recompute on CPU)
    and ``autograd_forward`` of inputs that need grad (flex's own autograd: one option for both kernels) without,
    ``autograd_forward`` where no backward can follow with; flex compiled for every shape never."""
    asked, stop = [], []
    real = flex_mod._options

    def spy(device, rows, tma=False):
        asked.append(tma)
        if stop:
            raise LookupError("stop: flex has no backward on CPU")     # the recompute's options are what counts
        return real(device, rows, tma)
    monkeypatch.setattr(flex_mod, "_options", spy)
    q, k, v = (torch.randn(1, 256, h, 16) for h in (4, 2, 2))
    kern, band = KERNELS["flex"], Band(-64, 0)
    res = kern.forward(q, k, v, band, 0.25)
    assert asked == [True]
    stop.append(True)
    with pytest.raises(LookupError, match="stop"):
        kern.backward(torch.randn_like(q), q, k, v, res.out, res.lse, band, 0.25)
    stop.clear()
    kern.autograd_forward(q, k, v, band, 0.25)
    with torch.no_grad():
        kern.autograd_forward(q, k, v, band, 0.25)
    assert asked == [True, False, True, True]
    asked.clear()
    with pytest.raises(NotImplementedError, match="backward on CPU"):    # flex's own check: the option was asked
        kern.autograd_forward(q.requires_grad_(), k, v, band, 0.25)
    assert asked == [False]
    asked.clear()                       # flex compiled for every shape: measured only per shape, so never on TMA
    monkeypatch.setattr(flex_mod, "STATIC_SHAPES", 0)
    variant = flex_mod._DynamicFlex()
    q = q.detach()
    with torch.no_grad():
        variant.forward(q, k, v, band, 0.25)
        variant.autograd_forward(q, k, v, band, 0.25)
    assert asked == [False, False]


def test_tma_only_for_bands_without_softcap(monkeypatch):
    """Note [Flex on TMA]: bands and joined bands ask for TMA (measured faster); a user's ``mask_mod`` (measured
    slower), documents and softcap do not, in ``FlexKernel.forward`` and a no-grad ``autograd_forward`` alike."""
    band, rows = Band(-64, 0), ((0, 256),)
    modded = Modded(Band(-(1 << 30), 0), lambda b, h, qi, ki: (qi - ki) % 3 == 0, rows, rows)
    assert flex_mod.takes_tma(band, 0.0) and not flex_mod.takes_tma(band, 30.0)
    assert not flex_mod.takes_tma(modded, 0.0)
    asked = []
    real = flex_mod._options

    def spy(device, rows, tma=False):
        asked.append(tma)
        return real(device, rows, tma)
    monkeypatch.setattr(flex_mod, "_options", spy)
    q, k, v = (torch.randn(1, 256, h, 16) for h in (4, 2, 2))
    kern = KERNELS["flex"]
    kern.forward(q, k, v, band, 0.25, softcap=30.0)
    with torch.no_grad():
        kern.autograd_forward(q, k, v, band, 0.25, softcap=30.0)
    assert asked == [False, False]


def test_flex_forward_hands_flex_detached_inputs(monkeypatch):
    """Note [Flex under capture]: the engine's forward calls flex on tensors that do not require grad, whether the
    caller's do (training) or not (a graph's static copies), so both meet one compiled variant."""
    seen = []
    real = flex_mod._flex

    def spy(device, dynamic=False):
        fn = real(device, dynamic)

        def call(q, k, v, **kw):
            seen.append(tuple(t.requires_grad for t in (q, k, v)))
            return fn(q, k, v, **kw)
        return call
    monkeypatch.setattr(flex_mod, "_flex", spy)
    q, k, v = (torch.randn(1, 256, h, 16, requires_grad=True) for h in (4, 2, 2))
    KERNELS["flex"].forward(q, k, v, Band(-64, 0), 0.25)
    KERNELS["flex"].forward(q.detach(), k.detach(), v.detach(), Band(-64, 0), 0.25)
    assert seen == [(False, False, False)] * 2


def test_training_calls_whose_forward_takes_tma_run_the_engine(monkeypatch):
    """Note [Flex on TMA]: flex's own autograd runs its forward without TMA, so a training call of ``ENGINE_ROWS``+
    rows whose forward would take it (bands and joined bands, no softcap, a TMA arch, compiled per shape) runs the
    engine instead; shorter calls, other archs, softcap, a user's ``mask_mod`` and flex compiled for every shape
    keep the direct path."""
    flex = KERNELS["flex"]
    monkeypatch.setattr(flex_mod, "_has_tma_option", lambda: True)
    band, n = Band(-4096, 0), flex_mod.ENGINE_ROWS
    rows = ((0, n),)
    modded = Modded(Band(-(1 << 30), 0), lambda b, h, qi, ki: (qi - ki) % 3 == 0, rows, rows)
    assert flex.trains_on_engine(band, n, 90, 0.0)
    assert not flex.trains_on_engine(band, n - 1, 90, 0.0)
    assert not flex.trains_on_engine(band, n, 80, 0.0)
    assert not flex.trains_on_engine(band, n, 90, 30.0)
    assert not flex.trains_on_engine(modded, n, 90, 0.0)
    assert not flex_mod._DynamicFlex().trains_on_engine(band, n, 90, 0.0)
    assert not KERNELS["cudnn"].trains_on_engine(band, n, 90, 0.0)
    monkeypatch.setattr(flex_mod, "_has_tma_option", lambda: False)      # a torch without the option
    assert not flex.trains_on_engine(band, n, 90, 0.0)


def test_flex_mask_mods_read_int32_tensors():
    """A band's bounds and a document mask's tables are int32, as flex's indices are (int64 bounds cost flex 2-4%:
    benchmarks/results/2026-11-28-flex-bounds-tma)."""
    cpu = torch.device("cpu")
    for mask, m in ((Band(-64, 0), 256), (Varlen((0, 100, 256), (0, 100, 256), (-1, -1)), 256)):
        cells = [c.cell_contents for c in flex_mod._mask_mod(mask, m, m, cpu).__closure__]
        tensors = [c for c in cells if torch.is_tensor(c)]
        assert tensors and all(t.dtype == torch.int32 for t in tensors), [t.dtype for t in tensors]


def test_auto_ranks_flex_above_fa2_for_wide_windowed_bands_on_sm90_only():
    band = KernelCall("cuda", BF16, D, H, HKV, "band", arch=90, training=True, wide=True)
    assert select("auto", band).name == "flex" and not select("auto", band).dynamic
    for other in (dict(arch=80), dict(arch=100), dict(shapes_vary=True), dict(deterministic=True),
                  dict(wide=False)):
        assert select("auto", KernelCall(**{**band.__dict__, **other})).name == "flash", other
    for other in (dict(training=False), dict(training=False, shapes_vary=True)):      # serving, eval: every length
        kern = select("auto", KernelCall(**{**band.__dict__, **other}))
        assert kern.name == "flex" and kern.dynamic, other
    assert select("auto", KernelCall(**{**band.__dict__, "mask": "joined"})).name == "flex"
    for name in ("cudnn", "flash", "efficient", "flash_attn"):
        assert KERNELS[name].not_supported_reasons(KernelCall(**{**band.__dict__, "mask": "joined"})), name


@pytest.mark.parametrize("S", [16384, 131072])
def test_sink_window_is_one_flex_call_on_sm90(sm90, S):
    tasks = steps(S, False, masks.sink_window(4095, 4))[0]
    assert len(tasks) == 3                                # causal sinks, sink columns, the window band
    assert chosen(tasks, S) == [("Joined", S, S, "flex")]
    r = TaskRunner("auto", 0.1, training=True)          # Note [Flex on TMA]: training runs the engine
    assert r.direct(tasks, (1, S, H, D), (1, S, HKV, D), (1, S, HKV, D), BF16, torch.device("cuda")) is None
    no_grad = TaskRunner("auto", 0.1, training=False)
    assert no_grad.direct(tasks, (1, S, H, D), (1, S, HKV, D), (1, S, HKV, D), BF16, torch.device("cuda")) is not None
    assert [k for *_, k in chosen(tasks, S, shapes_vary=True)] == ["flash"] * 3     # documents: no compile per batch
    assert chosen(tasks, S, training=False) == [("Joined", S, S, "flex")]  # serving, eval: compiled for every shape
    assert sorted(k for *_, k in chosen(tasks, S, kernel="sdpa")) == ["cudnn", "cudnn", "flash"]


@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (8, 2), (16, 4), (32, 8), (4, 4), (16, 16)])
def test_band_backward_on_few_kv_heads_leaves_flex(sm90, monkeypatch, heads, kv_heads):
    """Note [Band backward on few KV heads]: a wide band of a grouped-query training call with at most
    ``BAND_BWD_KV_HEADS`` (4) KV heads keeps flex for its forward and runs its backward on FA2 (MHA keeps flex: its
    backward won there); the sink window at Ulysses' share of GQA 32/8 (4/1 heads over 8 ranks, 8/2 over 4) is then
    one joined flex call forward, no direct path, and its backward runs its blocks apart."""
    few = kv_heads < heads and kv_heads <= 4
    band = KernelCall("cuda", BF16, D, heads, kv_heads, "band", arch=90, training=True, wide=True)
    assert select("auto", band).name == "flex"
    assert select("auto", KernelCall(**{**band.__dict__, "backward": True})).name == ("flash" if few else "flex")
    S = 16384
    tasks = steps(S, False, masks.sink_window(4095, 4))[0]
    r, cuda = TaskRunner("auto", 0.1, training=True), torch.device("cuda")
    assert [(type(t.mask).__name__, k) for t, k in r.kernels(tasks, (1, S, heads, D), (1, S, kv_heads, D), BF16,
                                                              cuda)] == [("Joined", "flex")]
    sig = (heads, kv_heads, D, BF16, cuda)
    joined = r._prepare(tasks, sig)[0]
    apart = r._apart(joined, sig, D)
    assert (apart is not None) is few
    direct = r.direct(tasks, (1, S, heads, D), (1, S, kv_heads, D), (1, S, kv_heads, D), BF16, cuda)
    assert direct is None                                 # few: the backward apart; else the engine (TMA)
    monkeypatch.setattr(flex_mod, "ENGINE_ROWS", 2 * S)   # without the engine's TMA forward: the direct path
    direct = r.direct(tasks, (1, S, heads, D), (1, S, kv_heads, D), (1, S, kv_heads, D), BF16, cuda)
    assert (direct is None) is few
    if few:
        assert sorted(t.rows for t in apart) == sorted(t.rows for t in tasks)
        assert sorted(r._kernel(t, sig, D, backward=True).name for t in apart) == ["cudnn", "cudnn", "flash"]
    window = steps(S, True, window=(4095, 0))[0]          # a plain window: the same band, one block
    direct = r.direct(window, (1, S, heads, D), (1, S, kv_heads, D), (1, S, kv_heads, D), BF16, cuda)
    assert (direct is None) is few
    no_grad = TaskRunner("auto", 0.1, training=False)    # no backward follows: the direct path stays
    assert no_grad.direct(tasks, (1, S, heads, D), (1, S, kv_heads, D), (1, S, kv_heads, D), BF16, cuda) is not None


def test_plain_window_and_windowed_spans_on_sm90(sm90):
    S = 16384
    assert chosen(steps(S, True, window=(4095, 0))[0], S) == [("Band", S, S, "flex")]
    r = TaskRunner("auto", 0.1, training=True)          # Note [Flex on TMA]: training runs the engine
    assert r.direct(steps(S, True, window=(4095, 0))[0], (1, S, H, D), (1, S, HKV, D), (1, S, HKV, D), BF16,
                    torch.device("cuda")) is None
    assert chosen(steps(S, True, window=(4095, 0))[0], S, training=False) == [("Band", S, S, "flex")]  # no grad
    gemma = masks.spans([(i * 1024 + 64, i * 1024 + 320) for i in range(16)], window=1023)
    assert chosen(steps(S, False, gemma)[0], S) == [("Joined", S, S, "flex")]     # 16 narrow images of 256 join
    thick = masks.spans([(0, 4096)], window=1023)          # a 4K image seen whole keeps cuDNN and merges
    calls = chosen(steps(S, False, thick)[0], S)
    assert ("Band", 4096, 4096, "cudnn") in calls and sum(k == "flex" for *_, k in calls) == 1


@pytest.mark.parametrize("case", ["spans", "block_causal"])
def test_narrow_bands_keep_fa2_and_are_not_joined_on_sm90(sm90, case):
    """Spans' 256-token images and block_causal's 32 frames at 16K (the bench's masks): their bands are an image's or
    a frame's diagonal piece, 255 and 511 rows, so the training plan is the one before flex: the causal block on
    cuDNN and the bands packed into one FA2 varlen call, not a joined flex call. Alone, such a band (an upper
    triangle, open to the right: Note [Open bands backwards]) goes to cuDNN."""
    S = 16384
    if case == "spans":
        mask, rows, n = masks.spans([(i * (S // 16) + 64, i * (S // 16) + 320) for i in range(16)]), 255, 16
    else:
        mask, rows, n = masks.block_causal(S // 32), 511, 32
    tasks = steps(S, False, mask)[0]
    bands = [t for t in tasks if t.mask.lo is not None]
    assert len(bands) == n and {t.rows for t in bands} == {rows} and rows < executor_mod.WIDE_ROWS
    span = (bands[0].q_start, bands[-1].q_stop)
    for training in (True, False):
        calls = sorted(chosen(tasks, S, training=training))
        assert calls == [("Band", S, S, "cudnn"), ("Varlen", *(span[1] - span[0],) * 2, "flash")], training
    r = TaskRunner("auto", 0.1, training=True)
    assert r.direct(tasks, (1, S, H, D), (1, S, HKV, D), (1, S, HKV, D), BF16, torch.device("cuda")) is None
    assert [k for _, k in r.kernels(tuple(bands[:1]), (1, S, H, D), (1, S, HKV, D), BF16, "cuda")] == ["cudnn"]


def test_wide_rows_is_the_line_between_fa2_and_flex(sm90):
    """A band of ``WIDE_ROWS`` rows is wide, one row fewer is not; block_causal's 4096-token frames at 128K (bands of
    4095 rows) stay on FA2, packed."""
    n = executor_mod.WIDE_ROWS
    assert chosen(steps(n, True, window=(1023, 0))[0], n) == [("Band", n, n, "flex")]
    assert chosen(steps(n - 1, True, window=(1023, 0))[0], n - 1) == [("Band", n - 1, n - 1, "flash")]
    S = 131072
    tasks = steps(S, False, masks.block_causal(4096))[0]
    assert {t.rows for t in tasks if t.mask.lo is not None} == {n - 1}
    assert sorted((form, k) for form, *_, k in chosen(tasks, S)) == [("Band", "cudnn"), ("Varlen", "flash")]


def test_short_steps_join_from_join_rows(sm90):
    """Note [Short steps join]: in a step of at most ``WIDE_ROWS`` query rows a band of ``JOIN_ROWS`` rows anchors
    one flex call with the step's thin blocks (the sink window's 2K-token rank: band, causal block, sink columns),
    forward and backward alike; a band of one row fewer keeps its blocks apart, and so does a long step (the ring's
    rank 1 at 128K over 8: its neighbour's 4095-row band beside the sink columns of all its 16K rows)."""
    n, j = executor_mod.WIDE_ROWS, executor_mod.JOIN_ROWS
    sink = masks.sink_window(511, 4)
    for S in (n, 2048, j + 4):                                # the band has S - 4 rows
        assert chosen(steps(S, False, sink)[0], S) == [("Joined", S, S, "flex")], S
    assert sorted(k for *_, k in chosen(steps(j + 3, False, sink)[0], j + 3)) == ["cudnn", "cudnn", "flash"]
    assert chosen(steps(n + 1, False, sink)[0], n + 1) != [("Joined", n + 1, n + 1, "flex")]     # no longer short
    r = TaskRunner("auto", 0.1, training=True)
    ((joined, _),) = r.kernels(steps(2048, False, sink)[0], (1, 2048, H, D), (1, 2048, HKV, D), BF16, "cuda")
    assert r._apart(joined, (H, HKV, D, BF16, torch.device("cuda")), D) is None      # its backward stays joined
    S, sink = 131072, masks.sink_window(4095, 4)
    from_rank0 = steps(S, False, sink, world=8, rank=1)[1]
    assert {(b.rows, b.mask.lo is not None) for b in from_rank0} == {(S // 8, False), (4095, True)}
    assert sorted(k for *_, k in chosen(from_rank0, S // 8)) == ["cudnn", "cudnn"]     # the band open: backwards


def test_takes_delta_asks_narrow_and_wide_blocks(sm90, monkeypatch):
    """Pass-Q's bundle carries Delta only if every kernel of a kind takes it: an sm90 training call's wide bands and
    its joined steps are on flex, its narrow bands on FA2, and both read the folded rows (flex's backward kernel
    computes Delta from the final out itself: Note [Flex backward from the final rows]), so neither kind does."""
    monkeypatch.setattr(executor_mod, "_sig", lambda q, k: (H, HKV, D, BF16, torch.device("cuda")))
    r, x = TaskRunner("auto", 0.1, training=True), torch.zeros(1)
    assert not r.takes_delta(x, x, frozenset({"band"}))
    assert not r.takes_delta(x, x, frozenset({"joined"}))
    monkeypatch.setattr(executor_mod, "_sig", lambda q, k: (8, 2, D, BF16, torch.device("cuda")))
    r = TaskRunner("auto", 0.1, training=True)           # few KV heads: a joined step's backward runs apart
    assert not r.takes_delta(x, x, frozenset({"joined"}))


def test_chunked_at_128k_plans_per_chunk_causal_blocks_on_cudnn(sm90):
    S, size = 131072, 8192
    tasks = steps(S, True, masks.chunked(size))[0]
    want = [("Band", size, size, "cudnn")] * (S // size)
    assert chosen(tasks, S) == want                       # GROUP_ROWS: no FA2 varlen call
    assert all(t.mask == Band(None, 0) for t in tasks)
    from types import SimpleNamespace

    from seqpar.config import AttentionConfig
    from seqpar.methods.base import Call

    for docs in (None, (0, S)):                           # one document (balanced layouts) keeps fixed shapes
        cfg = AttentionConfig(layout="balanced" if docs else "zigzag", cu_seqlens=docs, mask=masks.chunked(size))
        for grad in (False, True):
            call = SimpleNamespace(cfg=cfg, scale=0.1, grad=grad, seq_len=S, layout=SimpleNamespace(divisor=16))
            call.packed = Call.packed.fget(call)
            call.shapes_vary = Call.shapes_vary.fget(call)
            runner = TaskRunner.of(call)
            assert not runner.shapes_vary and runner.training is grad
    packed = chosen(tasks, S, shapes_vary=True)           # documents: one FA2 varlen call, no cuDNN plan per shape
    assert packed == [("Varlen", S, S, "flash")]


def _run(runner: TaskRunner, tasks, q, k, v, do):
    """out, lse and gradients of one step through ``runner`` (forward merges, backward sums)."""
    acc = Accumulator(q, v.shape[-1])
    for t in runner.prepare(tasks, q, k):
        acc.add(t.q, *runner.forward(q, k, v, t))
    out, lse = acc.result(q.dtype)
    grads = runner.backward_all(GradRows(do, out, None), q, k, v, lse, tasks)
    return out, lse, grads


@pytest.mark.parametrize("case", ["sink_window", "spans_window", "ring_step"])
def test_a_joined_step_computes_what_its_blocks_do(monkeypatch, case):
    """The runner's joining (bounding box, part coordinates, the blocks left apart) on the reference kernel made to
    join: the same out, lse and gradients as block by block (fp64)."""
    S = 96
    if case == "sink_window":
        tasks = steps(S, False, masks.sink_window(17, 3))[0]
    elif case == "spans_window":
        tasks = steps(S, False, masks.spans([(5, 30), (40, 44), (60, 90)], window=9))[0]
    else:                                                 # zigzag W = 4, rank 1 against rank 0's keys
        tasks = steps(S, False, masks.sink_window(13, 2), world=4, layout="zigzag", rank=1)[1]
    g = torch.Generator().manual_seed(len(tasks))
    L = max(max(t.q_stop for t in tasks), max(t.k_stop for t in tasks))
    q, do = (torch.randn(1, L, 4, 8, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(1, L, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    apart = _run(TaskRunner("reference", 0.3), tasks, q, k, v, do)
    monkeypatch.setattr(type(KERNELS["reference"]), "joins", True)
    runner = TaskRunner("reference", 0.3)
    prepared = runner.prepare(tasks, q, k)
    assert isinstance(prepared[0].mask, Joined) and len(prepared) < len(tasks)
    joined = _run(runner, tasks, q, k, v, do)
    for a, b in zip((apart[0], apart[1], *apart[2]), (joined[0], joined[1], *joined[2])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["sink_window", "spans_window", "ring_step"])
def test_a_joined_step_whose_backward_runs_apart_computes_what_its_blocks_do(monkeypatch, case):
    """Note [Band backward on few KV heads]: the forward joined (the reference kernel made to join), the backward's
    band on a kernel that does not join, so the joined task's gradients are its blocks' own calls summed: the same
    out, lse and gradients as block by block (fp64), in the accumulation dtype."""
    S = 96
    if case == "sink_window":
        tasks = steps(S, False, masks.sink_window(17, 3))[0]
    elif case == "spans_window":
        tasks = steps(S, False, masks.spans([(5, 30), (40, 44), (60, 90)], window=9))[0]
    else:
        tasks = steps(S, False, masks.sink_window(13, 2), world=4, layout="zigzag", rank=1)[1]
    g = torch.Generator().manual_seed(7)
    L = max(max(t.q_stop for t in tasks), max(t.k_stop for t in tasks))
    q, do = (torch.randn(1, L, 4, 8, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = (torch.randn(1, L, 2, 8, dtype=torch.float64, generator=g) for _ in range(2))
    want = _run(TaskRunner("reference", 0.3), tasks, q, k, v, do)
    ref = type(KERNELS["reference"])
    monkeypatch.setattr(ref, "joins", True)

    class Apart(ref):
        joins = False
    runner, apart_kernel = TaskRunner("reference", 0.3), Apart()
    own = runner._kernel

    def kernel(task, sig, dv=None, *, wide=None, backward=False):
        if backward and isinstance(task.mask, Band) and task.mask.lo is not None:
            return apart_kernel
        return own(task, sig, dv, wide=wide, backward=backward)
    monkeypatch.setattr(runner, "_kernel", kernel)
    prepared = runner.prepare(tasks, q, k)
    assert isinstance(prepared[0].mask, Joined)
    sig = (4, 2, 8, torch.float64, q.device)
    assert runner._apart(prepared[0], sig, 8) is not None and not runner.grads_in_input_dtype(q, k, prepared[0], 8)
    got = _run(runner, tasks, q, k, v, do)
    for a, b in zip((want[0], want[1], *want[2]), (got[0], got[1], *got[2])):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _dense_tiles(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    tiles = torch.zeros(idx.shape[-2:], dtype=torch.bool)
    for r in range(idx.shape[-2]):
        tiles[r, idx[0, 0, r, : num[0, 0, r]].long()] = True
    return tiles


def _joined_step(S: int, causal: bool, mask) -> tuple[Joined, int, int]:
    tasks = steps(S, causal, mask)[0]
    q0, k0 = min(t.q_start for t in tasks), min(t.k_start for t in tasks)
    parts = tuple((t.q_start - q0, t.q_stop - q0, t.k_start - k0, t.k_stop - k0, t.mask) for t in tasks)
    return Joined(parts), max(t.q_stop for t in tasks) - q0, max(t.k_stop for t in tasks) - k0


def test_flex_block_masks_of_bands_and_joined_calls_equal_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    cpu = torch.device("cpu")
    rng = random.Random(0)
    cases = [(Band(rng.choice([None, rng.randint(-n, n)]), rng.choice([None, rng.randint(-m, m)])), m, n)
             for m, n in ((rng.randint(1, 600), rng.randint(1, 600)) for _ in range(25))]
    cases += [(*_joined_step(S, c, m)[:1], *_joined_step(S, c, m)[1:]) for S, c, m in (
        (1000, False, masks.sink_window(200, 4)), (1500, False, masks.spans([(100, 300), (700, 1000)], window=150)),
        (1300, False, masks.shared_prefix(400, [300, 300, 300])))]          # tiles full only across two parts
    for mask, m, n in cases:
        want = create_block_mask(flex_mod._mask_mod(mask, m, n, cpu), None, None, m, n, device=cpu)
        got = flex_mod._tiled_block_mask(mask, m, n, cpu)
        for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                  "q_indices", "full_q_num_blocks", "full_q_indices"):
            a, b = getattr(want, f), getattr(got, f)
            if f.endswith("indices"):                   # past each row's count an index is padding
                num = getattr(want, f.replace("indices", "num_blocks"))
                a, b = _dense_tiles(num, a), _dense_tiles(num, b)
            assert torch.equal(a, b), (mask, m, n, f)


def test_flex_block_masks_of_varlen_and_mask_mod_calls_equal_create_block_mask(monkeypatch):
    """Varlen and ``mask_mod`` blocks' block masks, evaluated slab by slab (no m x n mask: 128 GiB of temporaries
    at 128K), equal ``create_block_mask``'s, slabs smaller than the call included."""
    from torch.nn.attention.flex_attention import create_block_mask

    from seqpar.masks import mod as mask_mod_module

    cpu = torch.device("cpu")
    rng = random.Random(1)
    def stripes(p: int):
        return lambda b, h, qi, ki: ((qi // p) % 2 == 0) | (ki % p == 0)

    cases = []
    for _ in range(12):
        m, n = rng.randint(1, 700), rng.randint(1, 700)
        cu_q = sorted({0, m, *rng.sample(range(1, m + 1), min(m, 3))})
        cu_k = sorted({0, n, *rng.sample(range(1, n + 1), min(n, len(cu_q) - 2))})
        k = min(len(cu_q), len(cu_k))
        cu_q, cu_k = [*cu_q[:k - 1], m], [*cu_k[:k - 1], n]
        cases.append((Varlen(tuple(cu_q), tuple(cu_k), rng.choice([(-1, -1), (-1, 0), (rng.randint(0, 90), 0)])),
                      m, n))
        cases.append((Modded(Band(None, rng.choice([None, 0])), stripes(rng.randint(2, 9)), ((0, m),), ((0, n),)),
                      m, n))
    for cells in (mask_mod_module.EVAL_CELLS, 128 * 128):
        monkeypatch.setattr(mask_mod_module, "EVAL_CELLS", cells)
        for mask, m, n in cases:
            want = create_block_mask(flex_mod._mask_mod(mask, m, n, cpu), None, None, m, n, device=cpu)
            got = flex_mod._block_mask(mask, m, n, cpu)
            flex_mod._MODS.clear()
            flex_mod._DOCS.clear()
            for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                a, b = getattr(want, f), getattr(got, f)
                if f.endswith("indices"):
                    num = getattr(want, f.replace("indices", "num_blocks"))
                    a, b = _dense_tiles(num, a), _dense_tiles(num, b)
                assert torch.equal(a, b), (mask, m, n, f, cells)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_serves_a_joined_call_as_the_reference_does():
    """Eager flex on CPU (the joined ``mask_mod`` and its block mask) against the reference kernel on the same
    ``Joined`` mask and against the named mask evaluated densely."""
    S = 300
    joined, m, n = _joined_step(S, False, masks.sink_window(61, 3))
    assert (m, n) == (S, S) and joined.row_intervals(m).shape == (4, S)
    pos = torch.arange(S)
    assert torch.equal(dense(joined, m, n), masks.sink_window(61, 3)(0, 0, pos[:, None], pos[None, :]))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, S, 4, 16, generator=g)
    k, v = (torch.randn(1, S, 2, 16, generator=g) for _ in range(2))
    got = KERNELS["flex"].forward(q, k, v, joined, 0.25)
    want = KERNELS["reference"].forward(q.double(), k.double(), v.double(), joined, 0.25)
    torch.testing.assert_close(got.out.double(), want.out, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(got.lse.double(), want.lse, atol=2e-6, rtol=2e-6)


def test_cpu_auto_never_joins():
    S = 64
    tasks = steps(S, False, masks.sink_window(9, 2))[0]
    q = k = torch.zeros(1, S, 2, 8)
    assert TaskRunner("auto", 0.1).prepare(tasks, q, k) == tasks
    assert not any(isinstance(t.mask, (Joined, Varlen)) for t in TaskRunner("reference", 0.1).prepare(tasks, q, k))
