"""Where a call's host time goes: rank r of W on a fake group, one GPU (emulated, communication free).

    python3 benchmarks/gpu/probe_host.py --out DIR [--world 8] [--rank 0] [--cases packed32,packed128,dense16]
        [--graphs off] [--kv-heads 32] [--dense-methods M/L,..] [--packed-methods M/L,..] [--mask NAME:INTS]

For each case (method/layout x mode): the host milliseconds of one call from an idle GPU (median of 10), the call's
total time, the GPU operations it launches (name, microseconds and the idle time before each, from
torch.profiler), and cProfile's top functions by own time and by cumulative time over 20 calls: all in
DIR/host.txt, with a summary line per case on stdout. The packed rows are the bench's (``seqpar.layouts.packing``,
seed 7, documents rounded to 2W). The allocator's pool is seeded with random data before each case, as the bench
seeds it (Note [Emulated data]).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import free_cached, host_profile
from seqpar.layouts.packing import packed_row
from seqpar.planner.cli import _mask

H, D = 32, 128


def case_fn(method: str, layout: str, mode: str, total: int, cu: tuple[int, ...] | None, W: int,
            graphs: bool | None = None, HKV: int = 8, mask=None):
    """One call of ``seqpar.attention`` (causal; under ``mask``, non-causal with the named mask) on this rank's
    shard of random rows."""
    dev = torch.device("cuda")
    where = {"method": method, "layout": layout}
    if mask is not None:
        where |= {"mask_mod": mask, "causal": False}
    if cu is not None:
        where["cu_seqlens"] = cu
    free_cached(dev, seed=True)       # received buffers hold data, not zeros (Note [Emulated data])
    full = [torch.randn(1, total, h, D, device=dev, dtype=torch.bfloat16) for h in (H, HKV, HKV, H)]
    q, k, v, do = (seqpar.shard(t, **where) for t in full)
    del full
    kw = dict(where, check_ranks=False, graphs=graphs)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return seqpar.attention(q, k, v, **kw)
        return fn
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(seqpar.attention(*leaves, **kw), leaves, do)


def probe(name: str, fn, out: Path) -> str:
    for _ in range(7):                  # auto graphs decide at the seventh call (Note [Which calls graph])
        fn()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        total.append((time.perf_counter() - t0) * 1e3)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = sorted((ev for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() > 0),
                 key=lambda ev: ev.time_range.start)
    ops, end = [], None                 # (name, us, idle us before it: from the latest end of the ops before)
    for ev in evs:
        gap = 0.0 if end is None else max(0.0, ev.time_range.start - end)
        ops.append((ev.name, ev.time_range.elapsed_us(), gap))
        end = ev.time_range.end if end is None else max(end, ev.time_range.end)
    buf = io.StringIO()
    st = host_profile(fn, torch.device("cuda"))
    st.stream = buf
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumtime").print_stats(45)
    line = (f"{name}: host {statistics.median(host):.3f} ms, call {statistics.median(total):.3f} ms, "
            f"{len(ops)} GPU ops, {sum(u for _, u, _ in ops) / 1e3:.3f} ms of GPU op time, "
            f"{sum(g for _, _, g in ops) / 1e3:.3f} ms idle between them")
    with (out / "host.txt").open("a") as f:
        listing = "\n".join(f"  {u:8.1f} us  after {g:7.1f} us idle  {n[:130]}" for n, u, g in ops)
        f.write(f"\n{'=' * 100}\n" + line + "\n\nGPU ops:\n" + listing)
        f.write("\n\ncProfile, 20 calls:\n" + buf.getvalue())
        f.write("\n\nprofiler CPU table:\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0, help="the rank of W to run (TASP's slowest is 1 at W = 8 and 4)")
    ap.add_argument("--cases", default="packed32,packed128,dense16")
    ap.add_argument("--graphs", choices=["auto", "on", "off"], default="auto", help="seqpar.attention's graphs=")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads of the 32 query heads (32: MHA)")
    ap.add_argument("--dense-methods", default="ring/zigzag,ulysses/contiguous",
                    help="method/layout pairs of the dense cases")
    ap.add_argument("--mask", type=_mask, default=None,
                    help="a named mask, NAME:INTS (python -m seqpar plan's): the dense cases run non-causal under it")
    ap.add_argument("--packed-methods", default="ulysses/contiguous,ring/zigzag,ring/balanced,allgather/balanced",
                    help="method/layout pairs of the packed cases")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    W = args.world
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    dist.init_process_group("fake", rank=args.rank, world_size=W, store=FakeStore())
    for case in args.cases.split(","):
        if case.startswith("packed"):
            total = int(case[6:]) * 1024
            cu = packed_row(total, "lognormal", seed=7, multiple=2 * W)
            configs = [tuple(c.split("/")) for c in args.packed_methods.split(",")]
        else:
            total, cu = int(case[5:]) * 1024, None
            configs = [tuple(c.split("/")) for c in args.dense_methods.split(",")]
        for method, layout in configs:
            for mode in ("fwd", "fwd+bwd"):
                name = f"{case}-kv{args.kv_heads}-r{args.rank}-{method}-{layout}-{mode}-graphs_{args.graphs}"
                try:
                    fn = case_fn(method, layout, mode, total, cu, W, graphs, args.kv_heads,
                                 None if cu else args.mask)
                    print(probe(name, fn, out), flush=True)
                except Exception as e:          # a probe: report and go on
                    print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
