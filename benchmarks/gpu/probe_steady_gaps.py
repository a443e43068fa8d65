"""Where the GPU idles while calls run back to back: rank r of W on a fake group (one GPU, emulated), dense rows.

    python3 benchmarks/gpu/probe_steady_gaps.py --out FILE [--world 8] [--rank 1] [--seq 131072] [--kv-heads 8]
        [--configs tasp/zigzag,ring/zigzag] [--modes fwd,fwd+bwd] [--mask sink_window:4095,4] [--wide-rows 4096,2048]
        [--open-bands cudnn,band] [--stack on,off] [--runner bench --preset mask-block-causal-16k] [--keep-plans]

For each configuration and mode: the median ms of a call timed back to back (10 calls between two synchronizations,
after 8 warm-up calls), the GPU time of its operations (in all, and by name: ``ops_us_per_call``) and the GPU's
idle time per call from torch.profiler over 3 back-to-back calls, the largest idle gaps with the operations on either
side, the host's CUDA runtime calls per call (``api_us_per_call``: a synchronization that waits for the previous
call shows as a long one; the slowest four with the operations that made them), the synchronizations
``torch.cuda.set_sync_debug_mode`` reports during one call, and
(``seqpar.runtime``'s log) whether auto graphed each kind of call. One JSON line per case (``write_probe``); a
summary line per case on stdout. ``--mask`` runs every case non-causal under a named mask
(``python -m seqpar plan``'s ``NAME:INTS``). The allocator's pool is seeded as the bench seeds it
(Note [Emulated data]).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_host import case_fn

from seqpar.bench.presets import PRESETS, MethodSpec
from seqpar.bench.report import write_probe
from seqpar.bench.runners import ours_runner
from seqpar.bench.timing import free_cached, sync_warnings
from seqpar.kernels import base as kernels_base
from seqpar.kernels import executor, select
from seqpar.planner.cli import _mask
from seqpar.runtime import call as _call

_KIND = kernels_base.mask_kind


def gaps(fn, calls: int = 3) -> dict:
    """GPU op time and idle time per call over ``calls`` back-to-back calls, and the 8 largest gaps."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() > 0),
                 key=lambda ev: ev.time_range.start)
    busy, idle, found, end, before = 0.0, 0.0, [], None, ""
    for ev in evs:
        if end is not None and ev.time_range.start > end:
            gap = ev.time_range.start - end
            idle += gap
            found.append((round(gap, 1), before[:70], ev.name[:70]))
        busy += ev.time_range.elapsed_us()
        if end is None or ev.time_range.end > end:
            end, before = ev.time_range.end, ev.name
    found.sort(reverse=True)
    by_name: dict[str, list[float]] = {}
    for ev in evs:
        by_name.setdefault(ev.name[:90], []).append(ev.time_range.elapsed_us())
    ops = sorted(((round(sum(t) / calls, 1), round(len(t) / calls, 1), name) for name, t in by_name.items()),
                 reverse=True)
    api: dict[str, list[float]] = {}       # the host's CUDA runtime calls: a synchronization shows here
    slow = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("cu"):
            api.setdefault(ev.name[:60], []).append(ev.time_range.elapsed_us())
            if ev.name != "cudaDeviceSynchronize":
                chain, p = [], ev.cpu_parent
                while p is not None and len(chain) < 4:
                    chain.append(p.name[:40])
                    p = p.cpu_parent
                slow.append((round(ev.time_range.elapsed_us(), 1), ev.name[:40], " < ".join(chain)))
    api_calls = sorted(((round(sum(t) / calls, 1), round(len(t) / calls, 1), name) for name, t in api.items()),
                       reverse=True)
    return {"gpu_op_ms_per_call": round(busy / calls / 1e3, 3), "idle_ms_per_call": round(idle / calls / 1e3, 3),
            "ops_per_call": len(evs) / calls, "largest_gaps_us": found[:8], "ops_us_per_call": ops[:14],
            "api_us_per_call": api_calls[:10], "slowest_api_calls": sorted(slow, reverse=True)[:4]}


