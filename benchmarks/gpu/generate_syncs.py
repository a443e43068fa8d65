"""Where one ``generate`` call syncs the GPU with the host: seqpar's against ``model.generate`` (one GPU).

    python benchmarks/gpu/generate_syncs.py --context 32k [--new-tokens 1] [--profile] [--gaps]

The inference bench's ``small`` model; one warm call of each path, then one under
``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call, counted by the innermost frame of
seqpar or transformers that made it (with the frame below it). A sync after the prefill was queued waits for
all of it; whatever host work follows it runs on an idle GPU.

``--gaps`` records one call of each path with torch.profiler (Python stacks on) and lists where the GPU sat
idle inside the call: the call's span from its first host event to its last kernel, the idle time before the
first kernel, and each idle gap longer than ``--gap-us`` between kernels, with the host code that launched the
kernel ending the gap (the innermost seqpar/transformers frames) and any synchronizing runtime call that
overlapped it. A path can do less kernel work than another and still take longer: its gaps say why.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
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


_SYNCING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "cudaStreamWaitEvent")


def _frames_at(stack: list[dict], ts: float) -> str:
    """The innermost seqpar/transformers frames (two) among the Python events open at ``ts``."""
    open_ = [e for e in stack if e["ts"] <= ts <= e["ts"] + e.get("dur", 0)]
    ours = [e["name"] for e in sorted(open_, key=lambda e: e["ts"])
            if "seqpar/" in e["name"] or "transformers/" in e["name"]]
    return " <- ".join(n.split("/")[-1] for n in reversed(ours[-2:])) or "(no seqpar/transformers frame)"


def _gaps(fn, gap_us: float) -> None:
    """Profile one call of ``fn``; print the GPU's idle time inside it and the host code behind each gap."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        with record_function("the call"):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    launch = {e["args"].get("correlation"): e for e in runtime}
    stack = [e for e in events if e.get("cat") == "python_function"]
    start = next(e["ts"] for e in events if e["name"] == "the call")
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = sum(e["dur"] for e in kernels)
    print(f"   span {(end - start) / 1e3:.2f} ms from the call's start to its last kernel; {len(kernels)} kernels "
          f"and copies, {busy / 1e3:.2f} ms busy; idle before the first kernel {(kernels[0]['ts'] - start) / 1e3:.2f}"
          f" ms", flush=True)
    rows, idle, last_end = [], 0.0, kernels[0]["ts"]
    for k in kernels:
        gap = k["ts"] - last_end
        if gap > gap_us:
            idle += gap
            lz = launch.get(k["args"].get("correlation"))
            at = lz["ts"] if lz else k["ts"]
            syncs = sorted({e["name"] for e in runtime if e["name"].startswith(_SYNCING)
                            and e["ts"] < k["ts"] and e["ts"] + e["dur"] > last_end})
            rows.append((gap, (at - last_end) / 1e3, k["name"][:48], _frames_at(stack, at), ",".join(syncs),
                         last_end, at))
        last_end = max(last_end, k["ts"] + k["dur"])
    print(f"   {len(rows)} gaps over {gap_us:.0f} us between kernels, {idle / 1e3:.2f} ms idle in all; largest first "
          f"(gap ms, its launch ms after the GPU went idle, kernel, launched from, syncs overlapping it):", flush=True)
    for gap, late, name, where, syncs, _, _ in sorted(rows, reverse=True)[:25]:
        print(f"   {gap / 1e3:7.3f}  {late:7.3f}  {name:48s}  {where}  {syncs}", flush=True)
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime")]
    for gap, _, name, _, _, a, b in sorted(rows, reverse=True)[:3]:
        inside = sorted((e for e in host if e["ts"] >= a and e["ts"] + e["dur"] <= b and e["dur"] > 0.02 * (b - a)),
                        key=lambda e: -e["dur"])
        print(f"   host work inside the {gap / 1e3:.3f} ms gap before {name}: the longest events (ms)", flush=True)
        for e in inside[:12]:
            print(f"      {e['dur'] / 1e3:7.3f}  {e['name'][:110]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="32k", type=parse_tokens)
    ap.add_argument("--new-tokens", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="also each path's CUDA kernels (torch.profiler), most "
                    "time first: where a gap in GPU time comes from")
    ap.add_argument("--gaps", action="store_true", help="also the GPU's idle gaps inside one call of each path "
                    "and the host code behind each (torch.profiler with Python stacks)")
    ap.add_argument("--gap-us", type=float, default=30.0, help="--gaps lists idle gaps longer than this")
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
        if args.gaps:
            _gaps(fn, args.gap_us)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
