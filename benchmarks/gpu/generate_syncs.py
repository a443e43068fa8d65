"""Where one ``generate`` call syncs the GPU with the host: seqpar's against ``model.generate`` (one GPU).

    python benchmarks/gpu/generate_syncs.py --context 32k [--new-tokens 1]

The inference bench's ``small`` model; one warm call of each path, then one under
``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call, counted by the innermost frame of
seqpar or transformers that made it (with the frame below it). A sync after the prefill was queued waits for
all of it; whatever host work follows it runs on an idle GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import traceback
import warnings

import torch
import torch.distributed as dist

from seqpar.bench.inference import PRESETS, build_model, parse_tokens
from seqpar.integrations.huggingface import generate


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-1] if "/seqpar/" in f.filename or "/transformers/" in f.filename]
    inner = frames[-2:] if frames else []
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(inner))


def _syncs(fn) -> collections.Counter:
    sites: collections.Counter = collections.Counter()
    torch.cuda.synchronize()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites[_where()] += 1
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = show
    return sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="32k", type=parse_tokens)
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also each path's CUDA kernels (torch.profiler), most "
                    "time first: where a gap in GPU time comes from")
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model = build_model(PRESETS["small"], dev)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), device=dev)
    paths = {"seqpar generate": lambda: generate(model, ids, max_new_tokens=args.new_tokens, do_sample=False),
             "model.generate": lambda: model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)}
    for name, fn in paths.items():
        fn()
        sites = _syncs(fn)
        print(f"== {name}, {args.context} tokens, {args.new_tokens} new: {sum(sites.values())} syncs", flush=True)
        for site, n in sites.most_common():
            print(f"  {n:3d}  {site}", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            print(f"   {len(kernels)} kernels, {sum(e.device_time for e in kernels) / 1e3:.2f} ms of kernel time",
                  flush=True)
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=60),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
