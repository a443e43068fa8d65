"""Causal work per rank on packed batches: plain zigzag (cut at the documents) against the balanced layout.

    python benchmarks/balance_stats.py --batches 64 --out benchmarks/results/balance-$(date +%F).txt

Rows of ``--seq-len`` tokens (128K) are packed from two length distributions, each from a fixed seed:
  lognormal   lognormal lengths with mean 2K (sigma 1); the last document is cut at the row's end;
  long-tail   a pretraining mix: 80% of the documents as above, 20% Pareto(alpha 1.1) from 8K, up to the
              whole row (the row's end cuts the last one).
For every distribution, W and layout, over the batches (``seqpar.layouts.work``, causal, no window):
  busiest/mean   the busiest rank's work over the mean: mean over batches, and the worst batch;
  lockstep       sum over ring steps of the busiest rank's work at that step, over the mean rank's total
                 work: what a pass-KV ring pays when every step waits for the slowest rank (mean, worst);
  tokens         max - min tokens per rank over all batches (0 = exactly equal);
  runs/rank      runs per rank after cutting at the documents (mean, max): pieces the planner sees;
  build ms       time to place every rank (the layout's segments for all ranks), median over batches.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime

import torch

from seqpar.layouts import Balanced, Rule, Zigzag
from seqpar.layouts.work import block_work, work

CAUSAL = Rule(causal=True)


def lognormal_row(rng: random.Random, seq_len: int, long_tail: bool) -> tuple[int, ...]:
    """Global cu_seqlens of one packed row (see the module docstring)."""
    mu, bounds = math.log(2048) - 0.5, [0]
    while bounds[-1] < seq_len:
        if long_tail and rng.random() < 0.2:
            n = 8192 * rng.paretovariate(1.1)
        else:
            n = rng.lognormvariate(mu, 1.0)
        bounds.append(bounds[-1] + min(max(1, round(n)), seq_len - bounds[-1]))
    return tuple(bounds)


def measure(layout_name: str, world: int, bounds: tuple[int, ...], seq_len: int) -> dict[str, float]:
    """One batch, one layout: busiest/mean, lockstep, token spread, runs per rank, build time."""
    t0 = time.perf_counter()
    lay = Balanced(world, bounds) if layout_name == "balanced" else Zigzag(world)
    segs = [lay.segments(r, seq_len) for r in range(world)]
    build = time.perf_counter() - t0
    cut = [s.cut(bounds) for s in segs]
    per_rank = work(lay, seq_len, CAUSAL, bounds)
    mean = sum(per_rank) / world
    steps = sum(max(block_work(cut[r], cut[(r - s) % world], CAUSAL) for r in range(world)) for s in range(world))
    return {"busiest": max(per_rank) / mean, "lockstep": steps / mean,
            "tokens": max(s.length for s in segs) - min(s.length for s in segs),
            "runs": statistics.mean(len(c.runs) for c in cut), "runs_max": max(len(c.runs) for c in cut),
            "build_ms": build * 1e3}


def table(dist: str, world: int, rows: dict[str, list[dict[str, float]]]) -> list[str]:
    head = ("layout", "busiest/mean", "lockstep", "tokens", "runs/rank", "build ms")
    out = [f"{dist}, W={world}", "  {:9s} {:>17s} {:>17s} {:>7s} {:>12s} {:>9s}".format(*head),
           "  {:9s} {:>8s} {:>8s} {:>8s} {:>8s} {:>7s} {:>6s} {:>5s} {:>9s}".format(
               "", "mean", "worst", "mean", "worst", "max-min", "mean", "max", "median")]
    for name, ms in rows.items():
        col = {k: [m[k] for m in ms] for k in ms[0]}
        out.append(f"  {name:9s} {statistics.mean(col['busiest']):8.5f} {max(col['busiest']):8.5f} "
                   f"{statistics.mean(col['lockstep']):8.3f} {max(col['lockstep']):8.3f} {int(max(col['tokens'])):7d} "
                   f"{statistics.mean(col['runs']):6.1f} {int(max(col['runs_max'])):5d} "
                   f"{statistics.median(col['build_ms']):9.2f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=64, help="packed rows per distribution (each W sees the same)")
    ap.add_argument("--seq-len", type=int, default=128 * 1024)
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args()
    lines = [f"seqpar layout balance on packed rows, {datetime.now():%Y-%m-%d %H:%M:%S}",
             f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} cpus), python "
             f"{platform.python_version()}, torch {torch.__version__}",
             f"command: python {' '.join(sys.argv)}",
             f"{args.batches} rows of {args.seq_len} tokens per distribution, seed {args.seed}; causal work per rank "
             f"(a token at offset p of its document: p + 1 keys)", ""]
    print("\n".join(lines), flush=True)
    worst = 0.0
    for d, dist in enumerate(("lognormal", "long-tail")):
        rng = random.Random(args.seed * 2 + d)
        batches = [lognormal_row(rng, args.seq_len, dist == "long-tail") for _ in range(args.batches)]
        docs = statistics.mean(len(b) - 1 for b in batches)
        for world in args.worlds:
            rows = {name: [measure(name, world, b, args.seq_len) for b in batches] for name in ("zigzag", "balanced")}
            worst = max(worst, *(m["busiest"] for m in rows["balanced"]))
            block = [*table(f"{dist} ({docs:.0f} documents per row on average)", world, rows), ""]
            print("\n".join(block), flush=True)
            lines += block
    summary = (f"balanced: busiest/mean <= {worst:.5f} on every batch of every distribution and W; tokens per rank "
               f"exactly seq_len / W on every rank of every batch (max-min 0)")
    print(summary)
    lines.append(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
