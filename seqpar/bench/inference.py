"""Long-context inference benchmark: sharded prefill and decode against transformers' own SDPA path.

    torchrun --nproc-per-node 1 -m seqpar.bench.inference --preset small --contexts 32k,128k,1m --baseline \\
        --out benchmarks/results/inference-1gpu.jsonl
    torchrun --nproc-per-node 8 -m seqpar.bench.inference --preset small --contexts 128k,1m,4m --out ...
    python -m seqpar.bench.inference --report a.jsonl b.jsonl        # the README table from records
    torchrun --nproc-per-node 2 -m seqpar.bench.inference --device cpu --preset tiny --contexts 96,160 --baseline

What is timed (Note [What the inference benchmark measures]):
    prefill   every prompt token but the last through the decoder, sharded (``hf_generate.prefill``: the
              first chunk by ``seqpar.attention``), the cache filled in place; the same ``S - 1`` tokens
              through ``model.base_model`` with transformers' DynamicCache and "sdpa" on one GPU (baseline).
    decode    ``--new-tokens`` greedy steps after the prompt (the last prompt token first): decoder, LM head,
              argmax, next step, with no host read inside the loop; tokens/s = steps / time. seqpar: the
              eager step (host-planned kernel calls over the cache slice, one all-gather per layer) and, on
              CUDA, the static step captured once in a CUDA graph and replayed (``cache.kv.static_decode()``).
              Baseline: transformers' eager step with its DynamicCache.
    memory    KV bytes per rank (allocated and live) and the peak allocated memory of the slowest rank.
    generate  with ``--entry generate``: the public entry point instead of the engine, prefill as a user meets
              it - ``seqpar.integrations.huggingface.generate(model, ids, max_new_tokens=1)`` (argument checks,
              cache, sharded prefill, then ``model.generate`` on the last prompt token) against
              ``model.generate(ids, max_new_tokens=1)`` on one GPU, each warm (one untimed call first), the
              median of ``--repeats`` calls; the greedy token must agree.
Times are CUDA events (host clock on CPU), after a barrier, the slowest rank's. Prefill is timed once per
context after a warm-up prefill at the smallest context (a long prefill is seconds; repeats would be minutes).
Parallel efficiency at S on W GPUs is ``T_prefill(S, 1 GPU) / (W * T_prefill(S, W GPUs))``: ``--report``
computes it from the records of both runs; where one GPU cannot hold S, the 1-GPU time is extrapolated from
its largest context by the causal FLOP ratio (S^2) and marked so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "PRESETS",
    "BenchConfig",
    "ModelPreset",
    "build_model",
    "decode_eager",
    "decode_static",
    "main",
    "parse_tokens",
    "report",
]


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """A Llama-architecture model built from a config (random weights: timing does not need trained ones)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    """Compute dtype ("bfloat16" on GPU, "float32" for CPU checks)."""


