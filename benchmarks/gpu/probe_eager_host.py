"""Where an eager call's host time goes: torch.profiler over steady calls (rank 0 of W on a fake group, one GPU).

    python3 benchmarks/gpu/probe_eager_host.py [--method ulysses] [--kv-heads 32] [--world 8] [--graphs off]

Runs forward+backward calls back to back with ``graphs=`` as given; profiles three of them after four untimed ones
(the profiler's own start-up outside the window) and prints the host time per call and torch.profiler's table
by self CPU time, CUDA runtime calls included (a synchronising call or an allocation shows there); then the host
time of the forward and the backward apart, one call under CUDA's sync debug mode (a warning per synchronising
call) and a cProfile of 20 calls by own time (the Python functions the host spends its time in).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import back_to_back_ms, host_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="ulysses")
    ap.add_argument("--layout", default=None)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--graphs", choices=["auto", "on", "off"], default="off")
    args = ap.parse_args()
    W, dev = args.world, torch.device("cuda")
    dist.init_process_group("fake", rank=0, world_size=W, store=FakeStore())
    L = 16384 // W
    q, do = (torch.randn(1, L, 32, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, L, args.kv_heads, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]

    def call():
        out = seqpar.attention(*leaves, method=args.method, layout=args.layout, causal=True, check_ranks=False,
                               graphs=graphs)
        torch.autograd.grad(out, leaves, do)

    for _ in range(8):
        call()
    host, gpu = back_to_back_ms(call, torch.device("cuda"))
    print(f"{args.method} kv{args.kv_heads} graphs={args.graphs}: host {host:.3f} ms per call back to back, "
          f"{gpu:.3f} ms per call with the GPU", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=1, warmup=3, active=3)) as prof:
        for _ in range(7):
            call()
            prof.step()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70), flush=True)

    fwd_ms, bwd_ms = [], []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = seqpar.attention(*leaves, method=args.method, layout=args.layout, causal=True, check_ranks=False,
                               graphs=graphs)
        t1 = time.perf_counter()
        torch.autograd.grad(out, leaves, do)
        fwd_ms.append((t1 - t0) * 1e3)
        bwd_ms.append((time.perf_counter() - t1) * 1e3)
    print(f"host from an idle GPU, median of 20: forward {sorted(fwd_ms)[10]:.3f} ms, backward "
          f"{sorted(bwd_ms)[10]:.3f} ms", flush=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    call()
    torch.cuda.set_sync_debug_mode(0)
    host_profile(call, torch.device("cuda")).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
