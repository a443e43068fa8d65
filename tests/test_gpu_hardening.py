"""On one GPU (``python -m pytest -m gpu tests/test_gpu_hardening.py``): the hardening probes only a GPU can make.

* A compiled HF training step on a packed batch whose ``cu_seq_lens`` live on the GPU syncs the device with the
  host the same number of times with 2 layers and with 4 (none per layer, in either direction): counted with
  ``torch.cuda.set_sync_debug_mode("warn")`` (aot_eager and inductor), the buffers refilled in place between
  steps; at most one more than the same step with host boundaries (the one read per batch).
* The static decode step, captured in a real CUDA graph, refuses the replay past its buffer before the graph
  writes anything: the error names the bound, the cache is untouched, and the CUDA context is healthy after.
* Planned calls from 8 threads at once on CUDA (distinct signatures, a plan cache cut to 4 entries) equal the
  one-thread results (within bf16 noise), with no error and no hang.
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

import seqpar
from seqpar.bench.timing import sync_warnings
from seqpar.runtime import call

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("nccl_group")]

pytest.importorskip("transformers")


def _syncs(fn) -> int:
    """How many synchronizing CUDA calls ``fn()`` makes (sync debug mode "warn" warns once per call)."""
    return sum("synchronizing" in m for m in sync_warnings(fn))


def _packed_steps(layers: int, backend: str, host_cu: bool) -> list[int]:
    """Syncs per step of a compiled packed step: 6 batches refilled into one set of buffers, the last 4 counted
    (the first two compile; on the GPU dynamo recompiled once at the second step with aot_eager)."""
    from _workers_hf import build, global_batch, refill

    from seqpar.integrations import huggingface as sp_hf

    handle = sp_hf.enable(None, method="ring", name=f"seqpar_syncs_{layers}_{backend}_{host_cu}")
    try:
        model = build("llama", handle.name, num_hidden_layers=layers).cuda()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        counts, buffers = [], None
        cus = [(0, 5, 19, 32), (0, 7, 21, 32), (0, 9, 25, 32), (0, 9, 25, 32), (0, 13, 14, 32), (0, 3, 30, 32)]
        for i, cu in enumerate(cus):
            local = handle.shard_batch(global_batch({"docs": "cu", "cu": cu, "data_seed": cu[1]}))
            local = {k: v.to("cuda") if isinstance(v, torch.Tensor) and not (host_cu and k.startswith("cu_"))
                     else v for k, v in local.items()}
            buffers = refill(buffers, local)
            n = _syncs(lambda b=buffers: compiled(**b).loss.backward())
            if i >= 2:                                  # the first two steps compile (and may recompile once)
                counts.append(n)
        return counts
    finally:
        handle.disable()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_packed_step_syncs_once_per_batch_not_per_layer(backend):
    two, four = _packed_steps(2, backend, host_cu=False), _packed_steps(4, backend, host_cu=False)
    print(f"\nsyncs per step, {backend}, device cu_seq_lens: 2 layers {two}, 4 layers {four}")
    assert two == four, f"syncs grow with the layers: 2 layers {two}, 4 layers {four}"
    host = _packed_steps(4, backend, host_cu=True)
    print(f"syncs per step, {backend}, host cu_seq_lens: 4 layers {host}")
    assert all(d - h <= 1 for d, h in zip(four, host)), f"more than one boundary read per batch: {four} vs {host}"


def test_static_decode_refuses_the_replay_past_its_buffer_on_gpu():
    from seqpar.bench.inference import PRESETS, build_model, decode_static
    from seqpar.inference import ShardedKVCache
    from seqpar.integrations.hf_generate import SeqparCache, prefill, serving

    dev = torch.device("cuda", torch.cuda.current_device())
    model = build_model(PRESETS["tiny"], dev)
    P, room = 24, 6
    ids = torch.randint(0, model.config.vocab_size, (1, P + 1), device=dev)
    cache = SeqparCache(ShardedKVCache(layers=model.config.num_hidden_layers, batch=1, max_len=P + room, spare_rows=0))
    with serving(model, cache):
        prefill(model, cache, ids[:, :-1])
        before = [t.clone() for lay in cache.kv.layers for t in (lay.k, lay.v)]
        with pytest.raises(RuntimeError, match=r"buffer|max_len|steps") as err:
            decode_static(model, cache, ids[:, -1:], room + 10, graph=True)
    print(f"\nstatic decode past its buffer: {err.value}")
    torch.cuda.synchronize()                                  # the context is healthy
    after = [t for lay in cache.kv.layers for t in (lay.k, lay.v)]
    written = [int((a != b).any(-1).any(-1).sum()) for a, b in zip(after, before)]
    assert all(n <= room for n in written), f"rows written past the buffer's steps: {written}"
    x = torch.arange(1024, device=dev, dtype=torch.float32)
    assert float(x.sum()) == 1023 * 1024 / 2


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within bf16 noise (atomics in backward kernels are not bitwise): a plan mixed up between signatures is
    off by O(1)."""
    return a.shape == b.shape and float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) < 2e-2


def test_planned_calls_from_eight_threads_on_gpu():
    dev = torch.device("cuda", torch.cuda.current_device())

    def run(t: int, i: int) -> list[torch.Tensor]:
        g = torch.Generator(device=dev).manual_seed(1000 * t + i)
        L, H = 64 + 16 * t, 1 + t % 3
        q, k, v = (torch.randn(1, L, H, 64, generator=g, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        kw = {"cu_seqlens": (0, 17 + i, L)} if i % 4 == 3 else {"softmax_scale": (0.1, 0.12, 0.14)[i % 3]}
        out = seqpar.attention(q, k, v, causal=t % 2 == 0, **kw)
        out.float().square().sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    expected = {(t, i): run(t, i) for t in range(8) for i in range(12)}
    errors, mismatched = [], []

    def work(t: int) -> None:
        try:
            for i in range(12):
                got = run(t, i)
                if not all(_close(a, b) for a, b in zip(got, expected[(t, i)])):
                    mismatched.append((t, i))
        except Exception:  # reported below
            errors.append(traceback.format_exc())

    sizes = call.CACHE_SIZE, call.BATCH_CACHE_SIZE
    call.CACHE_SIZE, call.BATCH_CACHE_SIZE = 4, 2
    try:
        pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(8)]
        for th in pool:
            th.start()
        for th in pool:
            th.join(120)
        hung = sum(th.is_alive() for th in pool)
    finally:
        call.CACHE_SIZE, call.BATCH_CACHE_SIZE = sizes
    assert hung == 0 and not errors, (hung, "\n".join(errors))
    assert not mismatched, mismatched
