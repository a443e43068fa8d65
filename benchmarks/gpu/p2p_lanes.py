"""The ring's transfer on NCCL, one step of it: how fast does a rank move a block to its neighbour, and do more
communicators ("lanes") or two peers at once move it faster? (Real GPUs only: a fake group moves nothing.)

    torchrun --nproc-per-node 4 benchmarks/gpu/p2p_lanes.py --out p2p.jsonl [--sizes-mib 4,16,64,256]

Per size, rank r sends S bytes to r+1 and receives S from r-1 (the ring's step), timed with CUDA events (median of
20 after 5 warm-ups, the slowest rank), as:
  lanes=k   the block cut in k contiguous pieces, piece i on its own communicator (k process groups over the same
            ranks, each its own NCCL communicator and stream), posted together;
  peers2    half the bytes to r+1 and half to r+2 (the double ring's concurrent inner and outer hops), one
            communicator each (W > 2);
  allgather all_gather_into_tensor of S bytes per rank, for reference (NCCL's collective path);
  symm_pull the step on copy engines, no NCCL kernel: the block sits in torch's symmetric memory
            (``torch.distributed._symmetric_memory``), and each rank copies its upstream neighbour's block into its
            own receive buffer (a peer-to-peer ``copy_``: the copy engine over NVLink), between two of the
            symmetric memory's GPU-side barriers (the first says every block is ready, the second that every
            reader is done) - what torch's low-contention all-gather does per peer. CUDA only; where the
            symmetric memory cannot be set up, the record carries the error instead of a time.
One JSON line per (pattern, size) on rank 0: GB/s = S / time (per direction, per rank). NCCL's knobs are read from
the environment and recorded (``env``): ``benchmarks/gpu/p2p_knobs.sh`` runs this under several.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, dev: torch.device, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn`` (CUDA events; on CPU - a gloo smoke run - the wall clock), slowest rank."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(ts)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def symm_pull(send: torch.Tensor, recv: torch.Tensor, rank: int, W: int):
    """The ``symm_pull`` step for ``send``'s size (module docstring): a function, or why it cannot run."""
    try:
        import torch.distributed._symmetric_memory as symm

        group = dist.group.WORLD
        if hasattr(symm, "enable_symm_mem_for_group"):       # torch 2.11 needs it; later versions deprecate it
            symm.enable_symm_mem_for_group(group.group_name)
        block = symm.empty(send.shape, dtype=send.dtype, device=send.device)
        block.copy_(send)
        handle = symm.rendezvous(block, group.group_name)
        upstream = handle.get_buffer((rank - 1) % W, tuple(send.shape), send.dtype)
    except Exception as e:                                   # recorded, not fatal: the NCCL patterns still run
        return f"{type(e).__name__}: {str(e)[:300]}"

    def step():
        handle.barrier()                                     # every rank's block is in place
        recv.copy_(upstream)                                 # peer-to-peer: a copy engine, no SMs
        handle.barrier()                                     # every reader is done: blocks may change again
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes-mib", default="4,16,64,256")
    ap.add_argument("--lanes", default="1,2,4")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    lanes = [int(x) for x in args.lanes.split(",")]
    groups = [dist.new_group(list(range(W))) for _ in range(max(lanes))]
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_SYMM_MEM_"))}
    recs = []

    def ring(send, recv, k):
        reqs = []
        for s, r, g in zip(send.chunk(k), recv.chunk(k), groups[:k]):
            reqs += dist.batch_isend_irecv([dist.P2POp(dist.isend, s, (rank + 1) % W, g),
                                            dist.P2POp(dist.irecv, r, (rank - 1) % W, g)])
        for q in reqs:
            q.wait()

    def peers2(send, recv):
        reqs = []
        for off, s, r, g in zip((1, 2), send.chunk(2), recv.chunk(2), groups[:2]):
            reqs += dist.batch_isend_irecv([dist.P2POp(dist.isend, s, (rank + off) % W, g),
                                            dist.P2POp(dist.irecv, r, (rank - off) % W, g)])
        for q in reqs:
            q.wait()

    for mib in (int(x) for x in args.sizes_mib.split(",")):
        n = mib << 20
        send = torch.randn(n // 2, device=dev, dtype=torch.bfloat16)
        recv = torch.empty_like(send)
        out = torch.empty(W * send.numel(), device=dev, dtype=send.dtype)
        cases = [(f"lanes={k}", functools.partial(ring, send, recv, k)) for k in lanes]
        if W > 2:
            cases.append(("peers2", functools.partial(peers2, send, recv)))
        cases.append(("allgather", functools.partial(dist.all_gather_into_tensor, out, send)))
        if cuda:
            cases.append(("symm_pull", symm_pull(send, recv, rank, W)))
        for name, fn in cases:
            base = {"pattern": name, "mib": mib, "world": W, "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "env": env}
            if isinstance(fn, str):                       # the pattern could not be set up here: why
                rec = {**base, "error": fn}
            else:
                ms = timed(fn, dev)
                rec = {**base, "ms": round(ms, 4), "gbps": round(n / ms / 1e6, 1)}
            recs.append(rec)
            if rank == 0:
                print(json.dumps(rec), flush=True)
    if rank == 0:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
