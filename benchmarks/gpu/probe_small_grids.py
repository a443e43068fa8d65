"""The varlen calls a balanced layout's rank runs at 4K tokens per rank, against their share of the one-GPU call.

    python3 benchmarks/gpu/probe_small_grids.py [--out FILE] [--world 8] [--rank 0]
        [--configs allgather/balanced_whole,ring/balanced_whole]

Rank r of W on a fake group (one GPU) runs ``seqpar.attention`` forward once per configuration on the bench's
32K lognormal row (GQA 32/8, D 128, bf16); every FA2 varlen call it makes is captured (its q, k, v and mask). For
each captured call: its rows, segments, longest segment and cells (visible pairs), and the forward and
forward+backward time of FA2 on it as one call, and with its longest segments alone beside it
(``long_docs.plan`` with 1x, 4x and 16x the device's thread-block slots, so ever shorter segments qualify) on
cuDNN and on FA2, and on flex (its own autograd: the forward's lse reused, dK/dV per KV head); beside them
its ideal: the one-GPU FA2 varlen call on the whole row, times the call's share of the row's cells. Bursts of
10, the variants interleaved, median of 7.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.report import write_probe
from seqpar.bench.timing import burst_ms
from seqpar.kernels import long_docs
from seqpar.kernels.base import KERNELS
from seqpar.layouts.packing import packed_row
from seqpar.masks.forms import Varlen

H, HKV, D = 32, 8, 128
SCALE = D ** -0.5


def cells(mask: Varlen) -> int:
    """Visible pairs of a causal varlen mask (each segment bottom-right aligned)."""
    return sum(long_docs._cells(q1 - q0, k1 - k0)
               for (q0, q1), (k0, k1) in zip(itertools.pairwise(mask.cu_q), itertools.pairwise(mask.cu_k)))


def capture(config: str, total: int, cu: tuple[int, ...], W: int) -> list:
    """Every FA2 varlen forward of one ``seqpar.attention`` call: ``(q, k, v, mask)``."""
    method, layout = config.split("/")
    flash = type(KERNELS["flash"])
    seen, orig = [], flash._forward

    def spy(self, q, k, v, mask, scale):
        if isinstance(mask, Varlen):
            seen.append((q, k, v, mask))
        return orig(self, q, k, v, mask, scale)

    where = {"method": method, "layout": layout, "cu_seqlens": cu}
    full = [torch.randn(1, total, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV)]
    q, k, v = (seqpar.shard(t, **where) for t in full)
    flash._forward = spy
    try:
        with torch.no_grad():
            seqpar.attention(q, k, v, method=method, layout=layout, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                             check_ranks=False)
    finally:
        flash._forward = orig
    return seen


def variants(q, k, v, mask: Varlen) -> dict:
    """Forward and forward+backward of the call as one FA2 call and with its longest segments alone."""
    flash, cudnn = KERNELS["flash"], KERNELS["cudnn"]
    fwd = lambda *a: flash._forward(*a, SCALE)                                     # noqa: E731
    bwd = lambda *a: flash._backward(*a, SCALE, False)                              # noqa: E731
    sides = {"cuDNN": (lambda *a: cudnn.forward(*a, SCALE), lambda *a: cudnn.backward(*a, SCALE)),
             "FA2": (fwd, bwd)}
    do = torch.randn_like(q)
    runs = {"one call": (lambda: fwd(q, k, v, mask), lambda o: bwd(do, q, k, v, *o, mask))}
    base = long_docs.slots(q.device)
    for x in (1, 4, 16):
        alone = long_docs.plan(mask, q.shape[2], base * x)
        if alone is None:
            continue
        for name, (sf, sb) in sides.items():
            runs[f"{len(alone.docs)} alone on {name} (slots x{x})"] = (
                lambda alone=alone, sf=sf: long_docs.forward(fwd, sf, q, k, v, alone),
                lambda o, alone=alone, sb=sb: long_docs.backward(bwd, sb, do, q, k, v, *o, alone))
    fns = {}
    for name, (f, b) in runs.items():
        fns[f"{name} fwd"] = f
        fns[f"{name} fwd+bwd"] = lambda f=f, b=b: b(f())
    flex = KERNELS["flex"]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fns["flex fwd"] = lambda: flex.forward(q, k, v, mask, SCALE)
    fns["flex fwd+bwd"] = lambda: torch.autograd.grad(flex.autograd_forward(*leaves, mask, SCALE), leaves, do)
    return fns


def whole_row_ms(row: Varlen, dev: torch.device) -> dict[str, float]:
    """The one-GPU FA2 varlen call on the whole row, all heads: forward and forward+backward milliseconds."""
    total = row.cu_q[-1]
    q, do = (torch.randn(1, total, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, total, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    flash = KERNELS["flash"]
    return burst_ms({"fwd": lambda: flash._forward(q, k, v, row, SCALE),
                     "fwd+bwd": lambda: flash._backward(do, q, k, v, *flash._forward(q, k, v, row, SCALE), row,
                                                        SCALE, False)}, dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--configs", default="allgather/balanced_whole,ring/balanced_whole")
    args = ap.parse_args()
    W, total, dev = args.world, 32768, torch.device("cuda")
    cu = packed_row(total, "lognormal", seed=7, multiple=2 * W)
    row = Varlen(cu, cu, (-1, 0))
    torch.manual_seed(0)
    whole = whole_row_ms(row, dev)
    print(f"whole row, FA2 varlen, 32 heads: {whole}", flush=True)
    dist.init_process_group("fake", rank=args.rank, world_size=W, store=FakeStore())
    rows = []
    for config in args.configs.split(","):
        for i, (q, k, v, mask) in enumerate(capture(config, total, cu, W)):
            share = cells(mask) / cells(row)
            segs = [b - a for a, b in itertools.pairwise(mask.cu_q)]
            desc = {"config": config, "call": i, "rows": q.shape[1], "keys": k.shape[1], "heads": q.shape[2],
                    "segments": sum(1 for s in segs if s), "longest_rows": max(segs), "longest_keys": mask.max_k,
                    "share_of_row_cells": round(share, 4)}
            print(json.dumps(desc), flush=True)
            ms = burst_ms(variants(q, k, v, mask), dev)
            for name, t in ms.items():
                mode = "fwd+bwd" if name.endswith("fwd+bwd") else "fwd"
                ideal = whole[mode] * share
                rec = dict(desc, variant=name, ms=round(t, 4), ideal_ms=round(ideal, 4),
                           efficiency=round(ideal / t, 3))
                rows.append(rec)
                print(f"  {name:<40} {t:8.3f} ms  ideal {ideal:7.3f}  eff {ideal / t:.2f}", flush=True)
    write_probe(args.out, rows, whole_row_ms=whole)


if __name__ == "__main__":
    main()
