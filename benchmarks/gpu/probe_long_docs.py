"""Long documents cut in few-head varlen calls (Note [Long documents in few heads]): FA2 alone, one GPU.

    python3 benchmarks/gpu/probe_long_docs.py [--out FILE]

For the bench's packed rows (seed 7, documents rounded to 16) at the heads one rank of 8 runs under Ulysses (GQA
32/8: 4 query heads, 1 KV head), times ``KERNELS["flash"]`` forward and forward+backward on the whole row: uncut,
cut with the side blocks launched after the varlen call, cut with them launched first, and cut with each side
block's rows in halves (side first); beside them, one eighth of the 32-head call on the same row (the
efficiency's ideal). Bursts of 10 back-to-back calls, the variants interleaved round by round, median of 7.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from seqpar.bench.packing import packed_row
from seqpar.bench.timing import burst_ms
from seqpar.kernels import long_docs
from seqpar.kernels.base import KERNELS
from seqpar.masks.forms import Varlen

D = 128


def halves(cut: long_docs.Cut) -> long_docs.Cut:
    """``cut`` with each side block's rows in two."""
    sides = []
    for a, b, c, d in cut.sides:
        h = (a + b) // 2 // long_docs.TILE_ROWS * long_docs.TILE_ROWS
        sides += [(a, h, c, d), (h, b, c, d)] if a < h < b else [(a, b, c, d)]
    return long_docs.Cut(cut.main, tuple(sides))


def variants(q, k, v, do, mask: Varlen, scale: float) -> dict[str, object]:
    flash = KERNELS["flash"]
    cut = long_docs.plan(mask, q.shape[2], long_docs.slots(q.device))
    fwd = lambda *a: flash._forward(*a, scale)                                       # noqa: E731
    bwd = lambda *a: flash._backward(*a, scale, False)                                # noqa: E731
    runs = {"uncut": (lambda: fwd(q, k, v, mask), lambda o: bwd(do, q, k, v, *o, mask))}
    if cut is not None:
        for name, c, first in [("main-first", cut, False), ("side-first", cut, True),
                               ("side-halves", halves(cut), True)]:
            runs[name] = ((lambda c=c, first=first: long_docs.forward(fwd, q, k, v, c, side_first=first)),
                          (lambda o, c=c, first=first: long_docs.backward(bwd, do, q, k, v, *o, c,
                                                                           side_first=first)))
    fns = {}
    for name, (f, b) in runs.items():
        fns[f"{name} fwd"] = f
        fns[f"{name} fwd+bwd"] = lambda f=f, b=b: b(f())
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for total, dist_name in [(32768, "lognormal"), (32768, "long-tail"), (131072, "lognormal")]:
        cu = packed_row(total, dist_name, seed=7, multiple=16)
        mask = Varlen(cu, cu, (-1, 0))
        for heads, kv in [(4, 1), (32, 8)]:
            q, do = (torch.randn(1, total, heads, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(1, total, kv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
            fns = variants(q, k, v, do, mask, D ** -0.5) if heads == 4 else {
                f"32 heads / 8 {m}": f for m, f in variants(q, k, v, do, mask, D ** -0.5).items()
                if m.startswith("uncut")}
            ms = burst_ms(fns, dev)
            if heads == 32:
                ms = {name.replace("uncut ", ""): t / 8 for name, t in ms.items()}
            cut = long_docs.plan(mask, heads, long_docs.slots(dev))
            for name, t in ms.items():
                row = {"row": f"{total // 1024}K {dist_name}", "docs": len(cu) - 1, "longest": max(
                    b - a for a, b in itertools.pairwise(cu)), "heads": heads, "kv_heads": kv, "variant": name,
                    "ms": round(t, 4), "sides": None if cut is None else cut.sides}
                rows.append(row)
                print(f"{row['row']:>15} H{heads:<3} {name:<28} {t:8.3f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "argv": sys.argv}) + "\n")
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
