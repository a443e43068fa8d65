"""``seqpar.integrations.hf_memory``: the tiled MLP and activation offload change no value.

A tiny Llama (random weights, config in code, activation checkpointing on) trained twice from one seed: plain,
and with ``tile_mlp`` and ``tile_norms`` (16-token chunks) plus ``ActivationOffload`` around the forward. At W = 1
in this process, at W = 2 (ring, zigzag) and W = 4 (USP 2 x 2) on gloo workers. Expected, in fp64 and fp32 (Note
[Tiled MLP], Note [Tiled norms]):
- the loss, and (MLP tiled alone) every gradient that does not sum over the MLP's chunks, bitwise equal (a
  row-chunked matmul is row-independent on CPU when the chunk is a multiple of its 8-row block: the test uses 16);
- the MLP and RMSNorm weights' gradients, a sum split into one partial per chunk, within 1e-12 (fp64) / 1e-5 (fp32)
  normalised error; the second step's loss and gradients and the parameters after it the same way (AdamW in
  fp64, SGD with momentum in fp32).
On CPU the offload hooks pass tensors through (there is no device memory to spare): the test checks that the
checkpointed layer inputs reach them, and that the values are unchanged.

``keep_attention`` (Note [Keeping attention's output] in ``seqpar.integrations.hf_selective``): plain checkpointing
against checkpointing that keeps each layer's attention output, with the tiled MLP and norms and the offload context
on both, every method at W = 1, 2 and 4 and under FSDP2 (tiled norms there too): losses and gradients bitwise
equal, the adapter's attention forwards counted (one per layer per step instead of two), the budget, the forward
boundaries and the refusals.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

pytest.importorskip("transformers")

from _workers_hf import build, checkpoint_layers, global_batch, make_mesh

from seqpar.integrations import hf_memory
from seqpar.integrations import huggingface as sp_hf

CHUNK = 16
MLP_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
"""Normalised error of a gradient summed over chunks (and of everything after the first optimizer step)."""


def _is_mlp_weight(name: str) -> bool:
    """A weight whose gradient the tiled model sums over chunks: the MLP's and the tiled RMSNorms'."""
    return ".mlp." in name or name.endswith("norm.weight")


def _norm_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _compare(plain, tiled, out: dict[str, float], key: str, what: str = "grad") -> None:
    """Per parameter: 0.0 when bitwise equal, else the normalised error (``what``: "grad" or "param")."""
    ref = dict(plain.named_parameters())
    for name, p in tiled.named_parameters():
        a = p.grad if what == "grad" else p.detach()
        b = ref[name].grad if what == "grad" else ref[name].detach()
        err = 0.0 if torch.equal(a, b) else _norm_error(a, b)
        out[f"{key}:{name}"] = max(out.get(f"{key}:{name}", 0.0), err)


def _step_pair(plain, tiled, run_plain, run_tiled, steps: int = 2) -> dict[str, float]:
    """``steps`` optimizer steps of both models (AdamW in fp64; SGD with momentum in fp32, where Adam would turn
    rounding noise on near-zero gradients into lr-sized steps); ``run_*(model) -> loss`` does the backward.
    Keys: ``loss0``/``grad0:*`` the first step (same parameters), ``loss``/``grad:*`` the later steps (the
    parameters differ by the first step's rounding), ``param:*`` after the last step."""
    fp64 = next(plain.parameters()).dtype == torch.float64
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) if fp64 else
            torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (plain, tiled)]
    errors: dict[str, float] = {}
    for step in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        la, lb = run_plain(plain), run_tiled(tiled)
        key = "0" if step == 0 else ""
        errors[f"loss{key}"] = max(errors.get(f"loss{key}", 0.0), 0.0 if torch.equal(la, lb) else _norm_error(lb, la))
        _compare(plain, tiled, errors, f"grad{key}")
        for o in opts:
            o.step()
    _compare(plain, tiled, errors, "param", "param")
    return errors


def _judge(errors: dict[str, float], dtype: torch.dtype, label: str, norms: bool = False,
           norm_dtype: torch.dtype | None = None) -> None:
    """First step: the loss and every gradient but the MLP weights' bitwise, those within MLP_TOL. Later steps
    and the parameters: within MLP_TOL (the first step's last-bit differences propagate). With tiled ``norms``,
    only the loss is bitwise: in fp32/fp64 the RMSNorm's upcast is a no-op, so the plain backward adds the
    norm's two gradient terms and the residual's into the input in one order, the tiled one in another
    (Note [Tiled norms]); every gradient upstream of a norm is then within MLP_TOL. ``norm_dtype``: the dtype
    a norm computes in, when not the model's (Gemma's upcasts to fp32): its weights' tolerance."""
    def limit(key: str) -> float:
        if norm_dtype is not None and key.endswith("norm.weight"):
            return MLP_TOL[norm_dtype]
        first = key == "loss0" or key.startswith("grad0:")
        return MLP_TOL[dtype] if not first or _is_mlp_weight(key) or (norms and key != "loss0") else 0.0

    bad = {k: f"{v:.2e}" for k, v in errors.items() if v > limit(k)}
    assert not bad, f"{label}: {bad}"
    assert any(_is_mlp_weight(k) and k.startswith("grad0:") for k in errors)


