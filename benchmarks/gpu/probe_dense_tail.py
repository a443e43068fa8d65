"""A long causal call in few heads (Ulysses' call at 16K-32K tokens per rank) against the same call in all heads.

    python3 benchmarks/gpu/probe_dense_tail.py [--out FILE]

Ulysses at 128K over W runs one causal call of 32 / W query heads on the whole sequence; its efficiency is that
call's time against 1 / W of the 32-head call. For causal and full calls at W = 8 and 4 head counts, on cuDNN and
FA2, times: the call in all heads / W, the call in the rank's heads, and the rank's call in two row halves on two
streams (the back half - its keys' front half as a full block and its back half causal, merged - launched first,
the front half causal beside it). Bursts of 3 back-to-back calls, the variants interleaved, median of 5. Also the
GPU kernel time of each (from a profile), so a tail (the GPU idle at the end of a call) shows as the gap.
"""

from __future__ import annotations

import argparse

import torch

from seqpar.bench.report import write_probe
from seqpar.bench.timing import burst_ms, kernel_ms
from seqpar.kernels import combine
from seqpar.kernels.base import KERNELS
from seqpar.kernels.sdpa import CudnnKernel
from seqpar.masks.forms import Band

D = 128
SCALE = D ** -0.5


def halves(q, k, v, scale: float, side: torch.cuda.Stream):
    """The causal call as its back half of rows (full block + causal block, merged) on ``side``, launched first,
    and its front half (causal) on the current stream; out (B, S, H, D), lse (B, H, S)."""
    S = q.shape[1]
    h = S // 2
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        full = CudnnKernel._fwd(q[:, h:], k[:, :h], v[:, :h], False, scale)
        diag = CudnnKernel._fwd(q[:, h:], k[:, h:], v[:, h:], True, scale)
        whole = slice(0, S - h)
        back = combine.merge_parts([(whole, full.out, full.lse), (whole, diag.out, diag.lse)],
                                   tuple(full.out.shape), q.dtype)
    front = CudnnKernel._fwd(q[:, :h], k[:, :h], v[:, :h], True, scale)
    cur.wait_stream(side)
    for t in back:
        t.record_stream(cur)
    return torch.cat([front.out, back[0]], 1), torch.cat([front.lse, back[1]], 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    rows = []
    cases = [(131072, 8, True), (131072, 4, True), (65536, 8, False), (32768, 8, True)]
    for S, W, causal in cases:
        fns, band = {}, Band(None, 0) if causal else Band()
        for heads, kv in [(32, 8), (32 // W, 8 // W)]:
            q = torch.randn(1, S, heads, D, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(1, S, kv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
            tag = "all heads / W" if heads == 32 else "rank's heads"
            fns[f"cuDNN {tag}"] = lambda q=q, k=k, v=v, c=causal: CudnnKernel._fwd(q, k, v, c, SCALE)
            fns[f"FA2 {tag}"] = lambda q=q, k=k, v=v, b=band: KERNELS["flash"]._forward(q, k, v, b, SCALE)
            if heads != 32 and causal:
                fns["cuDNN rank's heads, two halves on two streams"] = lambda q=q, k=k, v=v: halves(q, k, v, SCALE,
                                                                                                     side)
                a, b = fns["cuDNN rank's heads"](), fns["cuDNN rank's heads, two halves on two streams"]()
                print(f"S {S} W {W}: halves vs one call: out {(a.out.float() - b[0].float()).abs().max().item():.3g}"
                      f" lse {(a.lse - b[1]).abs().max().item():.3g}", flush=True)
        ms = burst_ms(fns, dev, burst=3, rounds=5)
        for name, t in ms.items():
            div = W if "all heads" in name else 1
            kern = kernel_ms(fns[name], dev, calls=2)
            row = {"S": S, "W": W, "causal": causal, "variant": name, "ms": round(t / div, 4),
                   "kernel_ms": None if kern is None else round(kern[0] / div, 4)}
            rows.append(row)
            print(f"S {S:>6} W {W} causal {causal!s:<5} {name:<48} {row['ms']:9.3f} ms  kernels {row['kernel_ms']}",
                  flush=True)
    write_probe(args.out, rows)


if __name__ == "__main__":
    main()
