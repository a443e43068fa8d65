"""Do 200 distinct 1M-token packed batches leave GPU and host memory flat? (issue 24, "Memory")

    python benchmarks/gpu/probe_packed_batches.py --out DIR [--batches 200 --tokens 1M --world 4 --calls 1]

Rank 0 of ``--world`` on one GPU with torch's fake process group (communication free; the rank's own plans,
schedules, index tensors, block masks and kernels are real). Every batch is a new lognormal packed row of
``--tokens`` global tokens (the packed bench's distribution: about 500 documents per 1M tokens, so a new
``cu_seqlens`` and a new plan each time), GQA 8/2, D 128, bf16, causal, forward and backward through
``seqpar.attention`` for each method that takes documents. After each batch (outputs and gradients dropped) it
records the GPU's allocated and reserved bytes, the process's resident memory and the plan cache's account;
``DIR/packed_batches.jsonl`` holds every sample and a summary line: the growth between batch ``--settle`` and the
last, which must be within ``--slack-mib`` (GPU allocated) and ``--slack-rss-mib`` (host) for ``"flat": true``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.inference import parse_tokens
from seqpar.layouts.packing import packed_row
from seqpar.runtime import call

METHODS = {"ring": "balanced", "allgather": "balanced", "ulysses": "contiguous"}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--tokens", type=parse_tokens, default=1 << 20)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--settle", type=int, default=20, help="the batch the growth is measured from")
    ap.add_argument("--slack-mib", type=float, default=64.0)
    ap.add_argument("--slack-rss-mib", type=float, default=256.0)
    ap.add_argument("--calls", type=int, default=1,
                    help="forward+backward calls per batch and method (a step's layers): from 2 on, short chunks "
                         "capture and replay CUDA graphs (Note [Graphed batches])")
    args = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=args.world, store=FakeStore())
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "packed_batches.jsonl")
    methods = args.methods.split(",")
    S, W, H, Hkv, D = args.tokens, args.world, 8, 2, 128
    L = S // W
    header = {"kind": "header", "host": platform.node(), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "seqpar": seqpar.__version__, "emulated_world": W, "tokens": S,
              "methods": methods, "calls": args.calls,
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    samples = []
    with open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, L, h, D, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
                   for h in (H, Hkv, Hkv))
        t0 = time.monotonic()
        for i in range(1, args.batches + 1):
            cu = packed_row(S, "lognormal", seed=1000 + i, multiple=2 * W)
            for m in methods:
                for _ in range(args.calls):
                    out = seqpar.attention(q, k, v, causal=True, cu_seqlens=cu, method=m, layout=METHODS[m],
                                           check_ranks=False)
                    out.backward(torch.ones_like(out))
                    del out
                    q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            rec = {"kind": "sample", "batch": i, "documents": len(cu) - 1,
                   "allocated_mib": torch.cuda.memory_allocated() / 2**20,
                   "reserved_mib": torch.cuda.memory_reserved() / 2**20, "rss_mib": _rss_mib(),
                   "cache": call.cache_info(), "s": time.monotonic() - t0}
            samples.append(rec)
            f.write(json.dumps(rec) + "\n")
            if i % 20 == 0:
                print(json.dumps(rec), flush=True)
        a, b = samples[min(args.settle, len(samples)) - 1], samples[-1]
        summary = {"kind": "summary", "from_batch": a["batch"], "to_batch": b["batch"],
                   "allocated_growth_mib": b["allocated_mib"] - a["allocated_mib"],
                   "reserved_growth_mib": b["reserved_mib"] - a["reserved_mib"],
                   "rss_growth_mib": b["rss_mib"] - a["rss_mib"],
                   "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
        summary["flat"] = (summary["allocated_growth_mib"] <= args.slack_mib
                           and summary["rss_growth_mib"] <= args.slack_rss_mib)
        f.write(json.dumps(summary) + "\n")
    print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