# --------------------------------------------------------------------------------------------------------------
# W = 1


def _pair(family: str, dtype: torch.dtype, attn: str = "sdpa"):
    plain = build(family, attn, dtype=dtype)
    tiled = copy.deepcopy(plain)
    for m in (plain, tiled):
        checkpoint_layers(m)
        m.train()
    return plain, tiled


@pytest.mark.parametrize("norms", [False, True], ids=["mlp", "mlp+norms"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_process_equals_plain_step(dtype, norms):
    """W = 1, batch 2 x 40 tokens (80 rows: five 16-row chunks), checkpointing, two optimizer steps; the tiled MLP
    alone, and with tiled norms."""
    plain, tiled = _pair("llama", dtype)
    tiling = hf_memory.tile_mlp(tiled, chunk_tokens=CHUNK)
    assert sorted(tiling.modules) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    if norms:
        tiled_norms = hf_memory.tile_norms(tiled, chunk_tokens=CHUNK)
        assert sorted(tiled_norms.modules) == [
            "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
            "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm", "model.norm"]
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    offload = hf_memory.ActivationOffload(min_bytes=0)

    def run_plain(m):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    def run_tiled(m):
        with offload:
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    _judge(_step_pair(plain, tiled, run_plain, run_tiled), dtype, f"W=1 {dtype} norms={norms}", norms)
    layer_input = 2 * 40 * 32 * torch.finfo(dtype).bits // 8
    assert offload.stats.offloaded_bytes == 0                     # CPU: everything passes through
    assert offload.stats.kept_bytes >= 2 * layer_input            # ... but the checkpointed inputs reached it


def test_chunks_that_do_not_divide_and_no_grad():
    """A 7-token chunk (the matmul's row blocks differ: equal within fp64 rounding, not bitwise), an inference
    forward (no graph: chunks only), and ``remove()`` restoring the module's own forward."""
    plain, tiled = _pair("llama", torch.float64)
    tiling = hf_memory.tile_mlp(tiled, chunk_tokens=7)
    norms = hf_memory.tile_norms(tiled, chunk_tokens=7)
    ids = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(4))
    lp, lt = plain(input_ids=ids, labels=ids).loss, tiled(input_ids=ids, labels=ids).loss
    lp.backward()
    lt.backward()
    assert _norm_error(lt, lp) <= 1e-14
    errors: dict[str, float] = {}
    _compare(plain, tiled, errors, "grad")
    assert max(errors.values()) <= 1e-12, errors
    with torch.no_grad():
        assert _norm_error(tiled(input_ids=ids).logits, plain(input_ids=ids).logits) <= 1e-14
    tiling.remove()
    norms.remove()
    assert not any("forward" in m.__dict__ for m in tiled.modules())
    with torch.no_grad():
        assert torch.equal(tiled.model.layers[0].mlp(torch.ones(3, 32, dtype=torch.float64)),
                           plain.model.layers[0].mlp(torch.ones(3, 32, dtype=torch.float64)))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_families(family):
    """Qwen2/3, Mistral, Gemma 2 and Gemma 3 MLPs (gelu-tanh for Gemma) tile: loss bitwise, grads as above."""
    if family == "gemma3":
        import transformers as tf

        cfg = tf.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                  use_cache=False, dtype=torch.float64)
        torch.manual_seed(0)
        plain = tf.Gemma3ForCausalLM(cfg).to(torch.float64)
        tiled = copy.deepcopy(plain)
    else:
        plain, tiled = _pair(family, torch.float64, "eager" if family == "gemma2" else "sdpa")
    hf_memory.tile_mlp(tiled, chunk_tokens=CHUNK)
    norms = hf_memory.tile_norms(tiled, chunk_tokens=CHUNK)
    assert not any("q_norm" in n or "k_norm" in n for n in norms.modules)      # per-head norms: not hidden-size
    assert "model.norm" in norms.modules and len(norms.modules) >= 5
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))

    def run(m):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    _judge(_step_pair(plain, tiled, run, run, steps=1), torch.float64, family, norms=True,
           norm_dtype=torch.float32 if family.startswith("gemma") else None)    # Gemma's norms compute in fp32


