"""Flex's block backward from the final rows against the recomputing one, kernel by kernel, on one GPU.

    python3 benchmarks/gpu/probe_flex_final_rows.py --out DIR [--iters 10]

For each case (a band, a causal block, softcap at D 128 and 256, documents, a user ``mask_mod``; GQA 32/8, bf16,
16K rows) it runs the block's forward for its final rows, then times ``FlexKernel.backward`` both ways in one
process: from the final rows by flex's backward kernel alone (Note [Flex backward from the final rows] in
``seqpar.kernels.flex_backward``) and the recompute (the forward again, autograd with the merge weights; reached by
passing Delta, which only the recompute takes). It records the first call's time (the compile), the medians, and
the largest difference of each gradient between the two over its largest magnitude. One JSON line per case in
DIR/flex_final_rows.jsonl.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from seqpar.bench.timing import time_ms
from seqpar.kernels import flex as flex_mod
from seqpar.masks import Band, Varlen
from seqpar.masks.forms import Modded
from seqpar.numerics import delta as row_delta


def _chunks(b, h, qi, ki):
    return (qi // 4096) == (ki // 4096)


def cases(S: int):
    docs = tuple(range(0, S + 1, 2048))
    return {
        "window 4095": (Band(-4095, 0), 128, 0.0),
        "causal": (Band(None, 0), 128, 0.0),
        "softcap 30, causal, D 128": (Band(None, 0), 128, 30.0),
        "softcap 30, causal, D 256": (Band(None, 0), 256, 30.0),
        "documents of 2K": (Varlen(docs, docs), 128, 0.0),
        "mask_mod chunks of 4K": (Modded(Band(None, 0), _chunks, ((0, S),), ((0, S),)), 128, 0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev, S, H, HKV = torch.device("cuda"), args.seq, 32, 8
    kern = flex_mod.FlexKernel()
    for name, (mask, D, cap) in cases(S).items():
        torch.manual_seed(0)
        q = torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, S, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        scale = D ** -0.5
        o, lse = kern.forward(q, k, v, mask, scale, softcap=cap)
        do = torch.randn_like(o)
        delta = row_delta(do, o, None)

        new = functools.partial(kern.backward, do, q, k, v, o, lse, mask, scale, softcap=cap)
        old = functools.partial(kern.backward, do, q, k, v, None, lse, mask, scale, delta=delta, softcap=cap)
        rec = {"case": name, "seq": S, "heads": H, "kv_heads": HKV, "head_dim": D, "softcap": cap}
        for what, fn in (("final_rows", new), ("recompute", old)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            rec[f"{what}_first_s"] = round(time.perf_counter() - t0, 2)
            rec[f"{what}_ms"] = time_ms(fn, dev, warmup=3, iters=args.iters)
        got, want = new(), old()
        for g, w, label in zip(got, want, ("dq", "dk", "dv")):
            rec[f"{label}_diff"] = float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp(min=1e-6))
        rec["speedup"] = rec["recompute_ms"] / rec["final_rows_ms"]
        rec["torch"], rec["gpu"] = torch.__version__, torch.cuda.get_device_name()
        print(json.dumps(rec), flush=True)
        with (out_dir / "flex_final_rows.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