PRESETS = {
    "small": ModelPreset(vocab=32000, hidden=1024, intermediate=2816, layers=4, heads=8, kv_heads=2, head_dim=128,
                         dtype="bfloat16"),
    "tiny": ModelPreset(vocab=256, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16,
                        dtype="float32"),
}
"""``small``: hidden 1024, 4 layers, GQA 8/2 heads of 128: 4 KiB of KV per token (1M tokens = 4 GiB), so a 1M
context fits one H100 next to its activations. ``tiny``: CPU runs that check the code paths."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One benchmark run (the CLI fields)."""

    preset: str = "small"
    contexts: tuple[int, ...] = (32768, 131072, 1048576)
    """Prompt lengths S (global tokens)."""
    new_tokens: int = 64
    """Decode steps timed per context."""
    method: str = "ring"
    layout: str | None = None
    """How the prompt is sharded and attended (``seqpar.attention``); None = the method's default layout."""
    prefill_chunk: int | None = None
    """Prefill at most this many tokens per forward (later chunks extend the cache: pass-KV or pass-Q)."""
    device: str = "cuda"
    baseline: bool = False
    """Also run transformers' SDPA path (1 rank only)."""
    graph: bool = True
    """Time the static decode step too: captured in a CUDA graph on CUDA, run eagerly on CPU."""
    check: bool = False
    """Compare seqpar's decoded tokens with the baseline's (CPU fp32: they must be equal)."""
    entry: str = "engine"
    """"engine": ``prefill`` and the decode loops (module docstring); "generate": the public ``generate`` against
    ``model.generate``, one new token (prefill as a user meets it)."""
    repeats: int = 5
    """Timed calls per path with ``entry="generate"`` (their median is the figure)."""
    warmup: bool = True
    """Before each timed prefill, one untimed prefill of the same length on a fresh cache (every path): a
    serving engine's steady state, not its first call (kernel plans, seqpar's planned call, allocator)."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if not self.contexts or any(s < 2 for s in self.contexts):
            raise ValueError(f"contexts must be lengths >= 2, got {self.contexts}")
        if self.new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1, got {self.new_tokens}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.entry not in ("engine", "generate"):
            raise ValueError(f"entry must be 'engine' or 'generate', got {self.entry!r}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.check and not self.baseline:
            raise ValueError("check=True compares with the baseline: pass baseline=True too")


def parse_tokens(text: str) -> int:
    """``"128k"`` -> 131072, ``"1m"`` -> 1048576, ``"96"`` -> 96."""
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def build_model(p: ModelPreset, device: torch.device, seed: int = 0):
    """The preset's ``LlamaForCausalLM`` with seeded random weights, in eval mode, "sdpa" attention."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.intermediate,
                      num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                      head_dim=p.head_dim, max_position_embeddings=1 << 23, tie_word_embeddings=False,
                      attention_dropout=0.0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=getattr(torch, p.dtype))
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its milliseconds on this rank (CUDA events or the host clock), after a barrier."""
    if dist.is_initialized():
        dist.barrier()
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def _slowest(x: float, device: torch.device) -> float:
    """The largest ``x`` over ranks."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def decode_eager(model, cache, first_BN: torch.Tensor, steps: int, start: int) -> torch.Tensor:
    """``steps`` greedy steps through ``model`` with ``cache`` from token ``first_BN (B, 1)`` at position ``start``.

    Works for seqpar's ``SeqparCache`` (inside ``hf_generate.serving``) and transformers' caches alike; no
    host read inside the loop. Returns the tokens ``(B, steps)`` (the prediction after each step).
    """
    from ..integrations.hf_generate import cache_kwargs

    kw = cache_kwargs(model.base_model, cache)
    tokens = []
    ids = first_BN
    with torch.no_grad():
        for i in range(steps):
            pos = torch.full((ids.shape[0], 1), start + i, dtype=torch.long, device=ids.device)
            h = model.base_model(input_ids=ids, position_ids=pos, use_cache=True, **kw)
            ids = model.lm_head(h.last_hidden_state[:, -1:]).argmax(-1)
            tokens.append(ids)
    return torch.cat(tokens, 1)


def decode_static(model, cache, first_BN: torch.Tensor, steps: int, graph: bool) -> tuple[torch.Tensor, float]:
    """``steps`` greedy steps through the static step (Note [Static decode step]); with ``graph``, two eager
    warm-up steps, then one step captured in a CUDA graph and replayed. Returns the tokens ``(B, steps)`` and
    the milliseconds of the timed steps (all of them without a graph; the replays with one)."""
    from ..integrations.hf_generate import cache_kwargs

    device = first_BN.device
    dec = cache.kv.static_decode()
    ids = first_BN.clone()
    out = torch.empty(first_BN.shape[0], steps, dtype=torch.long, device=device)
    slot = torch.zeros((), dtype=torch.long, device=device)

    kw = cache_kwargs(model.base_model, cache)

    def step() -> None:
        dec.begin()
        h = model.base_model(input_ids=ids, position_ids=dec.position_ids, use_cache=True, **kw)
        ids.copy_(model.lm_head(h.last_hidden_state[:, -1:]).argmax(-1))
        out.index_copy_(1, slot.view(1), ids)
        slot.add_(1)
        dec.end()

    with torch.no_grad():
        warm = 2 if graph else 0
        side = torch.cuda.Stream() if graph else None
        if side is not None:                     # warm-up on a side stream, as CUDA-graph capture wants
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(min(warm, steps)):
                step()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        if graph and steps > warm:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()                      # captured, not run
            _, ms = _timed(lambda: [dec.replay(g) for _ in range(steps - warm)], device)   # counted: no overrun
        else:
            _, ms = _timed(lambda: [step() for _ in range(steps - warm)], device)
    dec.close()
    return out, ms


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _memory(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _seqpar_context(model, cfg: BenchConfig, S: int, mesh: Any, device: torch.device, static: bool) -> dict:
    """Prefill S - 1 tokens sharded, then decode; one record."""
    from ..inference import ShardedKVCache
    from ..integrations.hf_generate import SeqparCache, prefill, serving

    ids = torch.randint(0, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)).to(device)
    kv = ShardedKVCache(layers=model.config.num_hidden_layers, batch=1, mesh=mesh,
                        max_len=S + cfg.new_tokens + 8 if static else None)
    cache = SeqparCache(kv)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if cfg.warmup:
        warm = SeqparCache(ShardedKVCache(layers=model.config.num_hidden_layers, batch=1, mesh=mesh))
        with serving(model, warm, method=cfg.method, layout=cfg.layout):
            prefill(model, warm, ids[:, :-1], method=cfg.method, layout=cfg.layout, chunk=cfg.prefill_chunk)
        del warm
        _empty_cache(device)
    with serving(model, cache, method=cfg.method, layout=cfg.layout):
        _, prefill_ms = _timed(lambda: prefill(model, cache, ids[:, :-1], method=cfg.method, layout=cfg.layout,
                                               chunk=cfg.prefill_chunk), device)
        peak_prefill = _memory(device)
        if static:
            toks, decode_ms = decode_static(model, cache, ids[:, -1:], cfg.new_tokens, graph=device.type == "cuda")
            timed_steps = cfg.new_tokens - (2 if device.type == "cuda" and cfg.new_tokens > 2 else 0)
        else:
            toks, decode_ms = _timed(lambda: decode_eager(model, cache, ids[:, -1:], cfg.new_tokens, S - 1), device)
            timed_steps = cfg.new_tokens
    mem = kv.memory()
    return {"kind": "seqpar", "decode": "graph" if static and device.type == "cuda" else ("static" if static
                                                                                         else "eager"),
            "context": S, "prefill_ms": _slowest(prefill_ms, device),
            "decode_tok_s": timed_steps / (_slowest(decode_ms, device) / 1e3),
            "kv_gib_rank": max(_gather_float(mem["allocated"] / 2**30, device)),
            "kv_live_gib_rank": max(_gather_float(mem["live"] / 2**30, device)),
            "peak_gib": _slowest(_memory(device), device), "peak_prefill_gib": _slowest(peak_prefill, device),
            "tokens": toks.tolist()}


