"""No-grad windowed calls at lengths a server meets: does flex compile once, and how fast is it against FA2?

    python3 benchmarks/gpu/probe_flex_dynamic.py [--lengths 16384,20000,...]

One GPU, W = 1, bf16, GQA 32/8, D 128, ``window_size=(4095, 0)`` through ``seqpar.attention`` without grad:
``auto`` (flex: per shape for the first ``STATIC_SHAPES`` lengths, then compiled once for every shape, Note [Flex
recompiles]) and ``kernel="flash"`` (FA2, auto's choice before). Per length: the first call's seconds (a compile,
or none), the median of 10 calls, ms, and dynamo's count of frames compiled so far. Then the same window through
``torch.compile(flex_attention)`` compiled per shape and once for every shape on the first length (the kernels'
own speed, block mask from seqpar).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import time_ms

H, HKV, D, WINDOW = 32, 8, 128, (4095, 0)


def timed(fn) -> float:
    """Median of 10 calls, ms (after a warm-up call)."""
    return time_ms(fn, torch.device("cuda"), warmup=1, iters=10)


def first(fn) -> float:
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="16384,20000,24576,131072,8192,12288,10000,14000,15000,17000,18000")
    args = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    from torch._dynamo.utils import counters
    for n in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, n, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        res = {}
        for kernel in ("auto", "flash"):
            def call(kernel=kernel, q=q, k=k, v=v):
                with torch.no_grad():
                    return seqpar.attention(q, k, v, method="ring", window_size=WINDOW, kernel=kernel,
                                            check_ranks=False)
            res[kernel] = (first(call), timed(call))
        print(f"S={n}: auto first {res['auto'][0]:.2f} s, {res['auto'][1]:.3f} ms | FA2 first {res['flash'][0]:.2f} s, "
              f"{res['flash'][1]:.3f} ms | auto / FA2 {res['auto'][1] / res['flash'][1]:.3f} | frames compiled so far "
              f"{counters['stats']['unique_graphs']}", flush=True)
    from seqpar.kernels import flex as flex_mod
    from seqpar.masks import Band
    n = int(args.lengths.split(",")[0])
    q, k, v = (torch.randn(1, h, n, D, device="cuda", dtype=torch.bfloat16) for h in (H, HKV, HKV))
    bm = flex_mod._block_mask(Band(-WINDOW[0], 0), n, n, q.device)
    for dyn in (False, True):
        f = flex_mod._compiled(dyn)
        with torch.no_grad():
            s = first(lambda f=f: f(q, k, v, block_mask=bm, enable_gqa=True))
            ms = timed(lambda f=f: f(q, k, v, block_mask=bm, enable_gqa=True))
        print(f"flex directly, S={n}, dynamic={dyn}: first {s:.2f} s, {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
