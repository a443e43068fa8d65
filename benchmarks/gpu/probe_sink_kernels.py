"""The sink window under Ulysses at 128K over 8 (4 query heads, 1 KV head a rank): flex against FA2 for its band.

    python3 benchmarks/gpu/probe_sink_kernels.py [--out FILE] [--seq 131072]

Under Ulysses flex's backward on few KV heads ran 2.7x its share of the 32-head call (the masks issue's profile),
and ``auto`` puts a wide band of a training call on flex (Note [Bands on flex]). For the sink window (4095 + 4
sinks) and, as the anchor, causal: seqpar at W = 1 on the whole sequence (``auto``), and rank 0 of 8 under
Ulysses on a fake group with ``kernel="auto"`` and ``kernel="flash"``; forward and forward+backward, median ms,
and the efficiency against W = 1 (T(W = 1) / 8 / T(rank)). GQA 32/8, D 128, bf16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import masks_1gpu as mk

from seqpar import masks
from seqpar.bench.report import write_probe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    S, W, rows = args.seq, 8, []
    for name, causal, m in (("causal", True, None), ("sink_window", False, masks.sink_window(4095, 4))):
        mk.group(1)
        w1 = mk.timed(mk.ours_call(causal=causal, mask_mod=m, layout="contiguous"), mk.inputs(S), args)
        torch.cuda.empty_cache()
        mk.group(W, 0)
        t = mk.inputs(S // W)
        for kernel in ("auto", "flash"):
            ms = mk.timed(mk.ours_call(causal=causal, mask_mod=m, method="ulysses", layout="contiguous",
                                       check_ranks=False, kernel=kernel), t, args)
            row = {"mask": name, "S": S, "kernel": kernel, "w1_fwd_ms": round(w1[0], 3), "w1_fb_ms": round(w1[1], 3),
                   "rank_fwd_ms": round(ms[0], 3), "rank_fb_ms": round(ms[1], 3),
                   "eff_fwd": round(w1[0] / W / ms[0], 3), "eff_fb": round(w1[1] / W / ms[1], 3)}
            rows.append(row)
            print(row, flush=True)
        del t
        torch.cuda.empty_cache()
    write_probe(args.out, rows)


if __name__ == "__main__":
    main()
