"""Where a one-GPU prefill spends its time: seqpar's sharded prefill against transformers' SDPA path.

    torchrun --nproc-per-node 1 benchmarks/gpu/profile_prefill.py --context 32k

Both paths prefill the same prompt with the ``small`` inference preset, warm (one untimed prefill first),
under ``torch.profiler``; prints each path's time, its top CUDA kernels and its top host operators, so a gap
between the two shows where it comes from. As in the inference bench, the cache is built before the timed
prefill. ``--trace DIR`` also writes each path's Chrome trace and prints the GPU's idle gaps (the host
operator running while the GPU waited), which is where wall time goes that no kernel accounts for.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from seqpar.bench.inference import PRESETS, build_model, parse_tokens
from seqpar.inference import ShardedKVCache
from seqpar.integrations.hf_generate import SeqparCache, cache_kwargs, prefill, serving


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="32k", type=parse_tokens)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--trace", default=None, help="a directory for Chrome traces and the idle-gap report")
    ap.add_argument("--syncs", action="store_true", help="list the host-device syncs of one seqpar prefill")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = build_model(PRESETS["small"], dev)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context - 1), device=dev)

    def ours():
        cache = SeqparCache(ShardedKVCache(layers=model.config.num_hidden_layers, batch=1))

        def run():
            with serving(model, cache, method="ring"):
                prefill(model, cache, ids, method="ring")
        return run

    def theirs():
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)

        def run():
            with torch.no_grad():
                model.base_model(input_ids=ids, use_cache=True, **cache_kwargs(model.base_model, cache))
        return run

    if args.syncs:
        syncs(ours())
    for name, make in (("transformers", theirs), ("seqpar", ours)):
        make()()
        torch.cuda.synchronize()
        fn = make()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        fn = make()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"== {name}: {start.elapsed_time(end):.2f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        if args.trace:
            path = os.path.join(args.trace, f"prefill_{name}.json")
            prof.export_chrome_trace(path)
            gaps(path)
    dist.destroy_process_group()


def syncs(fn) -> None:
    """Run ``fn`` with CUDA sync debugging on and print where each synchronizing call came from (our frames)."""
    import traceback
    import warnings

    seen: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-2] if "seqpar" in f.filename or "transformers" in f.filename]
        where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1][:4])
        seen[where] = seen.get(where, 0) + 1
    show = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = show
    print(f"-- {sum(seen.values())} synchronizing calls in one seqpar prefill")
    for where, n in sorted(seen.items(), key=lambda x: -x[1]):
        print(f"   {n:4d}x  {where}")


def gaps(path: str, least_us: float = 20.0) -> None:
    """Print the GPU's idle gaps of at least ``least_us`` between its first and last kernel, with the host
    operators that were running when each gap began."""
    events = json.load(open(path))["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    idle, busy_to = [], gpu[0][1]
    for a, b in gpu[1:]:
        if a - busy_to >= least_us:
            idle.append((busy_to, a))
        busy_to = max(busy_to, b)
    total, span = sum(b - a for a, b in idle), busy_to - gpu[0][0]
    lead = gpu[0][0] - min(e["ts"] for e in host)
    print(f"-- host lead before the first kernel {lead / 1e3:.2f} ms; GPU idle: {len(idle)} gaps >= "
          f"{least_us:.0f} us, {total / 1e3:.2f} ms of {span / 1e3:.2f}")
    for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:15]:
        ops = sorted((e for e in host if e["ts"] <= a <= e["ts"] + e.get("dur", 0)), key=lambda e: -e.get("dur", 0))
        print(f"   {b - a:8.1f} us  during: {' > '.join(e['name'] for e in ops[:4])}")


if __name__ == "__main__":
    main()
