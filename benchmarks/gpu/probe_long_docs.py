"""Long documents cut in few-head varlen calls (Note [Long documents in few heads]): FA2 alone, one GPU.

    python3 benchmarks/gpu/probe_long_docs.py [--out FILE]

For the bench's packed rows (seed 7, documents rounded to 16) at the heads one rank of 8 runs under Ulysses (GQA
32/8: 4 query heads, 1 KV head), times ``KERNELS["flash"]`` forward and forward+backward on the whole row: uncut,
cut with the side blocks launched after the varlen call, cut with them launched first, and cut with each side
block's rows in halves (side first), cut with the side blocks on cuDNN, and the cut documents taken out of the
varlen call to run alone beside it (causal, on cuDNN or FA2); beside them, one eighth of the 32-head call on the
same row (the efficiency's ideal). Each variant's gradients are first checked against the uncut call's (largest
absolute difference printed). Bursts of 10 back-to-back calls, the variants interleaved round by round, median of 7.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from seqpar.bench.packing import packed_row
from seqpar.bench.timing import burst_ms, host_profile
from seqpar.kernels import long_docs
from seqpar.kernels.base import KERNELS
from seqpar.masks.forms import Band, Varlen

D = 128


CAUSAL = Band(None, 0)


def _mixed_fwd(fwd, side_fwd, q, k, v, cut):
    """The cut with its side blocks on another kernel."""
    return long_docs.forward(lambda q_, k_, v_, m: (fwd if isinstance(m, Varlen) else side_fwd)(q_, k_, v_, m),
                             q, k, v, cut)


def _mixed_bwd(bwd, side_bwd, do, q, k, v, out, lse, cut):
    return long_docs.backward(lambda *a: (bwd if isinstance(a[-1], Varlen) else side_bwd)(*a),
                              do, q, k, v, out, lse, cut)


def halves(cut: long_docs.Cut) -> long_docs.Cut:
    """``cut`` with each side block's rows in two."""
    sides = []
    for a, b, c, d in cut.sides:
        h = (a + b) // 2 // long_docs.TILE_ROWS * long_docs.TILE_ROWS
        sides += [(a, h, c, d), (h, b, c, d)] if a < h < b else [(a, b, c, d)]
    return long_docs.Cut(cut.main, tuple(sides))


def alone(mask: Varlen, cut: long_docs.Cut) -> tuple[Varlen, tuple[tuple[int, int, int, int], ...]]:
    """The cut's documents taken out of the varlen call whole (their rows there see no key, their keys serve no
    row) to run alone: ``(main, docs (q0, q1, k0, k1))``."""
    starts = {a for a, _, _, _ in cut.sides}
    cu_q, cu_k, docs = [0], [0], []
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(mask.cu_q), itertools.pairwise(mask.cu_k)):
        if any(q0 < a < q1 for a in starts):
            docs.append((q0, q1, k0, k1))
            cu_q += [q1, q1]
            cu_k += [k0, k1]
        else:
            cu_q.append(q1)
            cu_k.append(k1)
    return Varlen(tuple(cu_q), tuple(cu_k), mask.window), tuple(docs)


def alone_fwd(fwd, side_fwd, q, k, v, main: Varlen, docs):
    side = long_docs._beside(q.device)
    with torch.cuda.stream(side):
        parts = [side_fwd(q[:, a:b], k[:, c:d], v[:, c:d], CAUSAL) for a, b, c, d in docs]
    o, lse = fwd(q, k, v, main)
    long_docs._join(side, [t for p in parts for t in p])
    for (a, b, _, _), (po, pl) in zip(docs, parts):
        o[:, a:b].copy_(po)
        lse[:, :, a:b].copy_(pl)
    return o, lse


def alone_bwd(bwd, side_bwd, do, q, k, v, out, lse, main: Varlen, docs):
    side = long_docs._beside(q.device)
    with torch.cuda.stream(side):
        parts = [side_bwd(do[:, a:b], q[:, a:b], k[:, c:d], v[:, c:d], out[:, a:b], lse[:, :, a:b], CAUSAL)
                 for a, b, c, d in docs]
    dq, dk, dv = bwd(do, q, k, v, out, lse, main)
    long_docs._join(side, [t for p in parts for t in p])
    for (a, b, c, d), (gq, gk, gv) in zip(docs, parts):
        dq[:, a:b].copy_(gq)
        dk[:, c:d].copy_(gk)
        dv[:, c:d].copy_(gv)
    return dq, dk, dv


def variants(q, k, v, do, mask: Varlen, scale: float) -> dict[str, object]:
    flash, cudnn = KERNELS["flash"], KERNELS["cudnn"]
    cut = long_docs.plan(mask, q.shape[2], long_docs.slots(q.device))
    fwd = lambda *a: flash._forward(*a, scale)                                       # noqa: E731
    bwd = lambda *a: flash._backward(*a, scale, False)                                # noqa: E731
    cfwd = lambda *a: cudnn.forward(*a, scale)                                        # noqa: E731
    cbwd = lambda *a: cudnn.backward(*a, scale)                                       # noqa: E731
    runs = {"uncut": (lambda: fwd(q, k, v, mask), lambda o: bwd(do, q, k, v, *o, mask))}
    if cut is not None:
        for name, c, first in [("main-first", cut, False), ("side-first", cut, True),
                               ("side-halves", halves(cut), True)]:
            runs[name] = ((lambda c=c, first=first: long_docs.forward(fwd, q, k, v, c, side_first=first)),
                          (lambda o, c=c, first=first: long_docs.backward(bwd, do, q, k, v, *o, c,
                                                                           side_first=first)))
        runs["side-cudnn"] = ((lambda: _mixed_fwd(fwd, cfwd, q, k, v, cut)),
                              (lambda o: _mixed_bwd(bwd, cbwd, do, q, k, v, *o, cut)))
        main, docs = alone(mask, cut)
        for name, sf, sb in [("alone-cudnn", cfwd, cbwd), ("alone-flash", fwd, bwd)]:
            runs[name] = ((lambda sf=sf: alone_fwd(fwd, sf, q, k, v, main, docs)),
                          (lambda o, sb=sb: alone_bwd(bwd, sb, do, q, k, v, *o, main, docs)))
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
            ref = fns.get("uncut fwd+bwd")
            for name, fn in fns.items():
                if ref is not None and name.endswith("fwd+bwd") and fn is not ref:
                    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(fn(), ref()))
                    print(f"{name}: largest difference from uncut {diff:.3g}", flush=True)
            for name, fn in fns.items():                 # host time a call, launched back to back
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                host = (time.perf_counter() - t0) / 20 * 1e3
                torch.cuda.synchronize()
                print(f"{name}: host {host:.3f} ms a call", flush=True)
            if "main-first fwd" in fns:
                host_profile(fns["main-first fwd"], dev).sort_stats("tottime").print_stats(12)
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
