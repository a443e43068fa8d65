"""Does the sink window's joined flex call lose to its keys' alignment on flex's tiles? One GPU, kernel level.

    python3 benchmarks/gpu/probe_joined_alignment.py --out DIR [--rows 16384] [--iters 10]

The busiest rank of the sink window over 8 at 128K runs one joined flex call (the all-gather, contiguous layout):
its key buffer holds the 4 sink keys, the neighbour's last 4095 keys, then its own 16K, so its own keys start at
4099, off flex's 128-key tiles, and the call took 2.96 ms where a 16K share of the whole-row call takes 2.69
(``benchmarks/results/2026-11-26-h100-sink-profile``). Timed here, forward (no grad) and the backward from the final
rows (``FlexKernel.backward``), GQA 32/8, D 128, bf16:

- ``as laid out``: [sinks | halo | own], the buffer the all-gather builds;
- ``own on tiles``: [sinks | 125 unused rows | halo | own], own keys from 4224 = 33 x 128;
- ``own band alone``: the band on the own keys only (no halo, no sinks);
- ``W = 1 share``: the whole 128K row's sink window as one call, divided by 8 (the efficiency's reference).

One JSON line per layout in DIR/joined_alignment.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from seqpar.bench.timing import time_ms
from seqpar.kernels import flex as flex_mod
from seqpar.masks import Band, Joined
from seqpar.numerics import GradRows

WINDOW, SINKS = 4095, 4


def joined(m: int, gap: int) -> tuple[Joined, int]:
    """The rank's joined mask with ``gap`` unused key rows after the sinks, and its key count."""
    halo0 = SINKS + gap
    own0 = halo0 + WINDOW
    parts = ((0, m, 0, SINKS, Band()), (0, WINDOW, halo0, own0, Band(0, None)),
             (0, m, own0, own0 + m, Band(-WINDOW, 0)))
    return Joined(parts), own0 + m


def timed(mask, m: int, n: int, iters: int, dev: torch.device) -> dict:
    torch.manual_seed(0)
    q = torch.randn(1, m, 32, 128, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, n, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    kern, scale = flex_mod.FlexKernel(), 128 ** -0.5
    fwd = functools.partial(kern.forward, q, k, v, mask, scale)
    o, lse = fwd()
    do_f, out_f = GradRows(torch.randn_like(o), o, None).folded
    bwd = functools.partial(kern.backward, do_f, q, k, v, out_f, lse, mask, scale)
    bwd()
    return {"fwd_ms": time_ms(fwd, dev, warmup=3, iters=iters), "bwd_ms": time_ms(bwd, dev, warmup=3, iters=iters)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev, m = torch.device("cuda"), args.rows
    cases = {"as laid out": joined(m, 0), "own on tiles": joined(m, -(SINKS + WINDOW) % 128),
             "own band alone": (Band(-WINDOW, 0), m)}
    whole = m * args.world
    # the sinks as a part of their own for the rows whose band no longer reaches them (parts never overlap)
    cases["W = 1 share"] = (Joined(((SINKS + WINDOW, whole, 0, SINKS, Band()), (0, whole, 0, whole, Band(-WINDOW, 0)))),
                            whole)
    for name, (mask, n) in cases.items():
        rows = whole if name == "W = 1 share" else m
        rec = {"layout": name, "rows": rows, "keys": n, **timed(mask, rows, n, args.iters, dev)}
        if name == "W = 1 share":
            rec.update(fwd_share_ms=rec["fwd_ms"] / args.world, bwd_share_ms=rec["bwd_ms"] / args.world)
        rec["torch"], rec["gpu"] = torch.__version__, torch.cuda.get_device_name()
        print(json.dumps(rec), flush=True)
        with (out / "joined_alignment.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