@pytest.mark.parametrize("family,refused", [("gpt_oss", "GptOssMLP"), ("deepseek_v3", "DeepseekV3MoE")])
def test_refuses_other_mlps(family, refused):
    """Experts are not a gated MLP: refused by name (every such layer listed), nothing changed."""
    model = build(family, "eager")
    with pytest.raises(ValueError, match=rf"serves gated MLPs.*{refused}"):
        hf_memory.tile_mlp(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    if family == "deepseek_v3":               # its dense first layer alone can be tiled
        tiling = hf_memory.tile_mlp(model, layers=[model.model.layers[0]])
        assert list(tiling.modules) == ["model.layers.0.mlp"]


def test_bad_arguments():
    plain = build("llama", "sdpa")
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        hf_memory.tile_mlp(plain, chunk_tokens=0)
    with pytest.raises(ValueError, match="no module with an 'mlp' child"):
        hf_memory.tile_mlp(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        hf_memory.tile_norms(plain, chunk_tokens=True)
    with pytest.raises(ValueError, match="no RMSNorm of the hidden size"):
        hf_memory.tile_norms(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"serves RMSNorm modules.*model.layers.0.mlp \(LlamaMLP\)"):
        hf_memory.tile_norms(plain, modules=[plain.model.layers[0].input_layernorm, plain.model.layers[0].mlp])
    assert all("forward" not in m.__dict__ for m in plain.modules())
    with pytest.raises(ValueError, match="keep_bytes must be a non-negative int"):
        hf_memory.ActivationOffload(keep_bytes=-1)
    offload = hf_memory.ActivationOffload()
    with offload, pytest.raises(RuntimeError, match="already active"):
        offload.__enter__()


# --------------------------------------------------------------------------------------------------------------
# W = 2 and 4 (gloo workers)


def sequence_parallel_pair(spec: dict) -> dict[str, float]:
    """Worker: the seqpar model plain and with tile_mlp + tile_norms + offload on this rank's ``shard_batch`` share,
    gradients all-reduced (test_hf.py checks the plain one against one process)."""
    dtype = getattr(torch, spec["dtype"])
    mesh = make_mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout="zigzag", name=f"seqpar_mem_{spec['method']}")
    try:
        plain, tiled = _pair("llama", dtype, handle.name)
        hf_memory.tile_mlp(tiled, chunk_tokens=CHUNK)
        hf_memory.tile_norms(tiled, chunk_tokens=CHUNK)
        batch = global_batch({**spec, "batch": 2})
        local = handle.shard_batch(batch)
        offload = hf_memory.ActivationOffload(min_bytes=0)

        def run(m, ctx):
            with ctx:
                loss = m(**local).loss
            loss.backward()
            sp_hf.all_reduce_gradients(m.parameters(), mesh)
            return loss.detach()

        errors = _step_pair(plain, tiled, lambda m: run(m, contextlib.nullcontext()), lambda m: run(m, offload))
        errors["kept_layer_inputs"] = float(offload.stats.kept_bytes)
        return errors
    finally:
        handle.disable()


@pytest.mark.parametrize("world,spec", [(2, {"method": "ring"}), (4, {"method": "usp", "ulysses": 2})])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sequence_parallel_equals_plain_step(pools, world, spec, dtype):
    """W = 2 ring zigzag, W = 4 USP 2 x 2: per rank, the tiled + offloaded step equals the plain seqpar step."""
    results = pools(world).run(sequence_parallel_pair, {**spec, "dtype": dtype, "seq": 64})
    for rank, errors in enumerate(results):
        kept = errors.pop("kept_layer_inputs")
        _judge(errors, getattr(torch, dtype), f"W={world} {spec['method']} {dtype} rank {rank}", norms=True)
        assert kept > 0


class _FakeCudart:
    """``torch.cuda.cudart()`` on CPU: registration succeeds (``rc``), every call noted."""

    def __init__(self, rc: int = 0):
        self.rc, self.calls = rc, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def test_pinned_pool_budget_reuse_and_eviction(monkeypatch):
    """The host side of the offload without a GPU (registration stubbed): sizes round up to whole pages, a freed
    buffer serves the next request of its size, a request past the budget evicts free buffers first and is
    refused (None: the tensor stays on the GPU) when even that is not enough."""
    page = hf_memory.PAGE
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pool = hf_memory._PinnedPool()
    pool.budget = 4 * page
    a = pool.take(1)
    assert a.size == page and a.registered and pool.held == page
    b = pool.take(2 * page)
    pool.give(a)
    assert pool.take(page - 7) is a                          # reused, not pinned again
    assert pool.take(2 * page) is None and pool.held == 3 * page     # over budget, nothing free to evict
    pool.give(b)
    c = pool.take(3 * page)                                  # evicts b (2 pages) to fit 3 pages
    assert c is not None and c.size == 3 * page and pool.held == 4 * page and not pool.free[2 * page]
    pool.give(a)
    pool.give(c)
    pool.close()
    assert pool.held == 0 and not pool.free
    assert sum(1 for c in cudart.calls if c[0] == "register") == sum(1 for c in cudart.calls if c[0] == "unregister")


def test_registered_memory_is_pinned_and_the_fallback_is_counted_whole(monkeypatch):
    """Note [Registered is pinned]: a successful cudaHostRegister gives a buffer of exactly the size asked,
    page-aligned (torch 2.11's ``is_pinned()`` says False for it; the pool must not fall back on that). Where
    registering fails, the caching host allocator's buffer counts as the power of two it takes, and a request
    whose power of two does not fit the budget is refused."""
    page = hf_memory.PAGE
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buf = hf_memory._pin(3 * page)
    assert buf.registered and buf.size == buf.footprint == 3 * page and buf.tensor.numel() == 3 * page
    assert buf.tensor.data_ptr() % page == 0 and cudart.calls[-1] == ("register", buf.tensor.data_ptr(), 3 * page)
    fallback = hf_memory._Pinned(torch.empty(3 * page, dtype=torch.uint8), 3 * page, False)
    assert fallback.footprint == 4 * page
    monkeypatch.setattr(hf_memory, "_pin", lambda size: hf_memory._Pinned(torch.empty(size, dtype=torch.uint8),
                                                                         size, False))
    pool = hf_memory._PinnedPool()
    pool.budget = 6 * page
    assert pool.take(3 * page).footprint == 4 * page and pool.held == 4 * page
    assert pool.take(2 * page) is not None and pool.held == 6 * page
    assert pool.take(page) is None and pool.held == 6 * page     # one page fits nothing more


# --------------------------------------------------------------------------------------------------------------
# the CUDA path's stream order, on CPU (Note [Offload stream order])


class _FakeStream:
    """A side stream's work runs only when something waits for it; a compute stream's (``eager``) at once, as
    the CPU ops that stand for its kernels do. ``snaps[i][s]``: how many of stream ``s``'s operations this one
    is ordered after (transitively) after its own first ``i``."""

    def __init__(self, name: str, eager: bool = False):
        self.name, self.ops, self.done, self.eager = name, [], 0, eager
        self.snaps: list[dict] = [{}]

    def pos(self) -> int:
        return len(self.ops)

    def enqueue(self, fn) -> None:
        self.ops.append(fn)
        self.snaps.append(dict(self.snaps[-1]))

    def run_to(self, n: int) -> None:
        while self.done < n:
            self.done += 1
            self.ops[self.done - 1]()

    def after(self, other: _FakeStream, n: int) -> None:
        if other is self:
            return
        seen = dict(self.snaps[-1])
        for s, m in [*other.snaps[n].items(), (other, n)]:
            if s is not self:
                seen[s] = max(seen.get(s, 0), m)
        self.enqueue(lambda: other.run_to(n))
        self.snaps[-1] = seen
        if self.eager:
            self.run_to(self.pos())

    def ordered_after(self, other: _FakeStream, n: int) -> bool:
        return other is self or self.snaps[-1].get(other, 0) >= n

    def wait_stream(self, other: _FakeStream) -> None:
        self.after(other, other.pos())

    def wait_event(self, ev: _FakeEvent) -> None:
        self.after(ev.stream, ev.pos)


class _FakeEvent:
    stream: _FakeStream
    pos: int

    def record(self, stream: _FakeStream) -> None:
        self.stream, self.pos = stream, stream.pos()

    def synchronize(self) -> None:
        self.stream.run_to(self.pos)


def _garbage(t: torch.Tensor) -> torch.Tensor:
    t.reshape(-1).view(torch.uint8).fill_(0xFF)            # NaN in floats, -1 in ints
    return t


class _FakeCuda:
    """``hf_memory._CudaOps`` on CPU tensors: copies are deferred until a wait reaches them (a missing wait
    leaves NaN / stale values), and every copy is checked against the order rules; ``violations`` lists the
    broken ones. ``current`` is the compute stream; each query of it stands for kernels launched since."""

    def __init__(self):
        self.current = _FakeStream("compute", eager=True)
        self.alloc: dict[int, tuple[_FakeStream, int]] = {}       # restored tensors: where allocated
        self.host_reads: dict[int, tuple[_FakeStream, int]] = {}   # pinned buffers: the last H2D that read them
        self.recorded: set[tuple[int, _FakeStream]] = set()
        self.uses: list[tuple[int, _FakeStream, str]] = []         # (storage, stream, what) to be recorded
        self.violations: list[str] = []
        self.hosts: set[int] = set()

    def offloadable(self, t):
        return True

    def current_stream(self, device):
        self.current.enqueue(lambda: None)
        return self.current

    def new_stream(self, device):
        return _FakeStream("side")

    def new_event(self):
        return _FakeEvent()

    def empty(self, shape, dtype, device, stream):
        t = _garbage(torch.empty(shape, dtype=dtype))
        self.alloc[t.untyped_storage().data_ptr()] = (stream, stream.pos())
        return t

    def copy(self, dst, src, stream):
        d, s = dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr()
        if d in self.hosts:                                       # device -> host
            if not stream.ordered_after(self.current, self.current.pos()):
                self.violations.append("D2H before the compute stream wrote its source")
            last = self.host_reads.get(d)
            if last is not None and not stream.ordered_after(*last):
                self.violations.append("D2H overwrites a pinned buffer an H2D may still read")
            self.uses.append((s, stream, "D2H source"))
        else:                                                     # host -> device
            where = self.alloc[d]
            if not stream.ordered_after(*where):
                self.violations.append("H2D writes a block its allocation stream may still use")
            self.uses.append((d, stream, "H2D destination"))
        dst, src = dst.detach(), src.detach()                    # the memory, not the graph (record_stream's)
        stream.enqueue(lambda: dst.copy_(src))
        if s in self.hosts:
            self.host_reads[s] = (stream, stream.pos())

    def clone(self, t, stream):
        return t.detach().clone()

    def differ(self, a, b, stream):
        return hf_memory._byte_diff(a, b)

    def record_stream(self, t, stream):
        self.recorded.add((t.untyped_storage().data_ptr(), stream))

    def unrecorded(self) -> list[str]:
        """Uses on a stream other than the allocation's that were not recorded (the block could be reused)."""
        out = []
        for ptr, stream, what in self.uses:
            home = self.alloc.get(ptr, (self.current, 0))[0]
            if stream is not home and (ptr, stream) not in self.recorded:
                out.append(what)
        return out


def _fake_offload(monkeypatch, **kw):
    fake = _FakeCuda()

    def pin(size):
        t = _garbage(torch.empty(size, dtype=torch.uint8))
        fake.hosts.add(t.untyped_storage().data_ptr())
        return hf_memory._Pinned(t, size, False)

    take = hf_memory._Offloaded.take

    def take_and_note(self):                                      # the consumer's use of the restored tensor
        gpu = take(self)
        fake.uses.append((gpu.untyped_storage().data_ptr(), fake.current, "use in backward"))
        return gpu

    monkeypatch.setattr(hf_memory, "_pin", pin)
    monkeypatch.setattr(hf_memory._Offloaded, "take", take_and_note)
    off = hf_memory.ActivationOffload(min_bytes=0, host_bytes=1 << 30, verify=True, **kw)
    off._ops = fake
    return off, fake


def _offloaded_steps(monkeypatch, dtype, steps=2, consumer_switch=True, **kw):
    """A tiny checkpointed Llama, plain vs every saved tensor through the (fake) CUDA path; the backward on
    another compute stream than the forward when ``consumer_switch`` (autograd's device thread)."""
    plain, off_model = _pair("llama", dtype)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    off, fake = _fake_offload(monkeypatch, **kw)
    results = []
    for _ in range(steps):                                        # the second step reuses the pinned buffers
        for m in (plain, off_model):
            m.zero_grad(set_to_none=True)
        plain(input_ids=ids, labels=ids).loss.backward()
        with off:
            loss = off_model(input_ids=ids, labels=ids).loss
        if consumer_switch:
            fake.current = _FakeStream("backward", eager=True)
        loss.backward()
        ref = dict(plain.named_parameters())
        bad = [n for n, p in off_model.named_parameters() if not torch.equal(p.grad, ref[n].grad)]
        results.append((bad, off.verify(), off.stats.as_dict()))
    return results, fake


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_path_stream_order_on_cpu(monkeypatch, dtype):
    """Every saved tensor through the offload's CUDA logic with deferred copies and an order checker: gradients
    bitwise equal to plain, every restored tensor equal to the saved one, no order rule broken, every
    cross-stream use recorded, over two steps (pinned buffers reused)."""
    results, fake = _offloaded_steps(monkeypatch, dtype)
    for bad, check, stats in results:
        assert stats["offloaded_tensors"] > 0 and stats["fetches"] >= stats["offloaded_tensors"]
        assert check["checked"] > 0 and check["mismatched"] == 0, check
        assert bad == []
    assert fake.violations == []
    assert fake.unrecorded() == []


def _graph_tensors() -> int:
    """Live tensors with an autograd history (``isinstance`` on every live object touches deprecated ones)."""
    import gc
    import warnings

    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_forward_without_backward_frees_its_graph(monkeypatch):
    """Note [Packed without history]: a checkpointed Llama's forward under the offload, with no backward (the
    recipe's warm-up): once its outputs go, no tensor of its graph is left, on the CPU pass-through path and on
    the (fake) CUDA path, where every pinned buffer is back in the pool for the next forward. Packed as is, the
    outputs ops save (rsqrt in RMSNorm) tied the graph into a cycle the collector cannot see."""
    model, _ = _pair("llama", torch.float32)
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(4))
    before = _graph_tensors()
    with hf_memory.ActivationOffload():
        out = model(input_ids=ids, labels=ids)
    del out
    assert _graph_tensors() == before
    off, _ = _fake_offload(monkeypatch, keep_bytes=0)
    off.min_bytes = 1 << 10                         # small tensors stay, packed as they are
    with off:
        out = model(input_ids=ids, labels=ids)
    assert off.stats.offloaded_tensors > 0 and off._pool.held > 0
    del out
    assert _graph_tensors() == before
    assert sum(b.size for v in off._pool.free.values() for b in v) == off._pool.held


