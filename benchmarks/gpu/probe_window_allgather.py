"""A sliding window under the all-gather: the busiest of 8 ranks (fake group) against seqpar at W = 1, one GPU.

    PYTHONPATH=<tree> python3 benchmarks/gpu/probe_window_allgather.py --out DIR [--seq 131072] [--world 8]

``window_size=(4095, 0)``, causal, GQA 32/8, D 128, bf16. The all-gather reads a window's keys selectively (Note
[Selective gather]); its compact buffer put a rank's own keys at row 4095 of it - one key off the kernels' 128-key
tiles - until the read intervals were widened to whole tiles (Note [Selective gather on tiles]). Run once per tree
(a ``git archive`` copy on ``PYTHONPATH``) to compare. Efficiency = T(W = 1) / W / T(rank), forward (no grad) and
forward+backward; one JSON line per configuration in DIR/window_allgather.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import rank_median_ms

DEV = torch.device("cuda")


def group(world: int, rank: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def timed(n: int, **kw) -> tuple[float, float]:
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, n, 32, 128, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, n, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            seqpar.attention(q, k, v, causal=True, window_size=(4095, 0), **kw)

    def fb():
        seqpar.attention(q, k, v, causal=True, window_size=(4095, 0), **kw).backward(do)
    return (rank_median_ms(fwd, DEV, warmup=4, iters=15), rank_median_ms(fb, DEV, warmup=4, iters=15))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--world", type=int, default=8)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    S, W = args.seq, args.world
    group(1, 0)
    w1 = timed(S, layout="contiguous")
    for layout in ("contiguous", "zigzag"):
        group(W, 1)
        rank = timed(S // W, method="allgather", layout=layout, check_ranks=False)
        rec = {"layout": layout, "seq": S, "world": W, "rank": 1, "w1_fwd_ms": w1[0], "w1_fb_ms": w1[1],
               "rank_fwd_ms": rank[0], "rank_fb_ms": rank[1], "eff_fwd": w1[0] / W / rank[0],
               "eff_fb": w1[1] / W / rank[1], "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
        print(json.dumps(rec), flush=True)
        with (out / "window_allgather.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
