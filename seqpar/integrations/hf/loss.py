"""The causal-LM loss over the sequence-parallel group: each rank's share of the global mean token loss
(Note [Loss over the sequence-parallel group]), with logits formed one chunk at a time (Note [Tiled loss])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from ...errors import rank_suffix
from .grads import _group_size, _reduce_groups

__all__ = ["SPLoss", "reduce_loss", "sequence_parallel_loss", "token_loss_sum"]

@dataclass(frozen=True)
class SPLoss:
    """A loss over the sequence-parallel group (Note [Loss over the sequence-parallel group]).

    Attributes:
        loss: this rank's share, to call ``backward`` on: the local token-loss sum over the group's target
            count (times the group size with ``grad_reduction="mean"``).
        value: the group's mean token loss, detached, equal on every rank: what one process would report.
        tokens: the group's target count (int64).
    """

    loss: torch.Tensor
    value: torch.Tensor
    tokens: torch.Tensor


def token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, *,
                   chunk_size: int | None = None, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross entropies over this rank's tokens, and their count, logits in chunks.

    Note [Tiled loss]: logits for a long shard are ``L x V`` floats (a 256K-token shard with a 128K vocabulary
    is 128 GiB in fp32). Here they exist one chunk of ``chunk_size`` tokens at a time: each chunk's logits
    (``hidden @ weight.T``, upcast to at least fp32 as transformers does) and its cross-entropy sum are computed under
    activation checkpointing, so backward recomputes the chunk's logits instead of keeping them. Peak extra
    memory: one chunk's fp32 logits and their gradient.

    Args:
        hidden: ``(B, L, C)`` final hidden states (after the last norm).
        weight: ``(V, C)`` the LM head weight.
        shift_labels: ``(B, L)`` targets (``shard_batch``'s ``shift_labels``).
        chunk_size: tokens per chunk (default: all of them, in one piece).

    Returns:
        ``(sum, count)``: fp32 (fp64 for fp64 input) scalar sum of token losses and int64 scalar count of targets.
    """
    rs = rank_suffix()
    if hidden.dim() != 3 or shift_labels.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (batch, seq, hidden) and shift_labels (batch, seq), got "
                         f"{tuple(hidden.shape)} and {tuple(shift_labels.shape)}{rs}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}{rs}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1)
    step = h.shape[0] if chunk_size is None else chunk_size
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, h.shape[0], step):
        hc, yc = h[start:start + step], y[start:start + step]
        if torch.is_grad_enabled() and (hc.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss, hc, weight, yc, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss(hc, weight, yc, ignore_index)
    return total, (y != ignore_index).sum()


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = h @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))       # fp32 at least, as transformers
    return torch.nn.functional.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")


def reduce_loss(loss_sum: torch.Tensor, count: torch.Tensor | int, mesh: Any = None, *,
                num_items: torch.Tensor | int | None = None, grad_reduction: str = "sum") -> SPLoss:
    """This rank's share of the group's mean token loss, and the mean itself.

    Note [Loss over the sequence-parallel group]: one process computes ``sum_t loss_t / N`` over all N
    targets. Rank r holds the terms of its tokens, so its share is ``sum_{t in r} loss_t / N`` with N summed
    over the group (or given as ``num_items``, e.g. ``shard_batch``'s ``num_items_in_batch``): the shares add
    up to the single-process loss, and so do their parameter gradients - sum them over the group
    (``all_reduce_gradients``, ``grad_reduction="sum"``). Data-parallel wrappers that AVERAGE gradients over
    a mesh containing the sequence-parallel ranks (FSDP2 over data x sequence, DDP) divide by the group size
    W: use ``grad_reduction="mean"``, which multiplies the share by W.

    Args:
        loss_sum: this rank's token-loss sum (a scalar with grad).
        count: this rank's target count.
        mesh: the sequence-parallel mesh or group (every dim of a DeviceMesh is reduced over).
        num_items: the group's target count, if known (skips one all-reduce).
        grad_reduction: "sum" or "mean" (see the Note).
    """
    rs = rank_suffix()
    if grad_reduction not in ("sum", "mean"):
        raise ValueError(f"grad_reduction must be 'sum' or 'mean', got {grad_reduction!r}{rs}")
    groups = _reduce_groups(mesh)
    if num_items is None:
        tokens = torch.as_tensor(count, device=loss_sum.device).to(torch.float64).reshape(())
        tokens = tokens.clone()
        for g in groups:
            dist.all_reduce(tokens, group=g)
    else:
        tokens = torch.as_tensor(num_items, device=loss_sum.device).to(torch.float64).reshape(())
    denom = tokens.clamp(min=1).to(loss_sum.dtype)
    share = loss_sum / denom
    if grad_reduction == "mean":
        share = share * _group_size(groups)
    value = loss_sum.detach().clone()
    for g in groups:
        dist.all_reduce(value, group=g)
    return SPLoss(loss=share, value=value / denom, tokens=tokens.to(torch.int64))


def sequence_parallel_loss(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, mesh: Any = None,
                           *, chunk_size: int | None = None, ignore_index: int = -100,
                           num_items: torch.Tensor | int | None = None, grad_reduction: str = "sum") -> SPLoss:
    """``reduce_loss(*token_loss_sum(hidden, weight, shift_labels, chunk_size=...), mesh, ...)``.

    The causal-LM loss of a sharded batch without forming all logits at once (Note [Tiled loss]).
    """
    loss_sum, count = token_loss_sum(hidden, weight, shift_labels, chunk_size=chunk_size, ignore_index=ignore_index)
    return reduce_loss(loss_sum, count, mesh, num_items=num_items, grad_reduction=grad_reduction)