def test_reused_buffer_waits_for_its_last_copy(monkeypatch):
    """A forward whose graph is dropped after its prefetch (at the context's exit, of every saved tensor here):
    the pinned buffers go back to the pool with their host->device copies still queued; the next forward's
    device->host copies into them wait for those, and its backward gets its own values back."""
    off, fake = _fake_offload(monkeypatch, prefetch=1 << 20)
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    with off:
        y = (x * 3).sin().exp().sum()
    assert off.stats.fetches == off.stats.offloaded_tensors > 0
    del y
    assert sum(len(v) for v in off._pool.free.values()) == off.stats.offloaded_tensors
    with off:
        y = (x * 5).sin().exp().sum()
    y.backward()
    x2 = x.detach().requires_grad_()
    (x2 * 5).sin().exp().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert off.verify()["mismatched"] == 0
    assert fake.violations == [] and fake.unrecorded() == []


def test_order_checker_catches_the_old_bugs(monkeypatch):
    """The checker is not vacuous: the pre-fix fetch (no wait for the allocation stream) and a take that does
    not wait for its copy are both caught."""

    def old_fetch(self, h2d):
        gpu = self.ops.empty(self.shape, self.dtype, self.device, self.ops.current_stream(self.device))
        h2d.wait_event(self.saved)
        self.ops.copy(gpu, self.host, h2d)
        self.ready = self.ops.new_event()
        self.ready.record(h2d)
        self.ops.record_stream(gpu, h2d)
        self.buf.last = self.ready
        self.gpu = gpu

    with monkeypatch.context() as mp:
        mp.setattr(hf_memory._Offloaded, "fetch", old_fetch)
        _, fake = _offloaded_steps(mp, torch.float64, steps=1)
        assert "H2D writes a block its allocation stream may still use" in fake.violations

    def take_without_wait(self):
        gpu, self.gpu = self.gpu, None
        self.pending = max(0, self.pending - 1)
        return gpu

    with monkeypatch.context() as mp:
        mp.setattr(hf_memory._Offloaded, "take", take_without_wait)
        with pytest.raises((IndexError, RuntimeError, AssertionError)):     # garbage (-1) indices, or
            results, _ = _offloaded_steps(mp, torch.float64, steps=1)
            bad, check, _ = results[0]
            assert bad == [] and check["mismatched"] == 0  # ... wrong values: either way it fails


