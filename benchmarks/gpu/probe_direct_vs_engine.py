"""A W = 1 training call on flex: flex's own autograd (the direct path, Note [Direct calls]) against seqpar's engine
(``FlexKernel.forward`` on TMA for bands, then flex's backward from the final rows), both through
``seqpar.attention`` - the engine reached by asking for the lse too (``return_lse=True``, lse unused).

    python3 benchmarks/gpu/probe_direct_vs_engine.py [--seqs 16384,131072] [--rounds 5]

Cases: ``window_size=(4095, 0)`` causal and the sink window (4095 + 4 sinks); GQA 32/8, D 128, bf16; interleaved
bursts (``burst_ms``) of a training forward (inputs that require grad, no backward) and forward+backward.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar import masks
from seqpar.bench.timing import burst_ms

DEV = torch.device("cuda")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="16384,131072", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for S in args.seqs:
        q = torch.randn(1, S, 32, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, S, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        for name, kw in {"window 4095": {"causal": True, "window_size": (4095, 0)},
                         "sink window 4095 + 4": {"causal": False, "mask_mod": masks.sink_window(4095, 4)}}.items():
            kw = {**kw, "layout": "contiguous"}

            def direct(kw=kw, t=(q, k, v)):
                return seqpar.attention(*t, **kw)

            def engine(kw=kw, t=(q, k, v)):
                return seqpar.attention(*t, return_lse=True, **kw).out
            a, b = direct(), engine()
            diff = (a.float() - b.float()).abs().max().item()
            fns = {"direct, train fwd": direct, "engine, train fwd": engine,
                   "direct, fwd+bwd": lambda f=direct, g=do: f().backward(g),
                   "engine, fwd+bwd": lambda f=engine, g=do: f().backward(g)}
            ms = burst_ms(fns, DEV, burst=5 if S <= 16384 else 2, rounds=args.rounds)
            for mode in ("train fwd", "fwd+bwd"):
                d, e = ms[f"direct, {mode}"], ms[f"engine, {mode}"]
                print(f"S={S} {name:22s} {mode:9s} direct {d:8.3f} ms  engine {e:8.3f} ms  ({e / d:.3f}x)  "
                      f"max |diff| {diff:.3g}", flush=True)
            for t in (q, k, v):
                t.grad = None
        del q, k, v, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
