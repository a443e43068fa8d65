"""A training step's forward (inputs that require grad, no backward yet), seqpar at W = 1 against flex called directly
with the same mask: the GPU kernels of each, to see where the masks issue's 1.07-1.12x comes from.

    python3 benchmarks/gpu/probe_train_fwd.py [--seq 16384]      (one GPU, under a minute)

A causal window of 4095 keys (``window_size=(4095, 0)``), GQA 32/8, D 128, bf16. Prints, per side, the time of a
training forward and of a no-grad forward (CUDA events, median of 20 after warm-up) and torch.profiler's CUDA kernels
of one training forward.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import rank_median_ms

FLEX = torch.compile(flex_attention, dynamic=False)


def ms(fn) -> float:
    """Median ms of ``fn`` over 20 calls after 5 (``seqpar.bench.timing``'s CUDA-event timing)."""
    return rank_median_ms(fn, torch.device("cuda"), warmup=5, iters=20)


def kernels(fn) -> str:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]
    return "\n".join(f"    {us:9.1f} us  {name[:110]}" for name, us in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=16384)
    args = ap.parse_args()
    S, dev = args.seq, torch.device("cuda")
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    q = torch.randn(1, S, 32, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, S, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    bm = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= 4095), None, None, S, S, device=dev)

    def flex():
        return FLEX(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, enable_gqa=True)

    def ours():
        return seqpar.attention(q, k, v, causal=True, window_size=(4095, 0), layout="contiguous")

    for name, fn in (("flex", flex), ("seqpar", ours)):
        def no_grad(fn=fn):
            with torch.no_grad():
                fn()
        print(f"{name}: training forward {ms(fn):.3f} ms, no-grad forward {ms(no_grad):.3f} ms", flush=True)
        print(kernels(fn), flush=True)
    # which half differs: seqpar's block mask (its tiles) or its mask_mod (bounds read from a tensor)
    from seqpar.kernels import flex as sp_flex
    from seqpar.masks import Band

    band = Band(-4095, 0)
    ours_bm = sp_flex._block_mask(band, S, S, dev)
    ours_mod = sp_flex._mask_mod(band, S, S, dev)
    for bm_name, block in (("flex's block mask", bm), ("seqpar's block mask", ours_bm)):
        for mod_name, mod in (("its own mask_mod", block.mask_mod), ("seqpar's band mask_mod", ours_mod)):
            mixed = type(block)(*[getattr(block, f) for f in ("seq_lengths", "kv_num_blocks", "kv_indices",
                                                             "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                                                             "q_indices", "full_q_num_blocks", "full_q_indices",
                                                             "BLOCK_SIZE")], mod)

            def run(mixed=mixed):
                with torch.no_grad():
                    FLEX(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mixed, enable_gqa=True)
            print(f"no-grad forward, {bm_name}, {mod_name}: {ms(run):.3f} ms; full tiles "
                  f"{int(block.full_kv_num_blocks.sum())}, partial {int(block.kv_num_blocks.sum())}", flush=True)


if __name__ == "__main__":
    main()