# --------------------------------------------------------------------------------------------------------------
# selective recompute: checkpointed layers keep their attention's output (Note [Keeping attention's output])


def _methods(world: int) -> list[dict]:
    """Every softmax method at ``world`` with the layout, options and length it needs (as tests/test_hf.py)."""
    from reliability_methods import padded_length, softmax_setup

    import seqpar

    specs = []
    for name in seqpar.methods.available():
        s = softmax_setup(name, world)
        specs.append({"method": name, "layout": s.layout, "options": dict(s.options),
                      "seq": padded_length(s, world, 32), **({"ulysses": 2} if name == "usp" else {})})
    return specs


def _checkpoint(model, kwargs: dict) -> None:
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def keep_attention_pair(spec: dict) -> dict:
    """Worker: plain checkpointing vs ``keep_attention`` on one seqpar model (tiled MLP and the offload context on
    both), two optimizer steps; the errors (0.0: bitwise), the attention forwards each ran per step (the HF
    adapter's calls of ``seqpar.attention``, counted by a wrapper here) and the keeper's stats."""
    from seqpar.integrations import hf_selective
    from seqpar.integrations.hf import attention as hf_attention

    dtype = getattr(torch, spec["dtype"])
    mesh = make_mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout"), name=f"seqpar_keep_{spec['method']}",
                          **spec.get("options", {}))
    calls = [0]
    inner = hf_attention.attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    keep = hf_selective.keep_attention(handle, keep_bytes=spec.get("keep_bytes"))
    hf_attention.attention = counted
    try:
        plain = build("llama", handle.name, dtype=dtype)
        kept = copy.deepcopy(plain)
        _checkpoint(plain, {"use_reentrant": False})
        _checkpoint(kept, keep.checkpoint_kwargs())
        for m in (plain, kept):
            hf_memory.tile_mlp(m, chunk_tokens=CHUNK)
            hf_memory.tile_norms(m, chunk_tokens=CHUNK)
        local = handle.shard_batch(global_batch({**spec, "batch": 2}))
        offload = hf_memory.ActivationOffload(min_bytes=0)
        per_step: dict[str, list[int]] = {"plain": [], "kept": []}

        def run(m, name):
            calls[0] = 0
            with offload:
                loss = m(**local).loss
            loss.backward()
            sp_hf.all_reduce_gradients(m.parameters(), mesh)
            per_step[name].append(calls[0])
            return loss.detach()

        errors = _step_pair(plain, kept, lambda m: run(m, "plain"), lambda m: run(m, "kept"))
        return {"errors": errors, "calls": per_step, "stats": keep.stats.as_dict()}
    finally:
        hf_attention.attention = inner
        keep.remove()
        handle.disable()


