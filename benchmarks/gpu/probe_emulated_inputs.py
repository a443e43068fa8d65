"""What an emulated rank's kernel reads, and how fast cuDNN runs on it: Ulysses at 128K over 8 (rank 0 of 8 on a
fake group, the allocator's pool seeded as the bench seeds it, Note [Emulated data]).

    python3 benchmarks/gpu/probe_emulated_inputs.py [--out FILE] [--total 131072] [--world 8]

Times ``seqpar.attention`` forward (bursts of 3, median of 5) and, beside it, cuDNN's forward on the very tensors the
call handed its kernel (captured from the last warm-up call), on clones of them, and on fresh normal samples of the
same shapes and strides; prints each captured input's statistics per rank slot (the rows that rank received).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.report import write_probe
from seqpar.bench.timing import burst_ms, free_cached
from seqpar.kernels.sdpa import CudnnKernel

H, HKV, D = 32, 8, 128


def stats(name: str, x: torch.Tensor, W: int) -> dict:
    """Per rank slot of the sequence (dim 1): mean |x|, std, fraction of exact zeros."""
    rows = []
    for part in x.float().chunk(W, 1):
        rows.append({"mean_abs": round(part.abs().mean().item(), 4), "std": round(part.std().item(), 4),
                     "zeros": round((part == 0).float().mean().item(), 4)})
    print(f"{name} {tuple(x.shape)} strides {x.stride()}: " + " ".join(
        f"[{r['mean_abs']:.3f} {r['std']:.3f} {r['zeros']:.2f}]" for r in rows), flush=True)
    return {"tensor": name, "shape": list(x.shape), "stride": list(x.stride()), "slots": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--total", type=int, default=131072)
    ap.add_argument("--world", type=int, default=8)
    args = ap.parse_args()
    W, S, dev = args.world, args.total, torch.device("cuda")
    dist.init_process_group("fake", rank=0, world_size=W, store=FakeStore())
    free_cached(dev, seed=True)
    full = [torch.randn(1, S, h, D, device=dev, dtype=torch.bfloat16) for h in (H, HKV, HKV)]
    q, k, v = (seqpar.shard(t, method="ulysses") for t in full)
    del full
    seen = []
    fwd, direct = CudnnKernel._fwd, CudnnKernel.autograd_forward

    def spy(q, k, v, causal, scale):
        seen[:] = [q, k, v]
        return fwd(q, k, v, causal, scale)

    def spy_direct(self, q, k, v, mask, scale):
        seen[:] = [q, k, v]
        return direct(self, q, k, v, mask, scale)

    def call():
        with torch.no_grad():
            return seqpar.attention(q, k, v, method="ulysses", causal=True, check_ranks=False)

    CudnnKernel._fwd, CudnnKernel.autograd_forward = staticmethod(spy), spy_direct
    for _ in range(3):
        call()
    CudnnKernel._fwd, CudnnKernel.autograd_forward = staticmethod(fwd), direct
    cq, ck, cv = seen
    causal, scale = True, D ** -0.5
    rows = [stats(n, t, W) for n, t in (("q", cq), ("k", ck), ("v", cv))]

    def fresh(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).normal_()

    clones = [t.clone() for t in (cq, ck, cv)]
    randn = [fresh(t) for t in (cq, ck, cv)]
    fns = {"seqpar.attention ulysses": call,
           "cuDNN on the captured inputs": lambda: fwd(cq, ck, cv, causal, scale),
           "cuDNN on clones of them": lambda: fwd(*clones, causal, scale),
           "cuDNN on fresh normal samples": lambda: fwd(*randn, causal, scale)}
    ms = burst_ms(fns, dev, burst=3, rounds=5)
    for name, t in ms.items():
        print(f"{name:<34} {t:9.3f} ms", flush=True)
        rows.append({"variant": name, "ms": round(t, 4)})
    write_probe(args.out, rows)


if __name__ == "__main__":
    main()
