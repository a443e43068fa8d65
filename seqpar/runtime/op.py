"""The attention op: one autograd node per call, the same for every method, in eager mode and under compile.

Eager calls run ``Attention.apply`` (an ``autograd.Function``: the cheapest node PyTorch has). Under
``torch.compile`` the same forward and backward run inside ``seqpar::attention`` / ``seqpar::attention_backward``,
``torch.library`` custom ops with fake implementations, so dynamo sees one opaque node per call and a model
that calls ``seqpar.attention`` compiles with zero graph breaks (Note [Tracing seqpar.attention]).

Both paths do the method-independent parts here, once:
    forward    engine.forward -> (out, lse); attention sinks on the final rows (seqpar.numerics)
    backward   GradRows(dO, O, dlse) of the final rows; the sinks' gradient; engine.backward

Note [Tracing seqpar.attention]
    Dynamo traces ``seqpar.attention``'s Python: under ``torch.compiler.is_compiling()`` it interns every
    non-tensor argument (the mesh, method, layout, options ...) into a string key with a function marked
    ``assume_constant_result`` (run once at trace time, a constant in the graph), and calls the custom op on
    the tensors and that key. ``cu_seqlens`` becomes a tensor input, read on the host inside the op, so a
    new packed batch neither recompiles nor guards on data. Inside the op the planned call is found or
    built exactly as in eager mode. The fake implementations give output shapes from the input shapes
    alone (out ``(B, L, H, Dv)``, lse ``(B, H, L)``; engines that save their own tensors, Ulysses and USP,
    declare their shapes), so shapes may be symbolic.
"""

from __future__ import annotations

from typing import Any

import torch

from ..methods.base import BackwardInputs
from ..numerics import GradRows, acc_dtype, apply_sinks, sink_grad

__all__ = ["Attention", "backward", "forward"]


def forward(plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None):
    """``(out, lse, saved)``: the engine's rows with sinks applied; ``saved`` what backward needs besides."""
    res = plan.engine.forward(q, k, v)
    out, lse = res[0], res[1]
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    saved = tuple(res[2]) if plan.engine.saves else ()
    return out, lse, saved


def backward(plan: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
             q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, saved: tuple[torch.Tensor, ...],
             sinks: torch.Tensor | None, sinks_grad: bool):
    """``(dq, dk, dv, dsinks)`` from the final rows (Note [Engines] in ``seqpar.methods.base``)."""
    if dout is None:
        dout = torch.zeros_like(out)
    rows = GradRows(dout, out, dlse)
    dsinks = sink_grad(rows, lse, sinks) if sinks is not None and sinks_grad else None
    dq, dk, dv = plan.engine.backward(BackwardInputs(rows, lse, q, k, v, saved, sinks, plan.call.lse_grad))
    return dq, dk, dv, dsinks


class Attention(torch.autograd.Function):
    """``apply(q, k, v, sinks, plan) -> (out, lse)``; a missing gradient arrives as None (not zeros)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan):
        out, lse, saved = forward(plan, q, k, v, sinks)
        ctx.plan, ctx.n_saved = plan, len(saved)
        if plan.engine.saves:
            ctx.save_for_backward(out, lse, sinks, *saved)
        else:
            ctx.save_for_backward(out, lse, sinks, q, k, v)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, sinks, *rest = ctx.saved_tensors
        plan = ctx.plan
        if plan.engine.saves:
            q = k = v = None
            saved = tuple(rest)
        else:
            (q, k, v), saved = rest, ()
        dq, dk, dv, dsinks = backward(plan, dout, dlse, out, lse, q, k, v, saved, sinks, ctx.needs_input_grad[3])
        return dq, dk, dv, dsinks, None


# --------------------------------------------------------------------------------------------- custom ops
# Registered on first use (``custom_ops()``), so importing seqpar defines no operators.

_OPS: dict[str, Any] = {}


def _out_meta(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, H, _ = q.shape
    return q.new_empty(B, L, H, v.shape[-1]), q.new_empty(B, H, L, dtype=acc_dtype(q.dtype))


def custom_ops() -> dict[str, Any]:
    """``{"forward": op, "backward": op}``: ``seqpar::attention`` and its backward (Note above)."""
    if _OPS:
        return _OPS
    from .call import traced_plan, traced_saved_meta

    @torch.library.custom_op("seqpar::attention", mutates_args=())
    def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                     cu_seqlens: torch.Tensor | None, key: str
                     ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        plan = traced_plan(key, q, k, v, sinks, cu_seqlens)
        out, lse, saved = forward(plan, q, k, v, sinks)
        return out, lse, [t.clone() if t is q or t is k or t is v else t for t in saved]

    @attention_op.register_fake
    def _(q, k, v, sinks, cu_seqlens, key):
        out, lse = _out_meta(q, v)
        return out, lse, [q.new_empty(shape, dtype=dtype) for shape, dtype in traced_saved_meta(key, q, k, v)]

    @torch.library.custom_op("seqpar::attention_backward", mutates_args=())
    def backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saved: list[torch.Tensor],
                    sinks: torch.Tensor | None, cu_seqlens: torch.Tensor | None, key: str,
                    sinks_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        plan = traced_plan(key, q, k, v, sinks, cu_seqlens)
        dq, dk, dv, ds = backward(plan, dout, dlse, out, lse, q, k, v, tuple(saved), sinks, sinks_grad)
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), ds

    @backward_op.register_fake
    def _(dout, dlse, out, lse, q, k, v, saved, sinks, cu_seqlens, key, sinks_grad):
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                torch.empty_like(sinks) if sinks is not None and sinks_grad else None)

    def setup_context(ctx, inputs, output):
        q, k, v, sinks, cu, key = inputs
        out, lse, saved = output
        ctx.save_for_backward(q, k, v, sinks, cu, out, lse, *saved)
        ctx.key = key

    def backward_rule(ctx, dout, dlse, dsaved):
        q, k, v, sinks, cu, out, lse, *saved = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, ds = backward_op(dout, dlse, out, lse, q, k, v, list(saved), sinks, cu, ctx.key,
                                     bool(ctx.needs_input_grad[3]))
        return dq, dk, dv, ds, None, None

    attention_op.register_autograd(backward_rule, setup_context=setup_context)
    _OPS.update(forward=attention_op, backward=backward_op)
    return _OPS