def _judge_keep(results: list[dict], label: str, kept_layers: int = 2, layers: int = 2) -> None:
    """Every rank: loss, gradients (both steps) and parameters bitwise equal to plain checkpointing; attention
    forwards per step: plain 2 per layer, kept 1 per kept layer and 2 per other layer."""
    for rank, res in enumerate(results):
        bad = {k: f"{v:.2e}" for k, v in res["errors"].items() if v != 0.0}
        assert not bad, f"{label} rank {rank}: {bad}"
        assert res["calls"] == {"plain": [2 * layers] * 2, "kept": [2 * layers - kept_layers] * 2}, (label, res)
        st = res["stats"]
        assert (st["kept_calls"], st["replayed_calls"]) == (kept_layers, kept_layers), (label, st)
        assert (st["not_kept_calls"], st["recomputed_calls"]) == (layers - kept_layers,) * 2, (label, st)
        assert st["kept_bytes"] > 0 and st["unframed_calls"] == 0, (label, st)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_keep_attention_equals_plain_checkpointing(pools, world):
    """Every method at W = 1, 2, 4 (fp64; fp32 for ring): with keep_attention each layer's attention runs once per
    step where plain checkpointing runs it twice, and the two steps' losses and gradients are bitwise equal. At
    W = 2 a budget of one layer's out and lse keeps layer 0 only (layer 1's attention recomputes, collectives
    included, on every rank alike)."""
    pool = pools(world)
    for spec in _methods(world) if world > 1 else [{"method": "ring", "seq": 32}]:
        for dtype in ("float64", "float32") if spec["method"] == "ring" else ("float64",):
            _judge_keep(pool.run(keep_attention_pair, {**spec, "dtype": dtype}), f"W={world} {spec} {dtype}")
    if world == 2:
        one_layer = 2 * 16 * 4 * 8 * 8 + 2 * 4 * 16 * 8          # out (B, L, H, D) + lse (B, H, L), fp64
        spec = {"method": "ring", "seq": 32, "dtype": "float64", "keep_bytes": one_layer}
        _judge_keep(pool.run(keep_attention_pair, spec), f"W=2 {spec}", kept_layers=1)


