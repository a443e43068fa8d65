"""Port of ring-flash-attention's test/utils.py (``set_seed``, ``log``), plus what the ports share.

``log`` prints like upstream's (every rank in turn, or rank 0 only); the asserts are ``assert_close`` next to
each ``log`` of a difference. ``run_script`` is the scripts' ``if __name__ == "__main__":`` block for a worker
that lives on: the ``compile`` rerun rebinds module functions to ``torch.compile`` of them and sets
``capture_scalar_outputs``, exactly as upstream, and both are undone afterwards.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["log", "run_script", "set_seed"]


def set_seed(rank: int, seed: int = 42) -> None:
    seed = rank + seed
    random.seed(seed)
    torch.manual_seed(seed)


def log(msg: str, a: torch.Tensor, rank0_only: bool = False) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    text = f"max {a.abs().max().item():.3g}, mean {a.abs().mean().item():.3g}"
    if rank0_only:
        if rank == 0:
            print(f"{msg}: {text}", flush=True)
        return
    for i in range(world_size):
        if i == rank:
            print(f"{msg}: [{rank}] {text}", flush=True)
        dist.barrier()


def run_script(main: Callable[[], None], argv: list[str], namespace: dict, compiled: tuple[str, ...],
               backend: str = "inductor") -> None:
    """``torchrun script.py *argv`` inside a pool worker: ``argv == ["compile"]`` compiles ``compiled`` first,
    with ``backend`` (upstream: the default, inductor)."""
    saved = {name: namespace[name] for name in compiled}
    try:
        if len(argv) > 0 and argv[0] == "compile":
            torch._dynamo.config.capture_scalar_outputs = True
            for name in compiled:
                namespace[name] = torch.compile(namespace[name], backend=backend)
        main()
    finally:
        namespace.update(saved)
        torch._dynamo.config.capture_scalar_outputs = False
        torch._dynamo.reset()
