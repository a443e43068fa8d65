"""Why the first emulated configuration of a process runs slow: one call's bursts over time, before and after a
backward, on a fake group (rank 1 of 4, GQA 32/8, 16K tokens, TASP zigzag, graphs auto).

    python3 benchmarks/gpu/probe_first_config.py [--seed] [--method tasp] [--layout zigzag]

Prints the milliseconds per call of each burst of 10 back-to-back calls (``seqpar.bench.timing.burst_ms``; the
committed output came from an equivalent local timer: CUDA events around the 10 calls).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import burst_ms, free_cached


def burst(fn) -> float:
    """Milliseconds per call of 10 back-to-back calls (one burst, no warm-up)."""
    return burst_ms({"call": fn}, torch.device("cuda"), burst=10, rounds=1, warmup=0)["call"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", action="store_true", help="seed the allocator's pool first, as the bench does")
    ap.add_argument("--method", default="tasp")
    ap.add_argument("--layout", default="zigzag")
    args = ap.parse_args()
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    dev = torch.device("cuda")
    if args.seed:
        free_cached(dev, seed=True)
    full = [torch.randn(1, 16384, h, 128, device=dev, dtype=torch.bfloat16) for h in (32, 8, 8, 32)]
    where = {"method": args.method, "layout": args.layout}
    q, k, v, do = (seqpar.shard(t, **where) for t in full)

    def fwd():
        with torch.no_grad():
            return seqpar.attention(q, k, v, **where, check_ranks=False)

    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))

    def fb():
        return torch.autograd.grad(seqpar.attention(*leaves, **where, check_ranks=False), leaves, do)

    t0 = time.perf_counter()
    for _ in range(8):
        fwd()
    for i in range(12):
        print(f"{time.perf_counter() - t0:6.2f}s fwd burst {i}: {burst(fwd):.3f} ms/call", flush=True)
    time.sleep(1.0)
    print(f"{time.perf_counter() - t0:6.2f}s after 1 s idle: fwd {burst(fwd):.3f} ms/call", flush=True)
    for _ in range(8):
        fb()
    print(f"{time.perf_counter() - t0:6.2f}s fwd+bwd {burst(fb):.3f} ms/call", flush=True)
    for i in range(4):
        print(f"{time.perf_counter() - t0:6.2f}s fwd again {i}: {burst(fwd):.3f} ms/call", flush=True)


if __name__ == "__main__":
    main()
