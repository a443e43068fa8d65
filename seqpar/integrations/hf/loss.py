"""The causal-LM loss over the sequence-parallel group: each rank's share of the global mean token loss
(Note [Loss over the sequence-parallel group]), with logits formed one chunk at a time (Note [Tiled loss]),
optionally weighted per token (Note [Weighted token loss])."""

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
        tokens: the denominator: the group's target count (int64); for a weighted loss the group's weight sum
            (fp64; Note [Weighted token loss]); ``num_items`` when given (fp64 if it or the count is floating).
    """

    loss: torch.Tensor
    value: torch.Tensor
    tokens: torch.Tensor


def token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, *,
                   weights: torch.Tensor | None = None, chunk_size: int | None = None,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross entropies over this rank's tokens, and their count, logits in chunks.

    Note [Tiled loss]: logits for a long shard are ``L x V`` floats (a 256K-token shard with a 128K vocabulary
    is 128 GiB in fp32). Here they exist one chunk of ``chunk_size`` tokens at a time: each chunk's logits
    (``hidden @ weight.T``, upcast to at least fp32 as transformers does) and its cross-entropy sum are computed under
    activation checkpointing, so backward recomputes the chunk's logits instead of keeping them. Peak extra
    memory: one chunk's fp32 logits and their gradient.

    Note [Weighted token loss]: with ``weights`` (the Large World Model weighted vision against language
    tokens) the loss is the weighted mean over the GLOBAL sequence, ``sum_t w_t ce_t / sum_t w_t`` over the
    targets t (``ignore_index`` tokens excluded from both sums). Both sums are sums over tokens, so they split
    over ranks exactly as the unweighted ones do: this function returns the rank's ``sum_t w_t ce_t`` and
    ``sum_t w_t`` (fp64) in place of the target count, and ``reduce_loss`` adds the weight sums over the group
    (Note [Loss over the sequence-parallel group]). Weights are per token of ``shift_labels`` - the weight of
    the predicted token - and must be sharded like it (``shard_batch``'s ``loss_weights``). Both paths sum
    ``ce_t`` (times ``w_t``) per token in the same order, so weights of all ones give the unweighted loss and
    gradients bitwise, and a zero weight gives exactly what ``ignore_index`` there gives. Weights are
    constants (not differentiated).

    Args:
        hidden: ``(B, L, C)`` final hidden states (after the last norm).
        weight: ``(V, C)`` the LM head weight.
        shift_labels: ``(B, L)`` targets (``shard_batch``'s ``shift_labels``).
        weights: ``(B, L)`` finite, non-negative float weight of each target, or None (all 1; see the Note).
        chunk_size: tokens per chunk (default: all of them, in one piece).
        ignore_index: the label value that is not a target.

    Returns:
        ``(sum, count)``: fp32 (fp64 for fp64 input) scalar sum of (weighted) token losses, and the int64 scalar
        count of targets - with ``weights``, the fp64 scalar sum of the targets' weights.
    """
    rs = rank_suffix()
    if hidden.dim() != 3 or shift_labels.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (batch, seq, hidden) and shift_labels (batch, seq), got "
                         f"{tuple(hidden.shape)} and {tuple(shift_labels.shape)}{rs}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}{rs}")
    if weights is not None:
        _check_weights(weights, tuple(shift_labels.shape), "weights", "shift_labels")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    w = None if weights is None else weights.detach().reshape(-1).to(device=hidden.device)
    w_acc = None if w is None else w.to(acc)
    step = h.shape[0] if chunk_size is None else chunk_size
    total = hidden.new_zeros((), dtype=acc)
    for start in range(0, h.shape[0], step):
        hc, yc = h[start:start + step], y[start:start + step]
        wc = None if w_acc is None else w_acc[start:start + step]
        if torch.is_grad_enabled() and (hc.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss, hc, weight, yc, wc, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss(hc, weight, yc, wc, ignore_index)
    targets = y != ignore_index
    if w is None:
        return total, targets.sum()
    return total, torch.where(targets, w.to(torch.float64), 0.0).sum()


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None,
                ignore_index: int) -> torch.Tensor:
    logits = h @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))       # fp32 at least, as transformers
    ce = torch.nn.functional.cross_entropy(logits, y, ignore_index=ignore_index, reduction="none")
    return (ce if w is None else ce * w).sum()      # one summation for both (Note [Weighted token loss])