def keep_attention_fsdp(spec: dict) -> dict:
    """Worker: FSDP2 (fully_shard per layer and at the root, over the sequence-parallel ranks) on a checkpointed
    seqpar Llama, plain vs keep_attention, AdamW, two steps; 0.0 per loss / full gradient when bitwise equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from seqpar.integrations import hf_selective

    handle = sp_hf.enable(None, method=spec["method"], name="seqpar_keep_fsdp")
    keep = hf_selective.keep_attention(handle)
    try:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        plain = build("llama", handle.name, dtype=torch.float64)
        kept = copy.deepcopy(plain)
        _checkpoint(plain, {"use_reentrant": False})
        _checkpoint(kept, keep.checkpoint_kwargs())
        for m in (plain, kept):
            hf_memory.tile_norms(m, chunk_tokens=CHUNK)              # under FSDP2: the norms' weights unsharded
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, kept)]
        local = handle.shard_batch(global_batch({**spec, "batch": 2}))
        errors: dict[str, float] = {}
        for step in range(2):
            losses = []
            for m, opt in zip((plain, kept), opts):
                opt.zero_grad(set_to_none=True)
                loss = m(**local).loss
                loss.backward()
                losses.append(loss.detach())
            errors[f"loss{step}"] = 0.0 if torch.equal(*losses) else _norm_error(losses[1], losses[0])
            ref = dict(plain.named_parameters())
            for name, p in kept.named_parameters():
                a, b = p.grad.full_tensor(), ref[name].grad.full_tensor()
                errors[f"grad{step}:{name}"] = 0.0 if torch.equal(a, b) else _norm_error(a, b)
            for opt in opts:
                opt.step()
        return {"errors": errors, "stats": keep.stats.as_dict()}
    finally:
        keep.remove()
        handle.disable()


def test_keep_attention_under_fsdp2(pools):
    """FSDP2 unshards and reshards each layer around its forward, its recompute and its backward: keeping the
    attention output changes no loss or gradient (W = 2, ring, fp64, AdamW)."""
    for rank, res in enumerate(pools(2).run(keep_attention_fsdp, {"method": "ring", "seq": 32})):
        bad = {k: f"{v:.2e}" for k, v in res["errors"].items() if v != 0.0}
        assert not bad, f"rank {rank}: {bad}"
        assert res["stats"]["kept_calls"] == res["stats"]["replayed_calls"] == 2, res["stats"]


# in one process: transformers' SDPA behind a handle's name (the keeper needs no process group)


def _sdpa_handle(name: str):
    """A handle whose registered function is SDPA on the whole (one-process) sequence."""
    from transformers import AttentionInterface

    def sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)
        return out.transpose(1, 2), None

    handle = sp_hf.enable(None, method="ring", name=name)
    handle.attention_fn = sdpa
    AttentionInterface.register(name, sdpa)
    return handle


def test_keep_attention_budget_and_forward_boundaries():
    """One process: a budget of one layer keeps layer 0 only; a forward without backward (a warm-up) before the
    step does not eat the step's budget (a forward begins when an attention module is called again); the step's
    gradients are bitwise those of plain checkpointing; a model checkpointed without the keeper's kwargs keeps
    nothing and says so (unframed calls); ``remove()`` restores the handle's function."""
    from transformers import AttentionInterface

    from seqpar.integrations import hf_selective

    handle = _sdpa_handle("seqpar_keep_sdpa")
    try:
        keep = hf_selective.keep_attention(handle, keep_bytes=2 * 40 * 4 * 8 * 8 + 2 * 4 * 40 * 8)
        plain = build("llama", handle.name, dtype=torch.float64)
        kept, unframed = copy.deepcopy(plain), copy.deepcopy(plain)
        _checkpoint(plain, {"use_reentrant": False})
        _checkpoint(kept, keep.checkpoint_kwargs())
        _checkpoint(unframed, {"use_reentrant": False})
        ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(6))
        kept(input_ids=ids, labels=ids)                               # warm-up forward, graph dropped
        assert keep.stats.kept_calls == 1 and keep.stats.not_kept_calls == 1
        for m in (plain, kept):
            m(input_ids=ids, labels=ids).loss.backward()
        assert keep.stats.as_dict() == {"kept_calls": 1, "kept_bytes": keep.keep_bytes, "not_kept_calls": 1,
                                        "replayed_calls": 1, "recomputed_calls": 1, "rebuilt_tensors": 3,
                                        "unframed_calls": 0}
        ref = dict(plain.named_parameters())
        assert all(torch.equal(p.grad, ref[n].grad) for n, p in kept.named_parameters())
        unframed(input_ids=ids, labels=ids).loss.backward()
        assert keep.stats.unframed_calls == 4 and keep.stats.kept_calls == 1       # forward and recompute
        keep.remove()
        assert AttentionInterface().get(handle.name) is handle.attention_fn
    finally:
        handle.disable()


