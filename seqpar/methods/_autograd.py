"""The autograd wrapper every attention method shares: forward and backward are the method's own functions.

Note [Saved output, optional gradients]
    A method's backward takes the *final* out and lse (the kernel contract), so the wrapper saves q, k, v,
    out and lse. ``set_materialize_grads(False)``: when only lse (or only out) feeds the loss, the other
    gradient arrives as None; a missing dout becomes zeros (dlse may stay None: the method then skips the
    lse term). Methods that save something else (Ulysses/USP keep the all-to-all'd tensors) pass a
    ``forward`` returning ``(out, lse, saved)`` and use ``saving=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import AttentionConfig
from ..groups import SeqParallelGroups
from ..types import AttnOutput

__all__ = ["differentiable"]


class _MethodAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, groups, forward, backward, saving):
        if saving:
            out, lse, saved = forward(q, k, v, cfg, groups)
            ctx.save_for_backward(*saved)
        else:
            out, lse = forward(q, k, v, cfg, groups)
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.groups, ctx.backward, ctx.saving = cfg, groups, backward, saving
        ctx.kv_heads, ctx.out_meta = k.shape[2], (out.shape, out.dtype, out.device)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            shape, dtype, device = ctx.out_meta
            dout = torch.zeros(shape, dtype=dtype, device=device)
        if ctx.saving:
            grads = ctx.backward(dout, dlse, ctx.saved_tensors, ctx.kv_heads, ctx.cfg, ctx.groups)
        else:
            q, k, v, out, lse = ctx.saved_tensors
            grads = ctx.backward(dout, q, k, v, out, lse, dlse, ctx.cfg, ctx.groups)
        return (*grads, None, None, None, None, None)


def differentiable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
                   groups: SeqParallelGroups, forward: Callable[..., Any], backward: Callable[..., Any],
                   saving: bool = False) -> AttnOutput:
    """``forward(q, k, v, cfg, groups)`` as an autograd op whose backward is ``backward`` (Note above).

    ``saving=False``: forward returns ``(out, lse)``; backward is ``(dout, q, k, v, out, lse, dlse, cfg,
    groups) -> (dq, dk, dv)``. ``saving=True``: forward returns ``(out, lse, saved)``; backward is
    ``(dout, dlse, saved, kv_heads, cfg, groups) -> (dq, dk, dv)``.
    """
    return AttnOutput(*_MethodAttention.apply(q, k, v, cfg, groups, forward, backward, saving))