def _check_weights(weights: Any, shape: tuple[int, ...], name: str, like: str) -> None:
    """``weights`` must be a finite, non-negative floating tensor of ``shape`` (that of ``like``)."""
    rs = rank_suffix()
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"{name} must be a floating tensor shaped like {like} {shape}, got "
                        f"{type(weights).__name__}{rs}")
    if tuple(weights.shape) != shape:
        raise ValueError(f"{name} must have the shape of {like} {shape}, got {tuple(weights.shape)}{rs}")
    if not weights.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (per-token loss weights), got dtype {weights.dtype}{rs}")
    bad = ~(torch.isfinite(weights) & (weights >= 0))
    if bool(bad.any()):                                 # one host read of the check
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be finite and non-negative, got {weights[where].item()} at index {where} "
                         f"({int(bad.sum())} such value(s)){rs}")


def reduce_loss(loss_sum: torch.Tensor, count: torch.Tensor | int | float, mesh: Any = None, *,
                num_items: torch.Tensor | int | float | None = None, grad_reduction: str = "sum") -> SPLoss:
    """This rank's share of the group's mean token loss, and the mean itself.

    Note [Loss over the sequence-parallel group]: one process computes ``sum_t loss_t / N`` over all N
    targets. Rank r holds the terms of its tokens, so its share is ``sum_{t in r} loss_t / N`` with N summed
    over the group (or given as ``num_items``, e.g. ``shard_batch``'s ``num_items_in_batch``): the shares add
    up to the single-process loss, and so do their parameter gradients - sum them over the group
    (``all_reduce_gradients``, ``grad_reduction="sum"``). Data-parallel wrappers that AVERAGE gradients over
    a mesh containing the sequence-parallel ranks (FSDP2 over data x sequence, DDP) divide by the group size
    W: use ``grad_reduction="mean"``, which multiplies the share by W.

    A weighted loss (Note [Weighted token loss]) is the same sum with ``w_t loss_t`` terms and N the group's
    weight sum: ``count`` is then this rank's weight sum. ``num_items``, when given, replaces the denominator
    in both cases: weights scale the numerator only, so for the weighted mean pass the group's WEIGHT sum (e.g.
    over the micro-batches of a gradient-accumulation step), not ``num_items_in_batch`` (a target count). A
    denominator of 0 (no target, or all weights 0) divides by 1: the loss is then 0.

    Args:
        loss_sum: this rank's (weighted) token-loss sum (a scalar with grad).
        count: this rank's target count, or its targets' weight sum for a weighted loss.
        mesh: the sequence-parallel mesh or group (every dim of a DeviceMesh is reduced over).
        num_items: the group's denominator, if known (skips one all-reduce): target count, or weight sum.
        grad_reduction: "sum" or "mean" (see the Note).
    """
    rs = rank_suffix()
    if grad_reduction not in ("sum", "mean"):
        raise ValueError(f"grad_reduction must be 'sum' or 'mean', got {grad_reduction!r}{rs}")
    groups = _reduce_groups(mesh)
    if num_items is None:
        tokens = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device).reshape(()).clone()
        for g in groups:
            dist.all_reduce(tokens, group=g)
    else:
        tokens = torch.as_tensor(num_items, dtype=torch.float64, device=loss_sum.device).reshape(())
    floating = _is_floating(count) or _is_floating(num_items)
    denom = torch.where(tokens > 0, tokens, torch.ones_like(tokens)).to(loss_sum.dtype)
    share = loss_sum / denom
    if grad_reduction == "mean":
        share = share * _group_size(groups)
    value = loss_sum.detach().clone()
    for g in groups:
        dist.all_reduce(value, group=g)
    return SPLoss(loss=share, value=value / denom, tokens=tokens if floating else tokens.to(torch.int64))


def _is_floating(x: Any) -> bool:
    return isinstance(x, float) or (isinstance(x, torch.Tensor) and x.is_floating_point())


def sequence_parallel_loss(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, mesh: Any = None,
                           *, weights: torch.Tensor | None = None, chunk_size: int | None = None,
                           ignore_index: int = -100, num_items: torch.Tensor | int | float | None = None,
                           grad_reduction: str = "sum") -> SPLoss:
    """``reduce_loss(*token_loss_sum(hidden, weight, shift_labels, weights=..., chunk_size=...), mesh, ...)``.

    The causal-LM loss of a sharded batch without forming all logits at once (Note [Tiled loss]); with
    ``weights`` (``(B, L)``, sharded like ``shift_labels``: ``shard_batch``'s ``loss_weights``) the weighted
    mean over the global sequence, ``sum_t w_t ce_t / sum_t w_t`` (Note [Weighted token loss]; ``num_items``
    then replaces the weight sum).
    """
    loss_sum, count = token_loss_sum(hidden, weight, shift_labels, weights=weights, chunk_size=chunk_size,
                                     ignore_index=ignore_index)
    return reduce_loss(loss_sum, count, mesh, num_items=num_items, grad_reduction=grad_reduction)
