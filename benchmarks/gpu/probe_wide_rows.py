"""Where a windowed band stops losing on flex: ``WIDE_ROWS`` (Note [Bands on flex] in ``seqpar.kernels.executor``)
set per run, the named masks' emulated rank (the busiest of W on a fake group, as in ``masks_1gpu.py``'s emulated
section) timed at each value, forward (no grad) and forward+backward, against seqpar at W = 1 on the same mask.

    python3 benchmarks/gpu/probe_wide_rows.py --out DIR --rows 4096,2048 --masks sink_window

The sink window at 16K tokens per rank (window 4095) gives a rank a band of 4095 rows against its neighbour's keys:
just under ``WIDE_ROWS = 4096``, so it ran on FA2 (578 us of a 3.4 ms forward in the profile of 2026-11-26, where
flex ran the rank's 16K-row band at about half FA2's time per cell).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import masks_1gpu as M

from seqpar.kernels import executor
from seqpar.runtime import call as _call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="4096,2048", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--masks", default="sink_window", type=lambda t: t.split(","))
    ap.add_argument("--methods", default="ring/contiguous,ring/zigzag,allgather/contiguous",
                    type=lambda t: [tuple(x.split("/")) for x in t.split(",")])
    ap.add_argument("--size", type=int, default=131072)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    M.OUT = Path(args.out)
    M.OUT.mkdir(parents=True, exist_ok=True)
    S, W = args.size, args.world
    for name in args.masks:
        causal, m = M.named(S)[name]
        M.group(1)
        base = M.timed(M.ours_call(causal=causal, mask_mod=m, layout="contiguous"), M.inputs(S), args)
        for rows in args.rows:
            executor.WIDE_ROWS = rows
            for method, layout in args.methods:
                _call.cache_clear()
                M.CHOSEN.seen.clear()
                docs, rank, _ = M.emulated_rank(method, layout, S, causal, m, W)
                M.group(W, rank)
                ours = M.timed(M.ours_call(causal=causal, mask_mod=m, method=method, layout=layout, cu_seqlens=docs,
                                           check_ranks=False), M.inputs(S // W), args)
                M.emit(section="wide_rows", wide_rows=rows, mask=name, method=method, layout=layout, seq_len=S,
                       emulated_world=W, emulated_rank=rank, w1_fwd_ms=base[0], w1_fb_ms=base[1],
                       rank_fwd_ms=ours[0], rank_fb_ms=ours[1], compute_efficiency_fwd=base[0] / W / ours[0],
                       compute_efficiency_fb=base[1] / W / ours[1], kernels=list(M.CHOSEN.seen))
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