def test_keep_attention_refusals():
    """Refused by name: a non-handle, a bad budget, a handle not registered; a recompute that calls attention with
    other shapes or more often than the forward; a backward whose recompute never reached the attention call."""
    from torch.utils.checkpoint import checkpoint
    from transformers import AttentionInterface

    from seqpar.integrations import hf_selective

    with pytest.raises(TypeError, match="handle must be the Handle"):
        hf_selective.keep_attention("seqpar")
    handle = _sdpa_handle("seqpar_keep_refusals")
    try:
        for bad in (-1, True, 1.5):
            with pytest.raises(ValueError, match="keep_bytes must be a non-negative int"):
                hf_selective.keep_attention(handle, keep_bytes=bad)
        keep = hf_selective.keep_attention(handle)
        with pytest.raises(ValueError, match="must be active with its own attention function"):
            hf_selective.keep_attention(handle)                       # the keeper's wrapper is registered now
        attend = AttentionInterface().get(handle.name)
        module = torch.nn.Module()
        module.layer_idx = 7
        x = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
        length, calls = [8], [1]

        def layer(x):
            q = (x * 2)[:, :, :length[0]]
            for _ in range(calls[0]):
                out, _ = attend(module, q, q, q, None)
            return out.sin()                                          # saves a tensor: backward recomputes

        y = checkpoint(layer, x, **keep.checkpoint_kwargs())
        length[0] = 4
        with pytest.raises(RuntimeError, match=r"other inputs than the forward in layer 7.*float64\[1, 2, 4, 4\]"):
            y.sum().backward()
        length[0] = 8
        y = checkpoint(layer, x, **keep.checkpoint_kwargs())
        calls[0] = 2
        with pytest.raises(RuntimeError, match="called attention 2 times where its forward called it 1 times"):
            y.sum().backward()
        calls[0] = 1
        y = checkpoint(lambda x: attend(module, x * 2, x * 2, x * 2, None)[0], x, **keep.checkpoint_kwargs())
        with pytest.raises(RuntimeError, match=r"layer 7 .* was not recomputed before its backward"):
            y.sum().backward()                                        # nothing after attention: no recompute
        keep.remove()
    finally:
        handle.disable()


def test_tile_norms_of_a_multimodal_model_take_the_text_models_hidden_size():
    """Gemma 3 with a vision tower: its config's hidden size is the text config's; the per-head q/k norms and
    the multimodal projector's norm (the vision width) are left alone."""
    import transformers as tf

    cfg = tf.Gemma3Config(text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8),
                          vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14))
    model = tf.Gemma3ForConditionalGeneration(cfg)
    tiling = hf_memory.tile_norms(model)
    assert len(tiling.modules) == 2 * 4 + 1 and "model.language_model.norm" in tiling.modules
    assert all(n.startswith("model.language_model.") and "q_norm" not in n and "k_norm" not in n
               for n in tiling.modules)


def test_tiled_norms_save_no_fp32_copy_of_the_hidden_states():
    """Structural (Note [Tiled norms]): in a bf16 Llama decoder layer without checkpointing, the plain RMSNorms
    save fp32 (tokens, hidden) upcasts for backward; tiled, nothing of that size and dtype is saved, and the
    norms' saved bytes fall to their bf16 inputs."""
    plain = build("llama", "sdpa", dtype=torch.float32).to(torch.bfloat16)
    tiled = copy.deepcopy(plain)
    hf_memory.tile_norms(tiled, chunk_tokens=CHUNK)
    ids = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(6))

    def saved(model) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        out = []

        def pack(t):
            out.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids).logits.float().sum().backward()
        return out

    hidden = plain.config.hidden_size

    def fp32_rows(recs):
        return [s for d, s in recs if d == torch.float32 and s[-1] == hidden and 64 in s]

    assert len(fp32_rows(saved(plain))) >= 2 * 2 + 1            # an upcast per norm: two per layer and the final
    assert fp32_rows(saved(tiled)) == []
