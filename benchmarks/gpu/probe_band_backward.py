"""A wide band's backward on flex or on FA2, by KV heads (Note [Band backward on few KV heads] in
``seqpar.kernels.executor``).

    python3 benchmarks/gpu/probe_band_backward.py --out DIR [--sizes 16384,131072] [--heads 4/1,8/2,16/4,32/8]
        [--worlds 8,4]

Section "w1": the sink window (4095 + 4 sinks) at W = 1 on each head count (query / KV heads: 4/1 is Ulysses' share
of GQA 32/8 over 8 ranks), three ways: ``flex`` (``BAND_BWD_KV_HEADS = 0``: forward and backward on flex, the direct
path), ``split`` (``BAND_BWD_KV_HEADS`` unbounded: forward on flex, the backward's blocks apart with the band on FA2)
and ``fa2`` (``kernel="flash"``); a training step's forward and forward+backward (median ms), and the largest
differences of out, dq, dk and dv of ``split`` and ``fa2`` from ``flex``.
Section "ulysses": rank 0 of W under Ulysses on a fake group (communication free, the pool seeded), causal and the
sink window, ``flex`` against ``split``, efficiency against seqpar at W = 1 on the same mask (32/8 heads).
Every record is one JSON line in DIR/band_backward.jsonl. bf16, D 128.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import masks_1gpu as M

import seqpar
from seqpar import masks
from seqpar.bench.timing import free_cached, time_ms
from seqpar.kernels import flex, select
from seqpar.runtime import call as _call

WAYS = {"flex": (0, "auto"), "split": (1 << 30, "auto"), "fa2": (flex.BAND_BWD_KV_HEADS, "flash")}


def emit(out: Path, **rec) -> None:
    print(json.dumps(rec), flush=True)
    with (out / "band_backward.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")


def use(way: str) -> str:
    """Set the backward rule of ``way``, drop every plan and kernel choice made under another; its ``kernel=``."""
    flex.BAND_BWD_KV_HEADS, kernel = WAYS[way]
    _call.cache_clear()
    select.cache_clear()
    return kernel


def train(call, t, args) -> tuple[float, float]:
    """Median ms of a training step's forward (inputs that require grad) and of forward+backward."""
    q, k, v, do = t
    return (time_ms(lambda: call(q, k, v), M.dev, warmup=args.warmup, iters=args.iters),
            time_ms(lambda: call(q, k, v).backward(do), M.dev, warmup=args.warmup, iters=args.iters))


def grads(call, t) -> list[torch.Tensor]:
    q, k, v, do = t
    for x in (q, k, v):
        x.grad = None
    out = call(q, k, v)
    out.backward(do)
    return [out.detach().float(), *(x.grad.float() for x in (q, k, v))]


def w1(args, out: Path) -> None:
    M.group(1)
    m = masks.sink_window(4095, 4)
    for S in args.sizes:
        for heads, kv in args.heads:
            t = M.inputs(S, heads=heads, kv=kv)
            ref, rec = None, {}
            for way in WAYS:
                call = M.ours_call(causal=False, mask_mod=m, layout="contiguous", kernel=use(way))
                got = grads(call, t)
                if ref is None:
                    ref = got
                else:
                    rec[f"{way}_max_diff"] = [round((a - b).abs().max().item(), 5) for a, b in zip(got, ref)]
                fwd, fb = train(call, t, args)
                rec[f"{way}_train_fwd_ms"], rec[f"{way}_fb_ms"] = round(fwd, 3), round(fb, 3)
                del got
            emit(out, section="w1", label="W = 1", mask="sink_window", seq_len=S, heads=heads, kv_heads=kv,
                 split_over_flex_fb=round(rec["split_fb_ms"] / rec["flex_fb_ms"], 3), **rec)
            del t, ref
            torch.cuda.empty_cache()


def ulysses(args, out: Path) -> None:
    S = max(args.sizes)
    for name, causal, m in (("causal", True, None), ("sink_window", False, masks.sink_window(4095, 4))):
        M.group(1)
        use("flex")
        t = M.inputs(S)
        base = train(M.ours_call(causal=causal, mask_mod=m, layout="contiguous"), t, args)
        del t
        torch.cuda.empty_cache()
        for W in args.worlds:
            M.group(W, 0)
            for way in ("flex", "split"):
                kernel = use(way)
                free_cached(M.dev, seed=True)
                t = M.inputs(S // W)
                fwd, fb = train(M.ours_call(causal=causal, mask_mod=m, method="ulysses", layout="contiguous",
                                            check_ranks=False, kernel=kernel), t, args)
                emit(out, section="ulysses", label=f"emulated W = {W} (rank 0 of {W}, fake group)", mask=name,
                     way=way, seq_len=S, emulated_world=W, tokens_per_rank=S // W, heads=M.H, kv_heads=M.HKV,
                     w1_train_fwd_ms=round(base[0], 3), w1_fb_ms=round(base[1], 3), rank_train_fwd_ms=round(fwd, 3),
                     rank_fb_ms=round(fb, 3), compute_efficiency_fwd=round(base[0] / W / fwd, 3),
                     compute_efficiency_fb=round(base[1] / W / fb, 3))
                del t
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="w1,ulysses")
    ap.add_argument("--sizes", default="16384,131072", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--heads", default="4/1,8/2,16/4,32/8",
                    type=lambda t: [tuple(int(y) for y in x.split("/")) for x in t.split(",")])
    ap.add_argument("--worlds", default="8,4", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    emit(out, section="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(), seqpar=seqpar.__version__,
         command=" ".join(sys.argv), band_bwd_kv_heads=flex.BAND_BWD_KV_HEADS)
    for name in args.sections.split(","):
        {"w1": w1, "ulysses": ulysses}[name](args, out)


if __name__ == "__main__":
    main()
