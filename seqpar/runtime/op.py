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
from .call import Plan, traced_plan, traced_saved_meta
from .graphs import Graphed

__all__ = ["Attention", "attention_op", "backward", "backward_op", "forward", "run"]


def run(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A planned call on its tensors: ``(out, lse)``, or ``(out, None)`` on the direct path (out only)."""
    if plan.direct is not None:
        return plan.direct(q, k, v), None
    if plan.call.grad:
        return Attention.apply(q, k, v, sinks, plan)
    out, lse, _ = forward(plan, q, k, v, sinks, keep_saved=False)
    return out, lse


def forward(plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, *,
            keep_saved: bool = True):
    """``(out, lse, saved)``: the engine's rows with sinks applied; ``saved`` what backward needs besides (empty
    where ``keep_saved`` is False and a graphed engine can leave it out: Note [Graph copies])."""
    engine = plan.engine
    res = engine.forward(q, k, v) if keep_saved or not isinstance(engine, Graphed) else \
        engine.forward(q, k, v, keep_saved=False)
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
# Defined at import (never inside a trace); explicit schemas: the annotations here are strings.

def _unaliased(outs: list[torch.Tensor], inputs: list[torch.Tensor | None]):
    """``outs`` with no tensor sharing storage with an input or another output (a custom op's rule), each
    contiguous as the fake implementations declare: copies only where needed."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
    fixed = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        fixed.append(t)
    return fixed


def _out_meta(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, L, H, _ = q.shape
    return q.new_empty(B, L, H, v.shape[-1]), q.new_empty(B, H, L, dtype=acc_dtype(q.dtype))


@torch.library.custom_op("seqpar::attention", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? cu_seqlens, str key) "
                                "-> (Tensor, Tensor, Tensor[])")
def attention_op(q, k, v, sinks, cu_seqlens, key):
    plan = traced_plan(key, q, k, v, sinks, cu_seqlens)
    out, lse, saved = forward(plan, q, k, v, sinks)
    out, lse, *saved = _unaliased([out, lse, *saved], [q, k, v, sinks, cu_seqlens])
    return out, lse, saved


@attention_op.register_fake
def _(q, k, v, sinks, cu_seqlens, key):
    out, lse = _out_meta(q, v)
    return out, lse, [q.new_empty(shape, dtype=dtype) for shape, dtype in traced_saved_meta(key, q, k, v)]


@torch.library.custom_op("seqpar::attention_backward", mutates_args=(),
                         schema="(Tensor dout, Tensor? dlse, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, "
                                "Tensor[] saved, Tensor? sinks, Tensor? cu_seqlens, str key, bool sinks_grad) "
                                "-> (Tensor, Tensor, Tensor, Tensor)")
def backward_op(dout, dlse, out, lse, q, k, v, saved, sinks, cu_seqlens, key, sinks_grad):
    """``(dq, dk, dv, dsinks)``; dsinks is an empty tensor when there are no sinks (schemas have no optional
    outputs)."""
    plan = traced_plan(key, q, k, v, sinks, cu_seqlens)
    dq, dk, dv, ds = backward(plan, dout, dlse, out, lse, q, k, v, tuple(saved), sinks, sinks_grad)
    dq, dk, dv, ds = _unaliased([dq, dk, dv, q.new_empty(0) if ds is None else ds],
                                [dout, dlse, out, lse, q, k, v, *saved, sinks, cu_seqlens])
    return dq, dk, dv, ds


@backward_op.register_fake
def _(dout, dlse, out, lse, q, k, v, saved, sinks, cu_seqlens, key, sinks_grad):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(sinks) if sinks is not None and sinks_grad else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu, key = inputs
    out, lse, saved = output
    ctx.save_for_backward(q, k, v, sinks, cu, out, lse, *saved)
    ctx.key = key


def _backward_rule(ctx, dout, dlse, dsaved):
    q, k, v, sinks, cu, out, lse, *saved = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    grad_sinks = sinks is not None and bool(ctx.needs_input_grad[3])
    dq, dk, dv, ds = backward_op(dout, dlse, out, lse, q, k, v, list(saved), sinks, cu, ctx.key, grad_sinks)
    return dq, dk, dv, ds if grad_sinks else None, None, None


attention_op.register_autograd(_backward_rule, setup_context=_setup_context)
