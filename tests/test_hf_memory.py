"""``seqpar.integrations.hf_memory``: the tiled MLP and activation offload change no value.

A tiny Llama (random weights, config in code, activation checkpointing on) trained twice from one seed: plain,
and with ``tile_mlp`` (16-token chunks) plus ``ActivationOffload`` around the forward. At W = 1 in this process,
at W = 2 (ring, zigzag) and W = 4 (USP 2 x 2) on gloo workers. Expected, in fp64 and fp32 (Note [Tiled MLP]):
- the loss, and every gradient that does not sum over the MLP's chunks, bitwise equal (a row-chunked matmul
  is row-independent on CPU when the chunk is a multiple of its 8-row block: the test uses 16);
- the MLP weights' gradients, a sum split into one partial per chunk, within 1e-12 (fp64) / 1e-5 (fp32)
  normalised error; the second step's loss and gradients and the parameters after it the same way (AdamW in
  fp64, SGD with momentum in fp32).
On CPU the offload hooks pass tensors through (there is no device memory to spare): the test checks that the
checkpointed layer inputs reach them, and that the values are unchanged.
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
    return ".mlp." in name


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


def _judge(errors: dict[str, float], dtype: torch.dtype, label: str) -> None:
    """First step: the loss and every gradient but the MLP weights' bitwise, those within MLP_TOL. Later steps
    and the parameters: within MLP_TOL (the first step's last-bit differences propagate)."""
    def limit(key: str) -> float:
        return MLP_TOL[dtype] if not (key == "loss0" or key.startswith("grad0:")) or _is_mlp_weight(key) else 0.0

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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_process_equals_plain_step(dtype):
    """W = 1, batch 2 x 40 tokens (80 rows: five 16-row chunks), checkpointing, two optimizer steps."""
    plain, tiled = _pair("llama", dtype)
    tiling = hf_memory.tile_mlp(tiled, chunk_tokens=CHUNK)
    assert sorted(tiling.modules) == ["model.layers.0.mlp", "model.layers.1.mlp"]
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

    _judge(_step_pair(plain, tiled, run_plain, run_tiled), dtype, f"W=1 {dtype}")
    layer_input = 2 * 40 * 32 * torch.finfo(dtype).bits // 8
    assert offload.stats.offloaded_bytes == 0                     # CPU: everything passes through
    assert offload.stats.kept_bytes >= 2 * layer_input            # ... but the checkpointed inputs reached it


def test_chunks_that_do_not_divide_and_no_grad():
    """A 7-token chunk (the matmul's row blocks differ: equal within fp64 rounding, not bitwise), an inference
    forward (no graph: chunks only), and ``remove()`` restoring the module's own forward."""
    plain, tiled = _pair("llama", torch.float64)
    tiling = hf_memory.tile_mlp(tiled, chunk_tokens=7)
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
    assert "forward" not in tiled.model.layers[0].mlp.__dict__
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
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))

    def run(m):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    _judge(_step_pair(plain, tiled, run, run, steps=1), torch.float64, family)


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
    with pytest.raises(ValueError, match="keep_bytes must be a non-negative int"):
        hf_memory.ActivationOffload(keep_bytes=-1)
    offload = hf_memory.ActivationOffload()
    with offload, pytest.raises(RuntimeError, match="already active"):
        offload.__enter__()


# --------------------------------------------------------------------------------------------------------------
# W = 2 and 4 (gloo workers)


def sequence_parallel_pair(spec: dict) -> dict[str, float]:
    """Worker: the seqpar model plain and with tile_mlp + offload on this rank's ``shard_batch`` share,
    gradients all-reduced (test_hf.py checks the plain one against one process)."""
    dtype = getattr(torch, spec["dtype"])
    mesh = make_mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout="zigzag", name=f"seqpar_mem_{spec['method']}")
    try:
        plain, tiled = _pair("llama", dtype, handle.name)
        hf_memory.tile_mlp(tiled, chunk_tokens=CHUNK)
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
        _judge(errors, getattr(torch, dtype), f"W={world} {spec['method']} {dtype} rank {rank}")
        assert kept > 0


def test_pinned_pool_budget_reuse_and_eviction(monkeypatch):
    """The host side of the offload without a GPU (pinning stubbed): sizes round up to whole pages, a freed
    buffer serves the next request of its size, a request past the budget evicts free buffers first and is
    refused (None: the tensor stays on the GPU) when even that is not enough."""
    page = hf_memory.PAGE
    monkeypatch.setattr(hf_memory, "_pin", lambda size: hf_memory._Pinned(torch.empty(size, dtype=torch.uint8),
                                                                         size, False))
    pool = hf_memory._PinnedPool()
    pool.budget = 4 * page
    a = pool.take(1)
    assert a.size == page and pool.held == page
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
