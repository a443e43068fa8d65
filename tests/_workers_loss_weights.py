"""Worker-side code of tests/test_hf_loss_weights.py: per-token loss weights through ``shard_batch`` and
``sequence_parallel_loss`` on W ranks against one process's weighted loss (Note [Weighted token loss]).

Every rank builds the same tiny fp64 Llama twice: the reference runs the global batch in one process with
the weighted mean written out in plain torch; the sequence-parallel copy runs its shard and the tiled weighted
loss. The worker returns normalised errors and bitwise checks; the parent asserts on them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _workers_hf import _errors, build, global_batch, make_mesh, reference_inputs

from seqpar.integrations import huggingface as sp_hf
from seqpar.integrations.hf.grads import _group_size, _reduce_groups
from seqpar.testing import rel_error

NAME = "seqpar_loss_weights"
SPAN = (6, 18)
"""Tokens ``[6, 18)`` weighted 0.25 (the "vision" span), the rest in [0.5, 2.5); token 3 weighted 0."""


def global_weights(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same ``(B, S)`` fp64 weight per token (as a target) on every rank."""
    B, S = batch["input_ids"].shape
    g = torch.Generator().manual_seed(7)
    w = 0.5 + 2 * torch.rand(B, S, generator=g, dtype=torch.float64)
    w[:, SPAN[0]:SPAN[1]] = 0.25
    w[:, 3] = 0.0
    return w


def _reference_loss(model, batch: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """One process's weighted mean over the global sequence: ``sum w_t ce_t / sum w_t`` over the targets."""
    inputs = reference_inputs(batch)
    labels = inputs.pop("labels")
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    logits = hidden @ model.lm_head.weight.t()
    y = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], 1).reshape(-1)
    wt = torch.cat([w[:, 1:], w.new_zeros((w.shape[0], 1))], 1).reshape(-1)
    ce = torch.nn.functional.cross_entropy(logits.reshape(y.numel(), -1), y, reduction="none")
    seen = y != -100
    return (ce * wt)[seen].sum() / wt[seen].sum()


def weighted_compare(spec: dict[str, Any]) -> dict[str, Any]:
    """The weighted loss and every parameter gradient of a sequence-parallel step against one process's.

    spec keys: method, layout, ulysses (usp), seq, docs, cu, chunk, grad_reduction.
    """
    mesh = make_mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout", "zigzag"), name=NAME)
    try:
        return _weighted_compare(spec, mesh, handle)
    finally:
        handle.disable()


def _weighted_compare(spec: dict[str, Any], mesh: Any, handle: Any) -> dict[str, Any]:
    reduction = spec.get("grad_reduction", "sum")
    groups = _reduce_groups(mesh)
    ref = build("llama", "sdpa", dtype=torch.float64)
    sp = build("llama", handle.name, dtype=torch.float64)
    batch = global_batch(spec)
    batch["labels"][:, 10] = -100
    w = global_weights(batch)
    ref_loss = _reference_loss(ref, batch, w)
    ref_loss.backward()

    local = handle.shard_batch({**batch, "loss_weights": w})
    lw = local.pop("loss_weights")
    feed = {k: v for k, v in local.items() if k not in ("labels", "shift_labels", "num_items_in_batch")}
    hidden = sp.model(**feed, use_cache=False).last_hidden_state
    res = sp_hf.sequence_parallel_loss(hidden, sp.lm_head.weight, local["shift_labels"], mesh, weights=lw,
                                       chunk_size=spec.get("chunk"), grad_reduction=reduction)
    res.loss.backward()
    sp_hf.all_reduce_gradients(sp.parameters(), mesh, op=reduction)
    total = res.loss.detach().clone()
    for g in groups:
        dist.all_reduce(total, group=g)
    if reduction == "mean":
        total = total / _group_size(groups)
    errors: dict[str, float] = {"value": rel_error(res.value, ref_loss.detach()),
                                "loss": rel_error(total, ref_loss.detach())}
    _errors("grad:", sp, ref, errors)
    out: dict[str, Any] = {"errors": errors, "tokens": float(res.tokens), "ref_tokens": _weight_sum(batch, w)}
    out.update(_identities(spec, mesh, handle, batch, w, hidden.detach(), sp.lm_head.weight.detach()))
    return out


def _weight_sum(batch: dict[str, torch.Tensor], w: torch.Tensor) -> float:
    labels = reference_inputs(batch)["labels"]
    return float(w[:, 1:][labels[:, 1:] != -100].sum())


def _loss_and_grads(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, mesh: Any,
                    **kw: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
    h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
    res = sp_hf.sequence_parallel_loss(h, w, labels, mesh, **kw)
    return res, torch.autograd.grad(res.loss, (h, w))


def _same(a: tuple[Any, tuple[torch.Tensor, ...]], b: tuple[Any, tuple[torch.Tensor, ...]]) -> bool:
    """Bitwise: loss share, group value, denominator and the gradients of hidden and the head."""
    (ra, ga), (rb, gb) = a, b
    return (torch.equal(ra.loss, rb.loss) and torch.equal(ra.value, rb.value)
            and float(ra.tokens) == float(rb.tokens) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True)))


