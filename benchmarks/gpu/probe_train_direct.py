"""Would a whole training call on flex run faster as a TMA forward and a backward from the final rows than on flex's
own autograd? One GPU, W = 1.

    python3 benchmarks/gpu/probe_train_direct.py [--seqs 16384,131072] [--rounds 7]

At W = 1 a call that is one flex block runs as flex's own autograd op (``FlexKernel.autograd_forward``, Note
[Direct calls]): one ``kernel_options`` serves its forward and backward kernels, and TMA (Note [Flex on TMA]) speeds
the forward but slows the backward, so that path runs without it. The alternative timed here: the forward through
``FlexKernel.forward`` (on TMA, with its lse) and the backward through ``FlexKernel.backward`` (flex's backward
kernel from the final rows, without TMA), wrapped in an autograd function. The probe captures the whole call's mask
from ``seqpar.attention`` and times, in interleaved bursts (``burst_ms``), seqpar as committed and that split, for a
training forward (inputs that require grad, no backward) and forward+backward; the split's output and gradients are
compared with seqpar's. Cases: ``window_size=(4095, 0)`` causal, the sink window (4095 + 4 sinks), and at 16K a
generic ``mask_mod`` (the shared prefix as a function). GQA 32/8, D 128, bf16.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar import masks
from seqpar.bench.timing import burst_ms
from seqpar.kernels import KERNELS
from seqpar.kernels import flex as sp_flex

DEV = torch.device("cuda")
KERN = KERNELS["flex"]


class _Split(torch.autograd.Function):
    """The whole call: ``FlexKernel.forward`` (TMA on sm90), then ``FlexKernel.backward`` from the final rows."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        res = KERN.forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, res.out, res.lse)
        ctx.mask, ctx.scale = mask, scale
        return res.out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = KERN.backward(do.contiguous(), q, k, v, out, lse, ctx.mask, ctx.scale)
        return dq, dk, dv, None, None


def whole_call_mask(q, k, v, **kw):
    """The mask of the one flex block ``seqpar.attention(q, k, v, **kw)`` runs directly (its ``autograd_forward``)."""
    seen, direct = [], sp_flex.FlexKernel.autograd_forward

    def spy(self, q, k, v, mask, scale, softcap=0.0):
        seen.append((mask, scale))
        return direct(self, q, k, v, mask, scale, softcap)
    sp_flex.FlexKernel.autograd_forward = spy
    try:
        seqpar.attention(q, k, v, **kw)
    finally:
        sp_flex.FlexKernel.autograd_forward = direct
    if len(seen) != 1:
        raise RuntimeError(f"expected one direct flex call, saw {len(seen)}")
    return seen[0]


def cases(S: int) -> dict[str, dict]:
    out = {"window 4095": {"causal": True, "window_size": (4095, 0)},
           "sink window 4095 + 4": {"causal": False, "mask_mod": masks.sink_window(4095, 4)}}
    if S <= 16384:
        fn = masks.shared_prefix(S // 2, [S // 16] * 8).mod(DEV, S)
        out["generic mask_mod"] = {"causal": False, "mask_mod": lambda b, h, qi, ki: fn(b, h, qi, ki)}
    return out


def run_length(S: int, rounds: int) -> None:
    q = torch.randn(1, S, 32, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, S, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    leaves = (q, k, v)
    for name, kw in cases(S).items():
        kw = {**kw, "layout": "contiguous"}
        mask, scale = whole_call_mask(q, k, v, **kw)

        def ours(kw=kw):
            return seqpar.attention(*leaves, **kw)

        def split(mask=mask, scale=scale):
            return _Split.apply(*leaves, mask, scale)
        a, b = ours(), split()
        ga, gb = (torch.autograd.grad(x, leaves, do) for x in (a, b))
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip((a, *ga), (b, *gb)))
        fns = {"committed, train fwd": ours, "split, train fwd": split,
               "committed, fwd+bwd": lambda f=ours: f().backward(do),
               "split, fwd+bwd": lambda f=split: f().backward(do)}
        ms = burst_ms(fns, DEV, burst=5, rounds=rounds)
        for mode in ("train fwd", "fwd+bwd"):
            c, s = ms[f"committed, {mode}"], ms[f"split, {mode}"]
            print(f"S={S} {name:22s} {mode:9s} committed {c:8.3f} ms  split {s:8.3f} ms  ({s / c:.3f}x)  "
                  f"max |diff| {diff:.3g}", flush=True)
        for t in leaves:
            t.grad = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="16384,131072", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for S in args.seqs:
        run_length(S, args.rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
