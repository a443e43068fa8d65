"""Where a packed one-GPU forward+backward holds its memory: seqpar against PyTorch's FA2 varlen kernel.

    torchrun --nproc-per-node 1 benchmarks/gpu/probe_packed_memory.py --out DIR

The packed bench's 128K lognormal row (GQA 32/8, D 128, bf16, causal): the peak allocated bytes of one
forward+backward of each path beyond its inputs, and a CUDA allocator history of seqpar's call
(``DIR/seqpar_packed_128k.pickle``, for ``torch.cuda.memory._snapshot`` tools) to show what is live at the
peak.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.distributed as dist

import seqpar
from seqpar.layouts.packing import packed_row

aten = torch.ops.aten


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=1 << 17)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    S, H, Hkv, D = args.tokens, 32, 8, 128
    cu = packed_row(S, "lognormal", seed=7, multiple=2)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, D, device=dev, dtype=torch.bfloat16, generator=g) for h in (H, Hkv, Hkv, H))
    cu_d = torch.tensor(cu, dtype=torch.int32, device=dev)
    mx = max(b - a for a, b in itertools.pairwise(cu))

    def fa2():
        o, lse, rng, unused, _ = aten._flash_attention_forward(q[0], k[0], v[0], cu_d, cu_d, mx, mx, 0.0, True, False)
        return aten._flash_attention_backward(do[0], q[0], k[0], v[0], o, lse, cu_d, cu_d, mx, mx, 0.0, True, rng,
                                              unused)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def ours(method: str):
        def fn():
            out = seqpar.attention(*leaves, method=method, layout="balanced", cu_seqlens=cu_d)
            return torch.autograd.grad(out, leaves, do)
        return fn

    for name, fn in (("fa2-varlen", fa2), ("seqpar ring/balanced", ours("ring")),
                     ("seqpar allgather/balanced", ours("allgather"))):
        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        if name == "seqpar ring/balanced":
            torch.cuda.memory._record_memory_history(max_entries=200000)
        res = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev) - base
        if name == "seqpar ring/balanced":
            torch.cuda.memory._dump_snapshot(os.path.join(args.out, "seqpar_packed_128k.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        del res
        print(f"{name}: peak {peak / 2**30:.3f} GiB beyond the inputs ({base / 2**30:.3f} GiB held)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
