"""On a real NCCL group: graphed calls (captured, then replayed with new inputs) give the eager call's out and
gradients, for the methods whose transfers differ in kind - the ring's P2P, Ulysses' all-to-all, all-gather's
coalesced all-gathers and reduce-scatters by parts (Note [Coalesced parts] in ``seqpar.comm.all_gather``).

    torchrun --nproc-per-node 4 benchmarks/gpu/graphed_equal_real.py

Prints one line per method and exits 1 if any differs. GQA 32/8, D 128, bf16, 2K tokens per rank, causal, zigzag.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import seqpar


def step(method: str, graphs: bool, seed: int, rank: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """One call forward+backward on inputs drawn from ``seed``: ``(out, dq, dk, dv)``."""
    g = torch.Generator(device=dev).manual_seed(1000 * seed + rank)
    q, k, v, do = (torch.randn(1, 2048, h, 128, device=dev, dtype=torch.bfloat16, generator=g) for h in (32, 8, 8, 32))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = seqpar.attention(q, k, v, causal=True, method=method, layout=None if method == "ulysses" else "zigzag",
                           graphs=graphs)
    return (out, *torch.autograd.grad(out, leaves, do))


def main() -> None:
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, W = dist.get_rank(), dist.get_world_size()
    bad = 0
    for method in ("allgather", "ring", "ulysses"):
        worst = 0.0
        for seed in range(6):                   # eager, captured, then replays with new inputs
            got, want = step(method, True, seed, rank, dev), step(method, False, seed, rank, dev)
            worst = max(worst, max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want)))
        bad += worst != 0.0
        print(f"[rank {rank}] {method}: graphed vs eager over 6 calls (W = {W}): max |diff| {worst:.3g} "
              f"{'EQUAL' if worst == 0.0 else 'DIFFERS'}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