def _generate_context(model, cfg: BenchConfig, S: int, mesh: Any, device: torch.device) -> dict:
    """Prefill through the public entry points (``entry="generate"``): seqpar's ``generate`` and, with the
    baseline, ``model.generate`` ("sdpa", one GPU), one greedy token each, warm, the median of ``cfg.repeats``
    calls of each, the two paths taking turns."""
    from ..integrations.hf_generate import generate

    ids = torch.randint(0, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)).to(device)
    paths = {"seqpar": lambda: generate(model, ids, mesh=mesh, method=cfg.method, layout=cfg.layout,
                                        prefill_chunk=cfg.prefill_chunk, max_new_tokens=1, do_sample=False)}
    if cfg.baseline:
        paths["transformers"] = lambda: model.generate(ids, max_new_tokens=1, do_sample=False)
    rec: dict[str, Any] = {"kind": "generate", "decode": "none", "context": S, "interleaved": True}
    if cfg.warmup:
        for fn in paths.values():
            fn()
        _empty_cache(device)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(cfg.repeats):           # the paths alternate: drift in clocks or host load falls on both
        for name, fn in paths.items():
            out, ms = _timed(fn, device)
            times[name].append(_slowest(ms, device))
            rec[f"{name}_token"] = int(out[0, -1])
    for name in paths:
        rec[f"{name}_ms"] = times[name]
        rec[f"{name}_median_ms"] = statistics.median(times[name])
    if cfg.baseline:
        rec["vs_baseline_prefill"] = rec["seqpar_median_ms"] / rec["transformers_median_ms"]
        rec["tokens_match"] = rec["seqpar_token"] == rec["transformers_token"]
    return rec


def _gather_float(x: float, device: torch.device) -> list[float]:
    if not dist.is_initialized():
        return [x]
    t = torch.tensor([x], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [float(p.item()) for p in parts]


def _baseline_context(model, cfg: BenchConfig, S: int, device: torch.device) -> dict:
    """transformers' SDPA path on one GPU: the same S - 1 prompt tokens, then the same decode loop."""
    from transformers import DynamicCache

    from ..integrations.hf_generate import cache_kwargs

    ids = torch.randint(0, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S)).to(device)
    if cfg.warmup:
        with torch.no_grad():
            model.base_model(input_ids=ids[:, :-1], use_cache=True,
                             **cache_kwargs(model.base_model, DynamicCache(config=model.config)))
        _empty_cache(device)
    cache = DynamicCache(config=model.config)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        _, prefill_ms = _timed(lambda: model.base_model(input_ids=ids[:, :-1], use_cache=True,
                                                        **cache_kwargs(model.base_model, cache)),
                               device)
        toks, decode_ms = _timed(lambda: decode_eager(model, cache, ids[:, -1:], cfg.new_tokens, S - 1), device)
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return {"kind": "transformers-sdpa", "decode": "eager", "context": S, "prefill_ms": prefill_ms,
            "decode_tok_s": cfg.new_tokens / (decode_ms / 1e3), "kv_gib_rank": kv / 2**30,
            "kv_live_gib_rank": kv / 2**30, "peak_gib": _memory(device), "tokens": toks.tolist()}


