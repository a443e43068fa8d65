"""Why an emulated rank's flex call runs slower per query row than the same mask's one call at W = 1, and whether
flex's kernel options change it. One GPU.

    python3 benchmarks/gpu/probe_rank_flex.py [--seq 131072] [--world 8] [--rank 1] [--rounds 7]
        [--mask sink_window:4095,4] [--layout contiguous]

The sink window under the all-gather (rank 1 of 8 on a fake group, contiguous, 16K query rows against the joined
sink, neighbour and own keys) read 2.97 ms of flex kernel against 21.28 / 8 = 2.66 at W = 1 (twenty-eighth session).
The probe runs ``seqpar.attention`` (no grad) once per case - W = 1 on the whole sequence, the emulated rank - and
captures the arguments of its flex call (``FlexKernel._run`` or, for a direct call, ``autograd_forward``: rows,
keys, the block mask). It then times flex called directly on them, in interleaved bursts, with flex's default kernel
for the shape and with kernel options: TMA, other tile shapes, stages and warps. Prints ms per call and per 16K
query rows (the rank's share of W = 1 is its 16K rows).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import flex_attention
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar.bench.timing import burst_ms
from seqpar.kernels import flex as sp_flex
from seqpar.planner.cli import _mask

FLEX = torch.compile(flex_attention, dynamic=False)
DEV = torch.device("cuda")
OPTIONS = {
    "default (128x64, 3 stages, 8 warps on H100)": {},
    "USE_TMA": {"USE_TMA": True},
    "128x128, 2 stages, 8 warps": {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 2, "num_warps": 8},
    "64x128, 3 stages, 4 warps": {"BLOCK_M": 64, "BLOCK_N": 128, "num_stages": 3, "num_warps": 4},
    "128x64, 4 stages, 8 warps": {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 4, "num_warps": 8},
    "ROWS_GUARANTEED_SAFE": {"ROWS_GUARANTEED_SAFE": True},
}


def captured(world: int, rank: int, S: int, mask, **where) -> list[tuple]:
    """The (q, k, v, mask, scale) of every flex call one no-grad ``seqpar.attention`` makes as ``rank`` of
    ``world`` on a fake group, on random rows."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    calls, run, direct = [], sp_flex.FlexKernel._run, sp_flex.FlexKernel.autograd_forward

    def spy(self, q, k, v, m, scale, softcap, tma=False):
        calls.append((q, k, v, m, scale))
        return run(self, q, k, v, m, scale, softcap, tma)

    def spy_direct(self, q, k, v, m, scale, softcap=0.0):
        calls.append((q, k, v, m, scale))
        return direct(self, q, k, v, m, scale, softcap)
    x = [torch.randn(1, S, h, 128, device=DEV, dtype=torch.bfloat16) for h in (32, 8, 8)]
    q, k, v = (seqpar.shard(t, causal=False, mask_mod=mask, **where) for t in x)
    sp_flex.FlexKernel._run, sp_flex.FlexKernel.autograd_forward = spy, spy_direct
    try:
        with torch.no_grad():
            seqpar.attention(q, k, v, causal=False, mask_mod=mask, check_ranks=False, **where)
    finally:
        sp_flex.FlexKernel._run, sp_flex.FlexKernel.autograd_forward = run, direct
    return calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mask", type=_mask, default=_mask("sink_window:4095,4"))
    ap.add_argument("--method", default="allgather")
    ap.add_argument("--layout", default="contiguous")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, mask {args.mask!r}", flush=True)
    cases = {"W = 1": (1, 0, {"layout": "contiguous"}),
             f"rank {args.rank} of {args.world}": (args.world, args.rank,
                                                   {"method": args.method, "layout": args.layout})}
    for case, (world, rank, where) in cases.items():
        calls = captured(world, rank, args.seq, args.mask, **where)
        print(f"{case}: {len(calls)} flex call(s): " + ", ".join(
            f"{tuple(q.shape)} x {tuple(k.shape)} {type(m).__name__}" for q, k, _, m, _ in calls), flush=True)
        q, k, v, m, scale = max(calls, key=lambda c: c[0].shape[1])
        bm = sp_flex._block_mask(m, q.shape[1], k.shape[1], DEV)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        fns = {name: (lambda o=opts, a=(qt, kt, vt), b=bm, s=scale: FLEX(*a, block_mask=b, scale=s, enable_gqa=True,
                                                                        kernel_options=o or None))
               for name, opts in OPTIONS.items()}
        ok = {}
        for name, fn in fns.items():
            try:
                with torch.no_grad():
                    fn()
                ok[name] = fn
            except Exception as e:           # a probe: an option this torch or GPU refuses is reported
                print(f"{case} {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        with torch.no_grad():
            ms = burst_ms(ok, DEV, burst=5, rounds=args.rounds)
        tiles = int(bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None
                                              else 0))
        for name, t in ms.items():
            print(f"{case} {name:44s} {t:8.3f} ms  {t / q.shape[1] * 16384:7.3f} ms per 16K rows  "
                  f"{t / tiles * 1e3:6.3f} us per tile ({tiles} tiles)", flush=True)
        del calls, fns, ok
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
