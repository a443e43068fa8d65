"""Where a training forward's 1.07-1.12x over flex comes from: the same window's forward built up step by step from
flex called directly to ``seqpar.attention``, one GPU, W = 1.

    python3 benchmarks/gpu/probe_train_fwd_paths.py [--seqs 16384,131072] [--rounds 2]

``window_size=(4095, 0)``, causal, GQA 32/8, D 128, bf16, inputs that require grad (a training step's forward, no
backward). Each path is timed in turn (CUDA events, median of 20 after 5), all paths ``--rounds`` times over, so a
difference that repeats is not the order's: flex directly; with seqpar's scale passed; with seqpar's block mask and
mask_mod; through seqpar's compiled flex (``_flex``: its recompile guard); ``FlexKernel.autograd_forward``;
``seqpar.attention`` with and without the agreement round. Then torch.profiler's CUDA kernels of one call of the
first and last paths.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from probe_train_fwd import kernels  # this script's directory is on sys.path
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import rank_median_ms
from seqpar.kernels import flex as sp_flex
from seqpar.masks import Band

FLEX = torch.compile(flex_attention, dynamic=False)
DEV = torch.device("cuda")


def paths(S: int) -> dict:
    q = torch.randn(1, S, 32, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, S, 8, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ref = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= 4095), None, None, S, S, device=DEV,
                            _compile=True)                      # eager holds S x S scores: 128 GiB at 128K
    band = Band(-4095, 0)
    ours_bm = sp_flex._block_mask(band, S, S, DEV)
    scale = 128 ** -0.5
    kern = sp_flex.FlexKernel()

    def band_mod(dtype):
        bounds = torch.tensor([-4095, 0], device=DEV, dtype=dtype)

        def mod(b, h, qi, ki):
            d = ki - qi
            return (d >= bounds[0]) & (d <= bounds[1])
        return mod

    def crossed(block, mod):
        return type(block)(*[getattr(block, f) for f in ("seq_lengths", "kv_num_blocks", "kv_indices",
                                                         "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                                                         "q_indices", "full_q_num_blocks", "full_q_indices",
                                                         "BLOCK_SIZE")], mod)
    def call(bm):
        return lambda: FLEX(qt, kt, vt, block_mask=bm, scale=scale, enable_gqa=True)
    cross = {f"{bm_name} + {mod_name}": call(crossed(block, mod))
             for bm_name, block in (("flex's tiles", ref), ("seqpar's tiles", ours_bm))
             for mod_name, mod in (("flex's mod", ref.mask_mod), ("int64 bounds", band_mod(torch.int64)),
                                   ("int32 bounds", band_mod(torch.int32)))}
    return {**cross,
        "flex directly": lambda: FLEX(qt, kt, vt, block_mask=ref, enable_gqa=True),
        "+ scale=": lambda: FLEX(qt, kt, vt, block_mask=ref, scale=scale, enable_gqa=True),
        "+ seqpar's block mask": lambda: FLEX(qt, kt, vt, block_mask=ours_bm, scale=scale, enable_gqa=True),
        "+ seqpar's _flex": lambda: sp_flex._flex(DEV, False)(qt, kt, vt, block_mask=ours_bm, scale=scale,
                                                             enable_gqa=True),
        "FlexKernel.autograd_forward": lambda: kern.autograd_forward(q, k, v, band, scale),
        "seqpar.attention, no agreement": lambda: seqpar.attention(q, k, v, causal=True, window_size=(4095, 0),
                                                                   check_ranks=False),
        "seqpar.attention": lambda: seqpar.attention(q, k, v, causal=True, window_size=(4095, 0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="16384,131072", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for S in args.seqs:
        fns = paths(S)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(rank_median_ms(fn, DEV, warmup=5, iters=20))
        base = min(times["flex directly"])
        for name, ts in times.items():
            print(f"S={S} {name:34s} " + " / ".join(f"{t:.3f}" for t in ts) + f" ms  ({min(ts) / base:.3f}x)",
                  flush=True)
        for name in ("flex directly", "seqpar.attention"):
            print(f"S={S} kernels of {name}:\n{kernels(fns[name])}", flush=True)
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
