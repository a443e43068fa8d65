"""Tiny worker functions for testing the harness itself (importable by name in spawned workers)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = ["hang_on", "raise_on", "rank_sum"]


def rank_sum() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def raise_on(bad_rank: int) -> int:
    """Rank ``bad_rank`` raises; the others enter a collective that can never complete."""
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"injected failure on rank {bad_rank}")
    dist.barrier()
    return dist.get_rank()


def hang_on(bad_rank: int, seconds: float) -> int:
    if dist.get_rank() == bad_rank:
        time.sleep(seconds)
    return dist.get_rank()
