"""Does a process that ran seqpar on NCCL exit? Two runs of the real 4-GPU table hung after their last record until
the call's limit killed torchrun (2026-11-26, 4x H200 and 4x H100): every rank had finished its work.

    torchrun --nproc-per-node 2 benchmarks/gpu/exit_check.py --case graphs-destroy

A few planned calls at 2K tokens per rank (so auto graphs them on CUDA: Note [Graphed calls]), forward and
backward, then the case's ending. Each stage prints a line; every 15 s faulthandler prints every thread's Python
stack, so a hang shows where it sits. Cases:
  eager-destroy         graphs=False, then dist.destroy_process_group()
  graphs-destroy        graphs auto (captured), then destroy_process_group()
  graphs-exit           graphs auto, no destroy: the interpreter exits with the group alive
  graphs-skew-destroy   graphs auto; rank 0 sleeps 5 s before destroy (the bench's rank 0 prints and plots)
  eager-skew-destroy    graphs=False with the same skew
  graphs-clear-destroy  graphs auto, seqpar.runtime.call.cache_clear() (drops plans and their graphs), then destroy
  graphs-noreg-destroy  graphs-destroy with NCCL_GRAPH_REGISTER=0 (NCCL does not register the captured buffers)
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

import seqpar


def say(msg: str) -> None:
    print(f"[rank {dist.get_rank() if dist.is_initialized() else '?'} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(15, repeat=True, file=sys.stderr)
    if "noreg" in args.case:
        os.environ["NCCL_GRAPH_REGISTER"] = "0"
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    W = dist.get_world_size()
    graphs = False if args.case.startswith("eager") else None
    q = torch.randn(1, 2048, 32, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2048, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2048, 8, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for method in ("ring", "ulysses", "allgather"):
        for _ in range(args.calls):
            out = seqpar.attention(q, k, v, causal=True, method=method, graphs=graphs)
            out.float().sum().backward()
        torch.cuda.synchronize()
        say(f"{method}: {args.calls} calls forward+backward on {W} ranks")
    if "skew" in args.case and dist.get_rank() == 0:
        time.sleep(5)
    if "clear" in args.case:
        from seqpar.runtime.call import cache_clear
        cache_clear()
        gc.collect()
        torch.cuda.synchronize()
        say("plans cleared")
    if "destroy" in args.case:
        say("destroy_process_group ...")
        dist.destroy_process_group()
        say("destroy_process_group returned")
    say("leaving main")


if __name__ == "__main__":
    main()
    print(f"[{time.strftime('%H:%M:%S')}] main returned; the interpreter exits now", flush=True)
