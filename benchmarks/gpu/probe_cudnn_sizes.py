"""cuDNN attention (PyTorch's SDPA backend) on one block of TASP's and the ring's shapes: forward and backward
microseconds for query x key sizes on and off multiples of 128, K/V contiguous or viewed out of one packed KV
buffer (TASP's wire layout).

    python3 benchmarks/gpu/probe_cudnn_sizes.py [--packed]

32 query heads, head dim 128, bf16, one H100; 3 warm-up calls, mean of 20 between CUDA events.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, D = 32, 128
#: (query rows, keys): the ring's 2K-per-rank blocks, TASP's padded ones (16464 tokens over 8), and TASP's M/P
#: calls of a rank between the ends (keys a sum of sub-chunks)
SHAPES = ((1024, 2048), (1024, 2058), (1024, 2112), (1024, 2176), (1029, 2048), (1029, 2058), (1088, 2048),
          (2048, 438), (2048, 448), (2048, 512), (2048, 384), (2048, 1168), (2048, 1152), (2048, 1216))


def kv(S: int, packed: bool, hk: int):
    if packed:
        buf = torch.randn(S, 1, hk, 2 * D, device="cuda", dtype=torch.bfloat16)
        return buf[..., :D].permute(1, 0, 2, 3), buf[..., D:].permute(1, 0, 2, 3)
    return tuple(torch.randn(1, S, hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))


def us(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n * 1e3


def block(L: int, S: int, packed: bool, hk: int) -> tuple[float, float, tuple[int, ...]]:
    """(forward us, backward us, K's strides) of one ``L`` x ``S`` call."""
    q = torch.randn(1, L, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = kv(S, packed, hk)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = us(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hk != H))
        qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
        out = F.scaled_dot_product_attention(qg, kg, vg, enable_gqa=hk != H)
        do = torch.randn_like(out)
        bwd = us(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
    return fwd, bwd, tuple(k.stride())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packed", action="store_true", help="also K/V viewed out of one packed buffer, and 8 KV heads")
    args = ap.parse_args()
    for hk in (32, 8) if args.packed else (32,):
        for L, S in SHAPES:
            for packed in (False, True) if args.packed else (False,):
                fwd, bwd, strides = block(L, S, packed, hk)
                print(f"hk {hk} {L}x{S} {'packed KV' if packed else 'contiguous'}: fwd {fwd:.1f} us, bwd {bwd:.1f} us "
                      f"(k strides {strides})", flush=True)


if __name__ == "__main__":
    main()
