"""What holds the GPU at the peak of a training step: the recipe's step under CUDA memory history, one GPU.

    python benchmarks/gpu/probe_train_memory.py --out DIR [--layers 4] [--seq-len 1M] [--world 8] [--fit-probe 4096]

Runs ``examples/train_long_context.py``'s ``train()`` in this process as rank 0 of ``--world`` on a fake group
(``--emulate``: Note [Rank 0 of W on one GPU] there), with the 8B recipe's options (tiled MLP, offload, warm-up, no
kept attention) on a Llama-3-8B shape with ``--layers`` decoder layers: a layer's backward working set per local
token is the same at 4 layers as at 32. CUDA's allocator history is recorded from before the model is built; the
trace is then replayed to find the moment of the step's peak allocation, and the blocks live at that moment are
written to DIR/peak.txt, grouped by the innermost frame of seqpar, transformers or the example that allocated
them, and listed largest first with their stacks. DIR/record.jsonl has the recipe's record with the peak and the
bytes per local token of each group.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
OURS = ("/seqpar/", "/transformers/", "train_long_context.py", "/torch/distributed/fsdp/", "/torch/utils/checkpoint")


def _example():
    spec = importlib.util.spec_from_file_location("train_long_context", ROOT / "examples" / "train_long_context.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _site(frames: list[dict]) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(o in name for o in OURS):
            short = name.split("/site-packages/")[-1].split("/work/main/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(torch internals)"


def _stack(frames: list[dict], n: int = 6) -> str:
    out = []
    for f in frames:
        name = f.get("filename", "")
        if "/site-packages/torch/" in name and not any(o in name for o in OURS):
            continue
        out.append(f"{name.split('/')[-1]}:{f.get('line')} {f.get('name')}")
        if len(out) == n:
            break
    return " <- ".join(out)


def peak_blocks(trace: list[dict]) -> tuple[int, int, dict[int, tuple[int, list[dict]]]]:
    """Replay one device's allocator trace: (the peak of live allocated bytes, the event index of that peak,
    the blocks live then: address -> (size, frames)). Frees count at ``free_requested`` (as memory_allocated)."""
    live: dict[int, tuple[int, list[dict]]] = {}
    total = peak = at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
            if total > peak:
                peak, at = total, i
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    live.clear()
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    return peak, at, live


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", default="1M")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--max-entries", type=int, default=2_000_000)
    ap.add_argument("--context", default="alloc", choices=("alloc", "all", "none"),
                    help="stacks recorded: at allocation, at allocation and free, or none (sizes only)")
    ap.add_argument("--fit-probe", type=int, default=0, help="a sliding window instead of causal attention")
    ap.add_argument("--tile-mlp", type=int, default=8192)
    ap.add_argument("--tile-norms", type=int, default=0, help="tokens per chunk of the tiled RMSNorms (0: plain)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ex = _example()
    p = ex.PRESETS["gpu-1m"]
    p = replace(p, model="llama3-8b", **ex.MODELS["llama3-8b"], **ex.MODEL_DEFAULTS["llama3-8b"])
    p = replace(p, layers=args.layers, seq_len=ex.tokens(args.seq_len), tile_mlp=args.tile_mlp,
                tile_norms=args.tile_norms, offload=True, warmup=True, steps=1, keep_attention=False,
                fit_probe=args.fit_probe)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.set_device(0)
    dist.init_process_group("fake", rank=0, world_size=args.world, store=FakeStore())
    ctx = None if args.context == "none" else args.context
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, context=ctx, stacks="python")
    try:
        records = ex.train(p, str(out / "run.jsonl"), emulated=True, json_path=str(out / "recipe.jsonl"))
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        dist.destroy_process_group()
    trace = snap["device_traces"][0]
    peak, at, live = peak_blocks(trace)
    local = p.seq_len // args.world
    by_site: dict[str, int] = collections.Counter()
    for size, frames in live.values():
        by_site[_site(frames)] += size
    lines = [f"preset: {p}", f"trace events: {len(trace)} (peak at event {at}), first action {trace[0]['action']}",
             f"replayed peak: {peak / 2**30:.3f} GiB; torch max_memory_allocated: "
             f"{torch.cuda.max_memory_allocated() / 2**30:.3f} GiB; local tokens {local}", "",
             "live at the peak, by the innermost seqpar / transformers / example / FSDP / checkpoint frame:",
             f"{'GiB':>8} {'KiB/tok':>8}  site"]
    for site, b in sorted(by_site.items(), key=lambda x: -x[1]):
        lines.append(f"{b / 2**30:8.3f} {b / local / 1024:8.2f}  {site}")
    lines += ["", "the 60 largest live blocks:"]
    for size, frames in sorted(live.values(), key=lambda x: -x[0])[:60]:
        lines.append(f"{size / 2**20:10.1f} MiB  {_stack(frames)}")
    (out / "peak.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:40]))
    rec = {"seq_len": p.seq_len, "world": args.world, "layers": p.layers, "local_tokens": local,
           "peak_gib": peak / 2**30, "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
           "kib_per_local_token": {s: b / local / 1024 for s, b in by_site.items()},
           "records": [r for r in records if "step" in r or "summary" in r]}
    with open(out / "record.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
