"""Does flex compiled with dynamic shapes run a no-grad windowed forward as fast as one compiled per shape?

    python3 benchmarks/gpu/probe_flex_dynamic.py [--lengths 16384,131072,20000,100000]

One GPU, W = 1, bf16, GQA 32/8, D 128, causal window (4095, 0). For each length: the first call's seconds (the
compile, or a reuse) of ``torch.compile(flex_attention, dynamic=True)`` and of a ``dynamic=False`` one, then the
medians of 10 no-grad forwards of each, and FA2 (``aten._flash_attention_forward`` with the window) for scale.
Prints one line per length.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

H, HKV, D, LEFT = 32, 8, 128, 4095
torch._dynamo.config.recompile_limit = 64


def window(b, h, q, kv):
    return (kv <= q) & (q - kv <= LEFT)


def timed(fn, n=10) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384,131072,20000,100000")
    args = ap.parse_args()
    dyn = torch.compile(flex_attention, dynamic=True)
    static = torch.compile(flex_attention, dynamic=False)
    for n in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        bm = create_block_mask(window, None, None, n, n, device="cuda", _compile=True)
        res = {}
        for name, f in (("dynamic", dyn), ("static", static)):
            with torch.no_grad():
                t0 = time.perf_counter()
                f(q, k, v, block_mask=bm, enable_gqa=True)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                res[name] = (first, timed(lambda f=f, q=q, k=k, v=v, bm=bm: f(q, k, v, block_mask=bm, enable_gqa=True)))
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        with torch.no_grad():
            fa2 = timed(lambda qt=qt, kt=kt, vt=vt, n=n: torch.ops.aten._flash_attention_forward(
                qt, kt, vt, None, None, n, n, 0.0, True, False, window_size_left=LEFT, window_size_right=0))
        print(f"S={n}: dynamic first {res['dynamic'][0]:.2f} s, {res['dynamic'][1]:.3f} ms | static first "
              f"{res['static'][0]:.2f} s, {res['static'][1]:.3f} ms | FA2 {fa2:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
