"""The kernels alone at the shapes each method runs at short chunks: the bound a method's per-rank path can reach.

    python3 benchmarks/gpu/probe_shapes.py --out DIR [--packed]   (one GPU; about a minute)

For 16K tokens, causal, bf16, D 128, GQA 32/8 and MHA 32/32, rank 0 of W = 8 (2K tokens per rank) and W = 4: each
line times one kernel call (or a method's whole set of calls) back to back, 30 calls between two CUDA events, as
the fraction of the one-GPU cuDNN call on the full sequence divided by W (the bench's efficiency, kernels only):
- ``full``: cuDNN on the full sequence (the yardstick);
- ``ulysses``: cuDNN on the full sequence with H/W query heads and Hkv/W KV heads;
- ``ring-zigzag``: one causal 2L x 2L-chunk call and W - 1 full calls of half the rows or half the keys;
- ``allgather-zigzag``: the front chunk's causal call, and the back chunk against every key (full keys + causal
  square on cuDNN, or one bottom-right causal call on FA2).
With ``--packed``: the bench's packed rows (``seqpar.layouts.packing``, seed 7, documents rounded to 2W; 32K and 128K
lognormal, W = 8 and 4) on FA2 varlen, the one-GPU kernel of the packed presets: the whole row with all heads / W
against Ulysses' call, the whole row with H/W query and Hkv/W KV heads (``ulysses-varlen``).
Forward and backward are timed apart; DIR/shapes.jsonl has one record per line printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

aten = torch.ops.aten
dev = torch.device("cuda")
D, S, H = 128, 16384, 32


def _t(x):
    return x.transpose(1, 2)


def cudnn(q, k, v, causal):
    o, lse = aten._scaled_dot_product_cudnn_attention(_t(q), _t(k), _t(v), None, True, 0.0, causal, False)[:2]
    return _t(o), lse


def cudnn_bwd(q, k, v, causal):
    o, lse = cudnn(q, k, v, causal)
    seed = torch.empty(0, dtype=torch.int64, device=dev)
    do = torch.randn_like(o)

    def run():
        aten._scaled_dot_product_cudnn_attention_backward(_t(do), _t(q), _t(k), _t(v), _t(o), lse, seed, seed,
                                                          None, None, None, q.shape[1], k.shape[1], 0.0, causal,
                                                          scale=D ** -0.5)
    return run


def flash(q, k, v, causal):
    return aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False)[:2]


def flash_bwd(q, k, v, causal):
    o, lse = flash(q, k, v, causal)[:2]
    do = torch.randn_like(o)
    rng = torch.zeros(2, dtype=torch.int64, device=dev)

    def run():
        aten._flash_attention_backward(do, q, k, v, o, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, rng,
                                       rng)
    return run


def varlen(cu: tuple[int, ...], hq: int, hkv: int, bwd: bool):
    """One FA2 varlen call (causal) over a packed row with offsets ``cu``: a no-argument closure."""
    n = cu[-1]
    q, k, v = rand(n, hq)[0], rand(n, hkv)[0], rand(n, hkv)[0]
    c = torch.tensor(cu, dtype=torch.int32, device=dev)
    m = max(b - a for a, b in itertools.pairwise(cu))
    o, lse = aten._flash_attention_forward(q, k, v, c, c, m, m, 0.0, True, False)[:2]
    if not bwd:
        return lambda: aten._flash_attention_forward(q, k, v, c, c, m, m, 0.0, True, False)
    do, rng = torch.randn_like(o), torch.zeros(2, dtype=torch.int64, device=dev)
    return lambda: aten._flash_attention_backward(do, q, k, v, o, lse, c, c, m, m, 0.0, True, rng, rng)


def packed(out: Path) -> None:
    from seqpar.layouts.packing import packed_row
    for total in (32768, 131072):
        for W in (8, 4):
            cu = packed_row(total, "lognormal", seed=7, multiple=2 * W)
            for bwd in (False, True):
                limit = timed([varlen(cu, H, 8, bwd)]) / W
                ms = timed([varlen(cu, H // W, max(1, 8 // W), bwd)])
                rec = {"row": f"packed-{total // 1024}k-lognormal", "documents": len(cu) - 1, "W": W,
                       "tokens_per_rank": total // W, "pass": "bwd" if bwd else "fwd", "kind": "ulysses-varlen",
                       "ms": round(ms, 4), "limit_ms": round(limit, 4), "kernel_efficiency": round(limit / ms, 3)}
                print(json.dumps(rec), flush=True)
                with (out / "shapes.jsonl").open("a") as f:
                    f.write(json.dumps(rec) + "\n")


def rand(m, h):
    return torch.randn(1, m, h, D, device=dev, dtype=torch.bfloat16)


def timed(fns, iters=30, warmup=8) -> float:
    for _ in range(warmup):
        for f in fns:
            f()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(iters):
        for f in fns:
            f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def calls(kind: str, hq: int, hkv: int, W: int, bwd: bool):
    """The kernel calls (no-argument closures) of rank 0's share for ``kind``."""
    L, C = S // W, S // (2 * W)
    fwd_fn = {"cudnn": lambda *a: (lambda: cudnn(*a)), "flash": lambda *a: (lambda: flash(*a))}
    bwd_fn = {"cudnn": cudnn_bwd, "flash": flash_bwd}

    def mk(kern, m, n, h, hk, causal):
        return (bwd_fn if bwd else fwd_fn)[kern](rand(m, h), rand(n, hk), rand(n, hk), causal)

    if kind == "full":
        return [mk("cudnn", S, S, hq, hkv, True)]
    if kind == "ulysses":
        return [mk("cudnn", S, S, hq // W, hkv // W, True)]
    if kind == "ulysses-flash":
        return [mk("flash", S, S, hq // W, hkv // W, True)]
    if kind == "ring-zigzag":
        return [mk("cudnn", L, L, hq, hkv, True)] + [mk("cudnn", L, C, hq, hkv, False) for _ in range(W // 2 - 1)] \
            + [mk("cudnn", C, L, hq, hkv, False) for _ in range(W // 2)]
    if kind == "allgather-zigzag":
        return [mk("cudnn", C, C, hq, hkv, True), mk("cudnn", C, S - C, hq, hkv, False),
                mk("cudnn", C, C, hq, hkv, True)]
    if kind == "allgather-zigzag-flash":
        return [mk("cudnn", C, C, hq, hkv, True), mk("flash", C, S, hq, hkv, True)]
    raise ValueError(kind)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--packed", action="store_true", help="the packed rows on FA2 varlen only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.packed:
        packed(out)
        return
    kinds = ("ulysses", "ulysses-flash", "ring-zigzag", "allgather-zigzag", "allgather-zigzag-flash")
    for hkv in (8, 32):
        for W in (8, 4):
            for bwd in (False, True):
                limit = timed(calls("full", H, hkv, W, bwd)) / W
                for kind in kinds:
                    fns = calls(kind, H, hkv, W, bwd)
                    ms = timed(fns)
                    each = [round(timed([f]), 4) for f in fns] if len(fns) > 1 else []
                    rec = {"kv_heads": hkv, "W": W, "tokens_per_rank": S // W, "pass": "bwd" if bwd else "fwd",
                           "kind": kind, "ms": round(ms, 4), "limit_ms": round(limit, 4),
                           "kernel_efficiency": round(limit / ms, 3), "calls": len(fns), "each_ms": each}
                    print(json.dumps(rec), flush=True)
                    with (out / "shapes.jsonl").open("a") as f:
                        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
