"""Benchmark: LASP-2 vs LASP-1 vs all-gather softmax attention vs one device, forward and forward+backward.

Launch with torchrun (one process per GPU, NCCL); every rank holds S / W tokens. Each configuration is
timed ``--iters`` times after ``--warmup`` runs (CUDA events on GPU, perf_counter on CPU, ranks aligned
by a barrier before each run); a rank's figure is its median, the reported figure the SLOWEST rank's
median. Results are JSON lines on rank 0's stdout (one per configuration, errors included as lines)::

    torchrun --nproc-per-node 4 benchmarks/bench_linear.py --seq-lens 32768,131072 --heads 16 --head-dim 128
    torchrun --nproc-per-node 2 benchmarks/bench_linear.py --device cpu --tiny     # a smoke run on gloo

Methods: ``lasp2`` / ``lasp1`` (``seqpar.linear_attention``), ``softmax`` (``seqpar.attention`` with
``allgather`` when that method exists, else ``ring``; causal, zigzag), ``single_linear`` / ``single_softmax``
(the local kernel / SDPA on the WHOLE sequence on each device: the single-GPU yardstick, skipped with
``--no-single`` or when it does not fit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar
from seqpar.bench.timing import rank_median_ms
from seqpar.kernels.linear import LinearCall, linear_attention_chunked, select_linear


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seq-lens", default="8192,32768,131072", help="global lengths S, comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="softmax KV heads (default: heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gate", choices=["none", "const", "scalar", "dim"], default="scalar")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--methods", default="lasp2,lasp1,softmax,single_linear,single_softmax")
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--layout", choices=["contiguous", "zigzag"], default="zigzag", help="lasp2 / softmax layout")
    ap.add_argument("--kernel", default="auto", help="linear local kernel (auto, chunked, fla)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-single", action="store_true", help="skip the whole-sequence single-device baselines")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke run")
    args = ap.parse_args()
    if args.tiny:
        args.seq_lens, args.heads, args.head_dim, args.iters, args.warmup = "64,128", 2, 16, 3, 1
        args.chunk_size, args.dtype = 16, ("float32" if args.device == "cpu" else args.dtype)
    return args


def init(args: argparse.Namespace) -> torch.device:
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_call(method: str, mode: str, S: int, args: argparse.Namespace, device: torch.device) -> Callable[[], None]:
    """A closure running one forward (and backward) of ``method`` on fresh random local inputs."""
    W = dist.get_world_size()
    dt = getattr(torch, args.dtype)
    B, H, D = args.batch, args.heads, args.head_dim
    Hkv = args.kv_heads or H
    L = S if method.startswith("single") else S // W
    grad = mode == "fwd_bwd"

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=dt) * scale).requires_grad_(grad)

    if method in ("softmax", "single_softmax"):
        q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
        soft = "allgather" if "allgather" in seqpar.methods.available() else "ring"

        def fwd():
            if method == "softmax":
                return seqpar.attention(q, k, v, method=soft, layout="zigzag", causal=True)
            G = H // Hkv
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2),
                                               v.repeat_interleave(G, 2).transpose(1, 2), is_causal=True)
            return o.transpose(1, 2)
    else:
        q, k, v = rnd(B, L, H, D, scale=0.1), rnd(B, L, H, D, scale=0.1), rnd(B, L, H, D)
        shape = {"none": None, "const": (H,), "scalar": (B, L, H), "dim": (B, L, H, D)}[args.gate]
        g = None if shape is None else F.logsigmoid(torch.randn(*shape, device=device) + 4.0).requires_grad_(grad)
        kw = {} if g is None else ({"gates": g} if args.gate == "dim" else {"decay": g})

        def fwd():
            if method == "single_linear":
                return linear_attention_chunked(q, k, v, g, chunk_size=args.chunk_size)[0]
            layout = "contiguous" if method == "lasp1" else args.layout
            return seqpar.linear_attention(q, k, v, method=method, layout=layout, chunk_size=args.chunk_size,
                                           kernel=args.kernel, **kw)

    def run():
        o = fwd()
        if grad:
            o.backward(torch.ones_like(o))

    return run


def main() -> None:
    args = parse()
    device = init(args)
    rank, W = dist.get_rank(), dist.get_world_size()
    meta = {"W": W, "B": args.batch, "H": args.heads, "D": args.head_dim, "gate": args.gate, "dtype": args.dtype,
            "layout": args.layout, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "host": platform.node(), "torch": torch.__version__, "seqpar": seqpar.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
            "linear_kernel": select_linear(args.kernel, LinearCall(device.type, getattr(torch, args.dtype),
                                                                    {"const": "scalar"}.get(args.gate, args.gate))
                                           ).name}
    for S in (int(s) for s in args.seq_lens.split(",")):
        for method in args.methods.split(","):
            if args.no_single and method.startswith("single"):
                continue
            for mode in args.modes.split(","):
                row = {"bench": "linear", "method": method, "mode": mode, "S": S, **meta}
                row["layout"] = None if method.startswith("single") else ("contiguous" if method == "lasp1"
                                                                           else args.layout)
                if method == "softmax":
                    row["softmax_method"] = "allgather" if "allgather" in seqpar.methods.available() else "ring"
                try:
                    ms = torch.tensor([rank_median_ms(make_call(method, mode, S, args, device), device,
                                                     warmup=args.warmup, iters=args.iters)],
                                      dtype=torch.float64, device=device)
                    fastest = ms.clone()
                    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                    dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
                    row.update(ms=round(ms.item(), 4), fastest_rank_ms=round(fastest.item(), 4),
                               tokens_per_s=round(args.batch * S / (ms.item() / 1e3)), iters=args.iters)
                except (RuntimeError, ValueError, NotImplementedError) as e:   # OOM, unsupported: report, go on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if rank == 0:
                    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
