"""Does a kernel's time depend on its data? A fake group's receive buffers are never written, so an emulated rank
computes every step but its own on whatever those buffers held. This times one-GPU cuDNN attention (bf16, D 128,
32 query heads) with random keys and values against zeros and against a never-written fresh buffer, at long and
short lengths, forward and forward+backward, median of 10 after warm-up (``seqpar.bench.timing.time_ms``).

    python3 benchmarks/gpu/probe_fake_data.py [--seqs 2048,8192,32768] [--kv-heads 8]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from seqpar.bench.timing import time_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="2048,8192,32768")
    ap.add_argument("--kv-heads", type=int, default=8)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for S in map(int, args.seqs.split(",")):
        print(f"S={S} Hkv={args.kv_heads}: " + " | ".join(row(S, args.kv_heads, kind) for kind in KINDS), flush=True)


KINDS = {"random": torch.randn, "zeros": torch.zeros, "fresh": torch.empty}


def row(S: int, kv_heads: int, kind: str, H: int = 32) -> str:
    """One kind of keys and values (random, zeros, a never-written buffer) against random queries."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(1, H, S, 128, device=dev, dtype=dt)
    do = torch.randn_like(q)
    k, v = (KINDS[kind]((1, kv_heads, S, 128), device=dev, dtype=dt) for _ in range(2))

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def fb():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        return torch.autograd.grad(o, leaves, do)

    return f"{kind} fwd {time_ms(fwd, dev, iters=10):.3f} ms fwd+bwd {time_ms(fb, dev, iters=10):.3f} ms"

if __name__ == "__main__":
    main()
