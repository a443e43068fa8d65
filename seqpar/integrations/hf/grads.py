"""Parameter gradients summed (or averaged) over the sequence-parallel group, and the groups whose product is
that group (every dim of a DeviceMesh)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ...errors import rank_suffix

__all__ = ["all_reduce_gradients"]

def all_reduce_gradients(params: Iterable[torch.nn.Parameter], mesh: Any = None, *, op: str = "sum",
                         bucket_bytes: int = 256 << 20) -> None:
    """Sum (or average) parameter gradients over the sequence-parallel group, in flat buckets.

    With ``reduce_loss``'s default ``grad_reduction="sum"``, summing makes every rank's gradient the
    single-process gradient. FSDP/DDP reduce gradients themselves: use ``grad_reduction="mean"`` there and
    do not call this.
    """
    rs = rank_suffix()
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}{rs}")
    grads = [p.grad for p in params if p.grad is not None]
    if any(type(g) is not torch.Tensor for g in grads):
        raise TypeError(f"all_reduce_gradients works on plain tensors, got {type(grads[0]).__name__} gradients: "
                        f"FSDP/DDP reduce gradients themselves (use grad_reduction='mean' in the loss){rs}")
    groups = _reduce_groups(mesh)
    scale = 1.0 / _group_size(groups) if op == "mean" else None
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for g in grads:
        lists = buckets.setdefault((g.dtype, g.device), [[]])
        if sum(t.numel() for t in lists[-1]) * g.element_size() >= bucket_bytes:
            lists.append([])
        lists[-1].append(g)
    for lists in buckets.values():
        for bucket in lists:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            for group in groups:
                dist.all_reduce(flat, group=group)
            if scale is not None:
                flat.mul_(scale)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _reduce_groups(mesh: Any) -> list[Any]:
    """The process groups whose product is the sequence-parallel group (every dim of a DeviceMesh)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first")
    if mesh is None:
        return [dist.group.WORLD]
    if isinstance(mesh, dist.ProcessGroup):
        return [mesh]
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):
        return [mesh.get_group(i) for i in range(mesh.ndim)]
    raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}{rank_suffix()}")


def _group_size(groups: list[Any]) -> int:
    return math.prod(dist.get_world_size(g) for g in groups)
