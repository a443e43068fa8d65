"""Flex on TMA (Note [Flex on TMA]) on short chunks: one emulated rank of 8 (fake group, communication free) at
2K and 4K tokens per rank, through ``seqpar.attention`` as a user calls it (graphed by default), with flex's forward
kernels on TMA as committed ("on": bands and joined bands without softcap, ``takes_tma``), on TMA for every mask
("all") and without TMA ("off": ``seqpar.kernels.flex.TMA_ARCHS`` emptied).

    python3 benchmarks/gpu/probe_tma_rank.py --out F.jsonl [--seqs 16384,32768] [--rounds 4] [--cases softcap,...]

Cases, GQA 32/8, D 128, bf16: a generic ``mask_mod`` (the shared prefix as a function), softcap 30 (causal), the
sink window (4095 + 4 sinks); each on ring and all-gather. The variants take turns round by round (on, off, all,
on, ...): each round forgets every planned call (``seqpar.runtime.call.cache_clear``: its graphs go with it), warms
up and times the no-grad forward and forward+backward (``time_ms``, medians of ``--iters``). Every record is one JSON
line labelled "emulated W = 8 (rank r of 8, fake group)"; the summary prints the medians over rounds, off / on and
all / on.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import seqpar
from seqpar import masks
from seqpar.bench.timing import time_ms
from seqpar.kernels import flex as sp_flex
from seqpar.runtime import call as sp_call

DEV = torch.device("cuda")
W = 8
ON = sp_flex.TMA_ARCHS
GATE = sp_flex.takes_tma


def cases(S: int) -> dict[str, tuple[int, dict]]:
    """name -> (emulated rank, keyword arguments of ``seqpar.attention``)."""
    tree = masks.shared_prefix(S // 2, [S // 16] * 8).mod(DEV, S)
    generic = {"causal": False, "mask_mod": lambda b, h, qi, ki: tree(b, h, qi, ki)}
    soft = {"causal": True, "softcap": 30.0}
    sink = {"causal": False, "mask_mod": masks.sink_window(4095, 4)}
    return {
        "generic mask_mod, ring/zigzag": (0, {**generic, "method": "ring", "layout": "zigzag"}),
        "generic mask_mod, allgather/zigzag": (0, {**generic, "method": "allgather", "layout": "zigzag"}),
        "softcap 30, ring/zigzag": (0, {**soft, "method": "ring", "layout": "zigzag"}),
        "softcap 30, allgather/zigzag": (0, {**soft, "method": "allgather", "layout": "zigzag"}),
        "sink window, ring/contiguous": (1, {**sink, "method": "ring", "layout": "contiguous"}),
        "sink window, allgather/contiguous": (1, {**sink, "method": "allgather", "layout": "contiguous"}),
    }


def emit(path: str, rec: dict) -> None:
    print(json.dumps(rec), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", default="16384,32768", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--cases", default="", help="comma-separated substrings: keep the cases naming one of them")
    args = ap.parse_args()
    emit(args.out, {"env": f"torch {torch.__version__}, {torch.cuda.get_device_name()}",
                    "tma_option": sp_flex._has_tma_option(), "tma_archs": sorted(ON)})
    summary = []
    for S in args.seqs:
        n = S // W
        g = torch.Generator(device=DEV).manual_seed(0)
        q = torch.randn(1, n, 32, 128, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(1, n, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))
        do = torch.randn_like(q)
        for name, (rank, kw) in cases(S).items():
            if args.cases and not any(c in name for c in args.cases.split(",")):
                continue
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", rank=rank, world_size=W, store=FakeStore())
            kw = {**kw, "check_ranks": False}

            def fwd(kw=kw, t=(q, k, v)):
                with torch.no_grad():
                    seqpar.attention(*t, **kw)

            def fb(kw=kw, t=(q, k, v), do=do):
                seqpar.attention(*t, **kw).backward(do)
            got: dict[str, list[tuple[float, float]]] = {"on": [], "off": [], "all": []}
            try:
                for r in range(args.rounds):
                    for variant in got:
                        sp_flex.TMA_ARCHS = frozenset() if variant == "off" else ON
                        sp_flex.takes_tma = (lambda mask, softcap: True) if variant == "all" else GATE
                        sp_call.cache_clear()
                        ms = (time_ms(fwd, DEV, warmup=args.warmup, iters=args.iters),
                              time_ms(fb, DEV, warmup=args.warmup, iters=args.iters))
                        got[variant].append(ms)
                        emit(args.out, {"label": f"emulated W = 8 (rank {rank} of 8, fake group)", "case": name,
                                        "seq_len": S, "tokens_per_rank": n, "round": r, "tma": variant,
                                        "fwd_ms": ms[0], "fb_ms": ms[1]})
            except Exception as e:            # a record of the failure, then the next case
                emit(args.out, {"case": name, "seq_len": S, "error": f"{type(e).__name__}: {e}"[:400]})
                continue
            finally:
                sp_flex.TMA_ARCHS, sp_flex.takes_tma = ON, GATE
            med = {vr: [statistics.median(x[i] for x in got[vr]) for i in (0, 1)] for vr in got}
            summary.append((S, name, med))
            print(f"S={S} ({n}/rank) {name:36s} " + "  ".join(
                f"{mode} on {med['on'][i]:.3f} off {med['off'][i]:.3f} all {med['all'][i]:.3f}"
                for i, mode in enumerate(("fwd", "fwd+bwd"))), flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    print("\n| case | tokens per rank | fwd ms, off / on / all | off / on, all / on | fwd+bwd ms, off / on / all "
          "| off / on, all / on |")
    print("|---|---|---|---|---|---|")
    for S, name, med in summary:
        cells = [f"{med['off'][i]:.3f} / {med['on'][i]:.3f} / {med['all'][i]:.3f} | "
                 f"{med['off'][i] / med['on'][i]:.3f}, {med['all'][i] / med['on'][i]:.3f}" for i in (0, 1)]
        print(f"| {name} | {S // W} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
