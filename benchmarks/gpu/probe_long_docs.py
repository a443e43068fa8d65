"""Long documents in few-head varlen calls (Note [Long documents in few heads]): FA2 on one GPU.

    python3 benchmarks/gpu/probe_long_docs.py [--out FILE]

For the bench's packed rows (seed 7, documents rounded to 16) at the heads one rank of 8 runs under Ulysses (GQA
32/8: 4 query heads, 1 KV head), times ``KERNELS["flash"]`` forward and forward+backward on the whole row: in one
call, with its long documents alone beside it on cuDNN (what ``auto`` runs where block shapes recur; also launched
after the call, and with either stream at high priority), on cuDNN in buckets (where they vary), and alone on FA2
(the kernel named); beside
them, one eighth of the 32-head call on the same row (the efficiency's ideal). Each variant's gradients are first
checked against the one call's (largest absolute difference printed) and its host time a call printed (20 calls
back to back). Then bursts of 10 back-to-back calls, the variants interleaved round by round, median of 7.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch

from seqpar.bench.report import write_probe
from seqpar.bench.timing import back_to_back_ms, burst_ms
from seqpar.kernels import long_docs
from seqpar.kernels import side as side_mod
from seqpar.kernels.base import KERNELS, KernelCall
from seqpar.layouts.packing import packed_row
from seqpar.masks.forms import Varlen

D = 128


def ordered_fwd(fwd, side_fwd, q, k, v, alone: long_docs.Alone, side_first: bool, side: torch.cuda.Stream,
                main: torch.cuda.Stream):
    """``long_docs.forward`` with the launch order and the two streams given (their priorities): on ``main``."""
    with torch.cuda.stream(main):
        side.wait_stream(main)
        if not side_first:
            o, lse = fwd(q, k, v, alone.main)
        with torch.cuda.stream(side):
            parts = [side_fwd(q[:, a:b], k[:, c:d], v[:, c:d], long_docs._band(a, b, c, d))
                     for a, b, c, d in alone.docs]
        if side_first:
            o, lse = fwd(q, k, v, alone.main)
        main.wait_stream(side)
        for (a, b, _, _), (po, pl) in zip(alone.docs, parts):
            po.record_stream(main)
            pl.record_stream(main)
            o[:, a:b].copy_(po)
            lse[:, :, a:b].copy_(pl)
    torch.cuda.current_stream().wait_stream(main)
    return o, lse


def host_breakdown(q, k, v, mask: Varlen, scale: float, calls: int = 50) -> None:
    """Host microseconds a call of each step of the forward with the documents alone on cuDNN, launched back to
    back (the device runs behind; nothing synchronises inside the loop)."""
    flash, cudnn = KERNELS["flash"].for_call(KernelCall.of(q, k, mask)), KERNELS["cudnn"]
    alone = long_docs.plan(mask, q.shape[2], long_docs.slots(q.device))
    a, b, c, d = alone.docs[0]
    band = long_docs._band(a, b, c, d)
    side = side_mod._stream(q.device)
    o, lse = flash._forward(q, k, v, alone.main, scale)
    po, pl = cudnn.forward(q[:, a:b], k[:, c:d], v[:, c:d], band, scale)
    steps = {
        "plan and side kernel": lambda: flash._alone(mask, q, k, False),
        "side.wait_stream(current)": lambda: side_mod.beside(q.device),
        "enter and leave torch.cuda.stream(side)": lambda: torch.cuda.stream(side).__enter__() or
        torch.cuda.set_stream(torch.cuda.default_stream(q.device)),
        "cuDNN forward of the document": lambda: cudnn.forward(q[:, a:b], k[:, c:d], v[:, c:d], band, scale),
        "FA2 varlen forward (the call)": lambda: flash._forward(q, k, v, alone.main, scale),
        "join (wait_stream, record_stream x2)": lambda: side_mod.join(side, [po, pl]),
        "two copies": lambda: (o[:, a:b].copy_(po), lse[:, :, a:b].copy_(pl)),
        "the whole forward": lambda: flash.forward(q, k, v, mask, scale),
        "FA2 one call (uncut)": lambda: flash._forward(q, k, v, mask, scale),
    }
    for name, fn in steps.items():
        for _ in range(3):
            fn()
        print(f"host {name:<42} {back_to_back_ms(fn, q.device, calls=calls)[0] * 1e3:8.1f} us", flush=True)


def variants(q, k, v, do, mask: Varlen, scale: float) -> dict[str, object]:
    """Forward and forward+backward of FA2 on the whole row: in one call, and with its long documents alone
    beside it on cuDNN (the kernel's own choice) or on FA2."""
    flash = KERNELS["flash"]
    alone = long_docs.plan(mask, q.shape[2], long_docs.slots(q.device))
    fwd = lambda *a: flash._forward(*a, scale)                                       # noqa: E731
    bwd = lambda *a: flash._backward(*a, scale, False)                                # noqa: E731
    runs = {"one call": (lambda: fwd(q, k, v, mask), lambda o: bwd(do, q, k, v, *o, mask))}
    if alone is not None:
        call = KernelCall.of(q, k, mask)
        exact, buckets = flash.for_call(call), flash.for_call(replace(call, shapes_vary=True))
        runs["alone on cuDNN"] = (lambda: exact.forward(q, k, v, mask, scale),
                                  lambda o: exact.backward(do, q, k, v, *o, mask, scale))
        runs["alone on cuDNN in buckets"] = (lambda: buckets.forward(q, k, v, mask, scale),
                                             lambda o: buckets.backward(do, q, k, v, *o, mask, scale))
        runs["alone on FA2"] = (lambda: long_docs.forward(fwd, fwd, q, k, v, alone),
                                lambda o: long_docs.backward(bwd, bwd, do, q, k, v, *o, alone))
        cfwd = lambda *a: KERNELS["cudnn"].forward(*a, scale)                            # noqa: E731
        lib_bwd = lambda o: exact.backward(do, q, k, v, *o, mask, scale)                  # noqa: E731
        cur, hi, lo = torch.cuda.current_stream(), torch.cuda.Stream(priority=-1), torch.cuda.Stream()
        for name, first, side, main in [("cuDNN, main first", False, lo, cur),
                                        ("cuDNN, side first at high priority", True, hi, cur),
                                        ("cuDNN, side first, main at high priority", True, lo, hi)]:
            runs[name] = ((lambda first=first, side=side, main=main: ordered_fwd(fwd, cfwd, q, k, v, alone, first,
                                                                                side, main)), lib_bwd)
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
                if m.startswith("one call")}
            if heads == 4 and long_docs.plan(mask, heads, long_docs.slots(dev)) is not None:
                host_breakdown(q, k, v, mask, D ** -0.5)
            ref = fns.get("one call fwd+bwd")
            for name, fn in fns.items():
                if ref is not None and name.endswith("fwd+bwd") and fn is not ref:
                    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(fn(), ref()))
                    print(f"{name}: largest difference from one call {diff:.3g}", flush=True)
            for name, fn in fns.items():                 # host time a call, launched back to back
                print(f"{name}: host {back_to_back_ms(fn, dev)[0]:.3f} ms a call", flush=True)
            ms = burst_ms(fns, dev)
            if heads == 32:
                ms = {name.replace("one call ", ""): t / 8 for name, t in ms.items()}
            alone = long_docs.plan(mask, heads, long_docs.slots(dev))
            for name, t in ms.items():
                row = {"row": f"{total // 1024}K {dist_name}", "docs": len(cu) - 1, "longest": max(
                    b - a for a, b in itertools.pairwise(cu)), "heads": heads, "kv_heads": kv, "variant": name,
                    "ms": round(t, 4), "alone": None if alone is None else alone.docs}
                rows.append(row)
                print(f"{row['row']:>15} H{heads:<3} {name:<28} {t:8.3f} ms", flush=True)
    write_probe(args.out, rows)


if __name__ == "__main__":
    main()