def _identities(spec: dict[str, Any], mesh: Any, handle: Any, batch: dict[str, torch.Tensor], w: torch.Tensor,
                hidden: torch.Tensor, head: torch.Tensor) -> dict[str, Any]:
    """Bitwise identities on this rank's hidden states: weights of ones = unweighted; zero weights on the span
    = that span ignored; and ``num_items`` replacing the weight sum."""
    chunk = spec.get("chunk")
    local = handle.shard_batch({**batch, "loss_weights": w})
    labels, lw = local["shift_labels"], local["loss_weights"]
    plain = _loss_and_grads(hidden, head, labels, mesh, chunk_size=chunk)
    ones = _loss_and_grads(hidden, head, labels, mesh, chunk_size=chunk, weights=torch.ones_like(lw))

    zeroed, ignored = w.clone(), batch["labels"].clone()
    zeroed[:, SPAN[0]:SPAN[1]] = 0.0                    # targets of the span's tokens
    ignored[:, SPAN[0]:SPAN[1]] = -100
    span_ones = torch.ones_like(w)
    span_ones[:, SPAN[0]:SPAN[1]] = 0.0
    z = handle.shard_batch({**batch, "loss_weights": zeroed})
    i = handle.shard_batch({**batch, "labels": ignored, "loss_weights": w})
    zo = handle.shard_batch({**batch, "loss_weights": span_ones})
    i_plain = handle.shard_batch({**batch, "labels": ignored})
    by_zero = _loss_and_grads(hidden, head, z["shift_labels"], mesh, chunk_size=chunk, weights=z["loss_weights"])
    by_ignore = _loss_and_grads(hidden, head, i["shift_labels"], mesh, chunk_size=chunk, weights=i["loss_weights"])
    ones_zero = _loss_and_grads(hidden, head, zo["shift_labels"], mesh, chunk_size=chunk, weights=zo["loss_weights"])
    plain_ignore = _loss_and_grads(hidden, head, i_plain["shift_labels"], mesh, chunk_size=chunk)

    weighted = _loss_and_grads(hidden, head, labels, mesh, chunk_size=chunk, weights=lw)
    given = _loss_and_grads(hidden, head, labels, mesh, chunk_size=chunk, weights=lw,
                            num_items=_weight_sum(batch, w))
    seven = _loss_and_grads(hidden, head, labels, mesh, chunk_size=chunk, weights=lw, num_items=7.5)
    none = _loss_and_grads(hidden, head, labels, mesh, chunk_size=chunk, weights=torch.zeros_like(lw))
    numerator = weighted[0].value * weighted[0].tokens
    return {
        "ones_equal_unweighted": _same(ones, plain),
        "zero_span_equals_ignored": _same(by_zero, by_ignore),
        "ones_zero_span_equals_unweighted_ignored": _same(ones_zero, plain_ignore),
        "num_items_weight_sum": rel_error(given[0].value, weighted[0].value),
        "num_items_7.5": rel_error(seven[0].value, numerator / 7.5),
        "num_items_tokens": float(seven[0].tokens),
        "all_zero": float(none[0].value) == 0.0 and float(none[0].loss.detach()) == 0.0
                    and all(bool((g == 0).all()) for g in none[1]),
    }


def placement_check(spec: dict[str, Any]) -> dict[str, Any]:
    """``shard_batch`` places ``loss_weights`` with the labels: token t's label is t and its weight t + 1, so
    wherever a target is seen the local weight is its label + 1, and 0 where none is (the last token, end
    padding); the bad weights raise naming the argument and this rank."""
    mesh = make_mesh(spec)
    S = spec.get("seq", 32)
    labels = torch.arange(S).expand(2, S).clone()
    w = (torch.arange(S, dtype=torch.float32) + 1).expand(2, S).clone()
    batch = {"input_ids": labels.clone(), "labels": labels, "loss_weights": w}
    if spec.get("docs") == "positions":
        batch["position_ids"] = torch.cat([torch.arange(5), torch.arange(S - 5)]).expand(2, S).clone()
    local = sp_hf.shard_batch(batch, mesh, method=spec["method"], layout=spec.get("layout"),
                              pad=spec.get("pad", False))
    y, lw = local["shift_labels"], local["loss_weights"]
    seen = y != -100
    out: dict[str, Any] = {
        "shape_like_labels": lw.shape == y.shape and lw.dtype == w.dtype,
        "aligned": bool((lw[seen] == (y[seen] + 1).to(lw.dtype)).all()),
        "ignored_are_zero": bool((lw[~seen] == 0).all()),
        "ignored": int((~seen).sum()),
    }
    raised = {}
    for name, bad in (("nan", w.masked_fill(w == 5, float("nan"))), ("negative", -w), ("int", labels),
                      ("shape", w[:, 1:]), ("alone", None)):
        kw = {"input_ids": labels, "labels": labels, "loss_weights": bad} if bad is not None else \
            {"input_ids": labels, "loss_weights": w}
        try:
            sp_hf.shard_batch(kw, mesh, method=spec["method"], layout=spec.get("layout"))
            raised[name] = None
        except (TypeError, ValueError) as e:
            raised[name] = str(e)
    out["raised"] = raised
    out["rank"] = f"(rank {dist.get_rank()} of {dist.get_world_size()})"
    return out