def syncs(fn) -> list[str]:
    """The synchronizations one call makes, as ``set_sync_debug_mode("warn")`` reports them."""
    return [m[:160] for m in sync_warnings(fn)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--configs", default="tasp/zigzag,ring/zigzag")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--mask", type=_mask, default=None, help="a named mask, NAME:INTS (non-causal under it)")
    ap.add_argument("--open-bands", default="cudnn",
                    help="cudnn (bands open to the right read backwards: Note [Open bands backwards]), band (as "
                         "windows, the kernels before it) or both, comma-separated: each case runs under each")
    ap.add_argument("--stack", default="on",
                    help="on (equal blocks in a row as one batched call: Note [Equal blocks as a batch]) or off "
                         "(one call per block, the runner before it), comma-separated, repeats allowed: each case "
                         "under each")
    ap.add_argument("--runner", default="probe", choices=("probe", "bench"),
                    help="probe: shards of a full random tensor (probe_host.case_fn); bench: the bench's own runner "
                         "(seqpar.bench.runners.ours_runner on the --preset)")
    ap.add_argument("--keep-plans", action="store_true",
                    help="keep the earlier cases' planned calls cached (and their graphs), as the bench does")
    ap.add_argument("--preset", default=None, help="with --runner bench: the bench preset (its mask, shape)")
    ap.add_argument("--wide-rows", default=str(executor.WIDE_ROWS),
                    help="executor.WIDE_ROWS values, comma-separated: each case runs under each (Note [Bands on flex])")
    args = ap.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("seqpar.runtime").setLevel(logging.INFO)      # each call kind's graph decision, printed
    W, rows = args.world, []
    dist.init_process_group("fake", rank=args.rank, world_size=W, store=FakeStore())
    cases = [(st, o, int(w), c, m) for st in args.stack.split(",") for o in args.open_bands.split(",")
             for w in args.wide_rows.split(",") for c in args.configs.split(",") for m in args.modes.split(",")]
    stack = executor.stacked
    for st, open_bands, wide, config, mode in cases:
        executor.WIDE_ROWS = wide
        executor.stacked = stack if st == "on" else (lambda tasks: tasks)
        kind = _KIND if open_bands == "cudnn" else (lambda m: "band" if _KIND(m) == "open" else _KIND(m))
        kernels_base.mask_kind = executor.mask_kind = kind
        if not args.keep_plans:
            select.cache_clear()
            _call.cache_clear()
        method, layout = config.split("/")
        if args.runner == "bench":
            free_cached(torch.device("cuda"), seed=True)
            fn = ours_runner(MethodSpec(method, layout), PRESETS[args.preset], torch.device("cuda"),
                             check_ranks=False)[mode]
        else:
            fn = case_fn(method, layout, mode, args.seq, None, W, None, args.kv_heads, args.mask)
        for _ in range(8):
            fn()
        torch.cuda.synchronize()
        steady = []
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            steady.append((time.perf_counter() - t0) * 1e2)
        row = {"config": config, "mode": mode, "mask": repr(args.mask), "runner": args.runner, "preset": args.preset,
               "world": W, "rank": args.rank,
               "seq_len": args.seq, "wide_rows": wide, "open_bands": open_bands, "stack": st,
               "kv_heads": args.kv_heads, "steady_ms": round(sorted(steady)[1], 3), **gaps(fn),
               "syncs": syncs(fn)}
        rows.append(row)
        keys = ("stack", "open_bands", "wide_rows", "config", "mode", "steady_ms", "gpu_op_ms_per_call",
                "idle_ms_per_call")
        print({k: row[k] for k in keys},
              row["largest_gaps_us"][:4], len(row["syncs"]), row["syncs"][:2], flush=True)
        for op in row["ops_us_per_call"]:
            print("    op us/call, count/call:", op, flush=True)
        for op in row["api_us_per_call"]:
            print("    host CUDA API us/call, count/call:", op, flush=True)
        for op in row["slowest_api_calls"]:
            print("    slowest CUDA API call (us, name, its callers):", op, flush=True)
        del fn
        torch.cuda.empty_cache()
    write_probe(args.out, rows)


if __name__ == "__main__":
    main()