def _header(cfg: BenchConfig) -> dict:
    import transformers

    import seqpar

    dev = torch.cuda.get_device_name() if cfg.device == "cuda" else platform.processor() or platform.machine()
    gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30 \
        if cfg.device == "cuda" else 0.0
    return {"kind": "header", "host": platform.node(), "device": dev, "device_gib": gib, "world": dist.get_world_size(),
            "torch": torch.__version__, "transformers": transformers.__version__, "seqpar": seqpar.__version__,
            "cuda": torch.version.cuda, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "config": asdict(cfg), "preset": asdict(PRESETS[cfg.preset]),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _emit(record: dict, path: str | None, echo: bool) -> None:
    if dist.get_rank() != 0:
        return
    line = json.dumps(record)
    if echo:
        print(line if record["kind"] == "header" else json.dumps({k: v for k, v in record.items() if k != "tokens"}),
              flush=True)
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")


def run(cfg: BenchConfig, out: str | None = None, echo: bool = True) -> list[dict]:
    """Every context of ``cfg`` on this rank (torch.distributed initialised); the records (rank 0 writes them
    to ``out`` and, with ``echo``, prints them)."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    world = dist.get_world_size()
    if cfg.baseline and world != 1:
        raise ValueError(f"baseline=True compares with one GPU: run it with 1 rank, got {world}")
    mesh = None
    if cfg.method == "usp":
        from ..groups import make_mesh
        mesh = make_mesh(ulysses=min(world, 2), device_type=device.type)
    model = build_model(PRESETS[cfg.preset], device)
    records = [_header(cfg)]
    _emit(records[0], out, echo)
    if cfg.entry == "generate":
        for S in cfg.contexts:
            records.append(_generate_context(model, cfg, S, mesh, device))
            _emit(records[-1], out, echo)
        _check_tokens(cfg, records)
        return records
    warm = BenchConfig(**{**asdict(cfg), "new_tokens": 2})                        # warm-ups: kernels, allocator
    _seqpar_context(model, warm, min(cfg.contexts), mesh, device, static=False)
    if cfg.baseline:
        _baseline_context(model, warm, min(cfg.contexts), device)
    for S in cfg.contexts:
        modes = [False, True] if cfg.graph else [False]
        base = _baseline_context(model, cfg, S, device) if cfg.baseline else None
        for static in modes:
            rec = _seqpar_context(model, cfg, S, mesh, device, static)
            if base is not None:
                rec["vs_baseline_prefill"] = rec["prefill_ms"] / base["prefill_ms"]
                rec["vs_baseline_decode"] = base["decode_tok_s"] / rec["decode_tok_s"]
                rec["tokens_match"] = rec["tokens"] == base["tokens"]
            records.append(rec)
            _emit(rec, out, echo)
        if base is not None:
            records.append(base)
            _emit(base, out, echo)
    _check_tokens(cfg, records)
    return records


def _check_tokens(cfg: BenchConfig, records: list[dict]) -> None:
    if cfg.check:
        bad = [(r["context"], r["decode"]) for r in records if r.get("tokens_match") is False]
        if bad:
            raise AssertionError(f"seqpar's greedy tokens differ from transformers' at contexts {bad}")


def report(paths: list[str]) -> str:
    """A markdown table from benchmark records of any number of runs (1 GPU and W GPUs)."""
    rows, entry, device_gib = [], [], {}
    for path in paths:
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        world = 1
        for r in recs:
            if r["kind"] == "header":
                world = r["world"]
                device_gib[world] = r.get("device_gib", 0.0)
            elif r["kind"] == "generate":
                entry.append({**r, "world": world})
            else:
                rows.append({**r, "world": world})
    one = {r["context"]: r["prefill_ms"] for r in rows if r["world"] == 1 and r["kind"] == "seqpar"}
    lines = ["| GPUs | context | path | prefill s | vs transformers (prefill / decode time) | prefill efficiency "
             "| decode tok/s | decode latency vs 1 GPU | KV GiB/rank | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["kind"] != "seqpar", r["world"], r["context"], r["decode"])):
        eff, ref = "-", one.get(r["context"])
        if r["kind"] == "seqpar" and r["world"] > 1:
            if ref is None and one:
                top = max(one)
                ref, mark = one[top] * (r["context"] / top) ** 2, "*"
            else:
                mark = ""
            eff = f"{ref / (r['world'] * r['prefill_ms']):.3f}{mark}" if ref else "-"
        vs = f"{r['vs_baseline_prefill']:.3f} / {r['vs_baseline_decode']:.3f}" if "vs_baseline_prefill" in r else "-"
        same = [x for x in rows if x["world"] == 1 and x["kind"] == r["kind"] and x["context"] == r["context"]
                and x["decode"] == r["decode"]]
        vs1 = f"{same[0]['decode_tok_s'] / r['decode_tok_s']:.2f}x" if same and r["world"] > 1 else "-"
        lines.append(f"| {r['world']} | {_si(r['context'])} | {r['kind']} {r['decode']} | "
                     f"{r['prefill_ms'] / 1e3:.2f} | {vs} | {eff} | {r['decode_tok_s']:.0f} | {vs1} | "
                     f"{r['kv_gib_rank']:.2f} | {r['peak_gib']:.1f} |")
    return "\n".join(lines + _largest(rows, device_gib) + _entry_table(entry))


def _entry_table(entry: list[dict]) -> list[str]:
    """Prefill through the public entry points (``--entry generate`` records)."""
    if not entry:
        return []
    lines = ["", "| GPUs | context | seqpar generate ms (median) | model.generate ms (median) | ratio | same token |",
             "|---|---|---|---|---|---|"]
    for r in sorted(entry, key=lambda r: (r["world"], r["context"])):
        base = r.get("transformers_median_ms")
        theirs, ratio = ("-", "-") if base is None else (f"{base:.2f}", f"{r['vs_baseline_prefill']:.3f}x")
        lines.append(f"| {r['world']} | {_si(r['context'])} | {r['seqpar_median_ms']:.2f} | {theirs} | {ratio} | "
                     f"{r.get('tokens_match', '-')} |")
    return lines


def _largest(rows: list[dict], device_gib: dict[int, float]) -> list[str]:
    """Per GPU count, the largest context that fits, extrapolated linearly from the peak memory of its two
    largest measured contexts (seqpar, eager decode): an estimate, said to be one."""
    out = []
    for world in sorted(device_gib):
        pts = sorted((r["context"], r["peak_gib"]) for r in rows
                     if r["world"] == world and r["kind"] == "seqpar" and r["decode"] == "eager" and r["peak_gib"])
        if len(pts) < 2 or not device_gib[world]:
            continue
        (s1, m1), (s2, m2) = pts[-2], pts[-1]
        per_token = (m2 - m1) / (s2 - s1)
        if per_token > 0:
            top = s2 + (device_gib[world] - m2) / per_token
            out.append(f"- {world} GPU(s): about {_si(int(top) >> 20 << 20) if top >= 1 << 20 else int(top)} tokens "
                       f"fit (estimated: {per_token * 2**30 / 1024:.1f} KiB of peak memory per token beyond "
                       f"{_si(s2)}, {device_gib[world]:.0f} GiB per GPU)")
    return ["", *out] if out else []


def _si(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m seqpar.bench.inference", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--contexts", default="32k,128k,1m", help="comma-separated prompt lengths (k, m suffixes)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--method", default="ring")
    ap.add_argument("--layout", default=None)
    ap.add_argument("--prefill-chunk", default=None, type=parse_tokens)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--baseline", action="store_true", help="also time transformers' SDPA path (1 rank)")
    ap.add_argument("--no-graph", dest="graph", action="store_false", help="skip the static (CUDA-graph) decode")
    ap.add_argument("--check", action="store_true", help="seqpar's tokens must equal the baseline's")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="time each path's first prefill (cold) instead of a second one on a fresh cache")
    ap.add_argument("--entry", default="engine", choices=("engine", "generate"),
                    help="generate: time prefill through the public generate against model.generate")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per path with --entry generate")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--report", nargs="+", default=None, help="print the table of these record files and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return
    cfg = BenchConfig(preset=args.preset, contexts=tuple(parse_tokens(x) for x in args.contexts.split(",")),
                      new_tokens=args.new_tokens, method=args.method, layout=args.layout,
                      prefill_chunk=args.prefill_chunk, device=args.device, baseline=args.baseline,
                      graph=args.graph, check=args.check, warmup=args.warmup,
                      entry=args.entry, repeats=args.repeats)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:                 # plain `python -m`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        run(cfg, args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
