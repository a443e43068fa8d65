"""A long square causal call (Ulysses' local call) as one cuDNN call against three calls on two streams.

    python3 benchmarks/gpu/probe_causal_split.py [--out FILE] [--lengths 32768,65536,131072] [--heads 4/1,8/2,32/8]

The split: rows [0, h) against keys [0, h) causal (the front), rows [h, S) against keys [0, h) full (the back's
full block), rows [h, S) against keys [h, S) causal (the back's diagonal), h = S / 2. The full block, half the
work, runs on the current stream; the two causal halves, the other half, are launched first on a second stream.
Forward: the three partials merged in one pass (``combine.merge_parts``). Backward, from the one call's final out
and lse: the three calls' gradients, dQ of the back rows and dK/dV of the front keys summed in fp32
(``combine.sum_parts``). Both checked against the one call; bursts of 3 back-to-back calls, the variants
interleaved, median of 5, bf16, D 128.
"""

from __future__ import annotations

import argparse

import torch

from seqpar.bench.report import write_probe
from seqpar.bench.timing import burst_ms
from seqpar.kernels import combine
from seqpar.kernels.sdpa import CudnnKernel

D = 128
SCALE = D ** -0.5


def split_fwd(q, k, v, side: torch.cuda.Stream):
    S = q.shape[1]
    h = S // 2
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        front = CudnnKernel._fwd(q[:, :h], k[:, :h], v[:, :h], True, SCALE)
        diag = CudnnKernel._fwd(q[:, h:], k[:, h:], v[:, h:], True, SCALE)
    full = CudnnKernel._fwd(q[:, h:], k[:, :h], v[:, :h], False, SCALE)
    cur.wait_stream(side)
    for x in (*front, *diag):
        x.record_stream(cur)
    return combine.merge_parts([(slice(0, h), front.out, front.lse), (slice(h, S), diag.out, diag.lse),
                                (slice(h, S), full.out, full.lse)], (*q.shape[:3], v.shape[-1]), q.dtype)


def split_bwd(do, q, k, v, out, lse, side: torch.cuda.Stream):
    S = q.shape[1]
    h = S // 2
    a, b = slice(0, h), slice(h, S)
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        front = CudnnKernel._bwd(do[:, a], q[:, a], k[:, a], v[:, a], out[:, a], lse[:, :, a], True, scale=SCALE)
        diag = CudnnKernel._bwd(do[:, b], q[:, b], k[:, b], v[:, b], out[:, b], lse[:, :, b], True, scale=SCALE)
    full = CudnnKernel._bwd(do[:, b], q[:, b], k[:, a], v[:, a], out[:, b], lse[:, :, b], False, scale=SCALE)
    cur.wait_stream(side)
    for x in (*front, *diag):
        x.record_stream(cur)
    dq = combine.sum_parts([(a, front[0]), (b, diag[0]), (b, full[0])], tuple(q.shape), q.dtype)
    dk = combine.sum_parts([(a, front[1]), (b, diag[1]), (a, full[1])], tuple(k.shape), k.dtype)
    dv = combine.sum_parts([(a, front[2]), (b, diag[2]), (a, full[2])], tuple(v.shape), v.dtype)
    return dq, dk, dv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--heads", default="4/1,8/2,16/4,32/8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    side = torch.cuda.Stream()
    rows = []
    for S in (int(x) for x in args.lengths.split(",")):
        for H, Hkv in (tuple(int(y) for y in x.split("/")) for x in args.heads.split(",")):
            q = torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16)
            k, v, do = (torch.randn(1, S, n, D, device=dev, dtype=torch.bfloat16) for n in (Hkv, Hkv, H))
            one = CudnnKernel._fwd(q, k, v, True, SCALE)
            two = split_fwd(q, k, v, side)
            g1 = CudnnKernel._bwd(do, q, k, v, one.out, one.lse, True, scale=SCALE)
            g2 = split_bwd(do, q, k, v, one.out, one.lse, side)
            err = {"out": (one.out.float() - two[0].float()).abs().max().item(),
                   "lse": (one.lse - two[1]).abs().max().item(),
                   **{n: ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
                      for n, a, b in zip(("dq", "dk", "dv"), g1, g2)}}
            fns = {"fwd one call": lambda q=q, k=k, v=v: CudnnKernel._fwd(q, k, v, True, SCALE),
                   "fwd split": lambda q=q, k=k, v=v: split_fwd(q, k, v, side),
                   "bwd one call": lambda q=q, k=k, v=v, do=do, o=one: CudnnKernel._bwd(do, q, k, v, o.out, o.lse,
                                                                                      True, scale=SCALE),
                   "bwd split": lambda q=q, k=k, v=v, do=do, o=one: split_bwd(do, q, k, v, o.out, o.lse, side)}
            ms = burst_ms(fns, dev, burst=3, rounds=5)
            row = {"S": S, "heads": H, "kv_heads": Hkv, **{n.replace(" ", "_"): round(t, 4) for n, t in ms.items()},
                   "fwd_gain": round(ms["fwd one call"] / ms["fwd split"], 4),
                   "bwd_gain": round(ms["bwd one call"] / ms["bwd split"], 4),
                   "max_err": {n: float(f"{e:.3g}") for n, e in err.items()}}
            rows.append(row)
            print(row, flush=True)
            del q, k, v, do, one, two, g1, g2
            torch.cuda.empty_cache()
    write_probe(args.out, rows)


if __name__ == "__main__":
    main()
