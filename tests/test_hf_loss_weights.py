"""Per-token loss weights (issue 26, item 3; Note [Weighted token loss]): the loss is the weighted mean over the
GLOBAL sequence, ``sum_t w_t ce_t / sum_t w_t``, however the sequence is sharded.

- A tiny fp64 Llama at W = 1, 2 and 4 (ring zigzag; at W = 2 also ``grad_reduction="mean"``; at W = 4 USP 2 x 2
  on a packed batch, balanced): the weighted loss and every parameter gradient equal one process's weighted
  loss written out in plain torch, within 1e-12 (not bitwise: the ring's online softmax, the chunked loss and
  the all-reduce add in other orders than one process does).
- Bitwise, on every rank and in one process: weights of all ones = the unweighted loss (value, share,
  denominator and gradients); zero weights on a span = that span's labels set to ``ignore_index``; all-zero
  weights give a zero loss and zero gradients, no NaN.
- ``num_items`` replaces the weight sum (weights scale the numerator only).
- ``shard_batch`` shifts ``loss_weights`` like the labels and places them with the same layout; bad weights
  (NaN, negative, integer, wrong shape, without labels) raise naming the argument, the value and the rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _workers_loss_weights import placement_check, weighted_compare

from seqpar.integrations import huggingface as sp_hf

TOL = 1e-12
CASES = {
    1: [{"method": "ring", "layout": "zigzag", "chunk": 5}],
    2: [{"method": "ring", "layout": "zigzag", "chunk": 5},
        {"method": "ring", "layout": "zigzag", "grad_reduction": "mean"}],
    4: [{"method": "ring", "layout": "zigzag", "chunk": 3},
        {"method": "usp", "ulysses": 2, "layout": None, "docs": "positions", "cu": (0, 3, 20, 32), "chunk": 4}],
}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_weighted_loss_matches_single_process(pools, world):
    """Weighted loss, its share and every parameter gradient within 1e-12 of one process; the identities
    bitwise on every rank."""
    for spec in CASES[world]:
        for r, res in enumerate(pools(world).run(weighted_compare, {**spec, "seq": 32})):
            label = f"{spec} rank {r}"
            bad = {k: f"{v:.2e}" for k, v in res["errors"].items() if not v <= TOL}
            assert not bad, f"{label}: {bad}"
            assert any(k.startswith("grad:") for k in res["errors"]), label
            assert res["tokens"] == pytest.approx(res["ref_tokens"], rel=1e-14), label
            for key in ("ones_equal_unweighted", "zero_span_equals_ignored",
                        "ones_zero_span_equals_unweighted_ignored", "all_zero"):
                assert res[key] is True, f"{label}: {key}"
            assert res["num_items_weight_sum"] <= 1e-14, label
            assert res["num_items_7.5"] <= 1e-14 and res["num_items_tokens"] == 7.5, label


@pytest.mark.parametrize(("world", "spec"), [
    (2, {"method": "ring", "layout": "zigzag"}),
    (4, {"method": "ring", "layout": "zigzag", "seq": 30, "pad": True}),
    (4, {"method": "usp", "ulysses": 2, "layout": None, "docs": "positions"}),
])
def test_shard_batch_places_weights_with_the_labels(pools, world, spec):
    """Every local weight is that of the token its position predicts, on every layout; bad weights raise on
    every rank with the argument, the value and the rank in the message."""
    results = pools(world).run(placement_check, spec)
    assert sum(res["ignored"] for res in results) == 2 * (1 + 2 * spec.get("pad", False)), results   # end (+ pad)
    for r, res in enumerate(results):
        assert res["shape_like_labels"] and res["aligned"] and res["ignored_are_zero"], f"{spec} rank {r}: {res}"
        raised = res["raised"]
        assert all(msg is not None and res["rank"] in msg for msg in raised.values()), raised
        assert "loss_weights must be finite and non-negative, got nan" in raised["nan"]
        assert "loss_weights must be finite and non-negative, got -1.0" in raised["negative"]
        assert "loss_weights must be a floating tensor" in raised["int"] and "int64" in raised["int"]
        assert "loss_weights must have the shape of labels (2, " in raised["shape"]
        assert "loss_weights must come with labels or shift_labels" in raised["alone"]


def _loss(h, w, y, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    total, count = sp_hf.token_loss_sum(h, w, y, **kw)
    return total, count, torch.autograd.grad(total, (h, w))


def test_token_loss_sum_weights_one_process():
    """token_loss_sum alone: all-ones weights = unweighted bitwise (sum, gradients; the count as fp64 weight
    sum); a zero-weight span = those labels ignored, bitwise; chunked = one piece and = the full-logits
    weighted sum within fp64 rounding."""
    torch.manual_seed(0)
    h = torch.randn(2, 13, 8, dtype=torch.float64)
    w = torch.randn(11, 8, dtype=torch.float64)
    y = torch.randint(0, 11, (2, 13))
    y[0, 3] = y[1, 12] = -100
    wt = torch.rand(2, 13, dtype=torch.float64) * 3
    plain, n, g_plain = _loss(h, w, y, chunk_size=5)
    ones, n1, g_ones = _loss(h, w, y, chunk_size=5, weights=torch.ones(2, 13, dtype=torch.float64))
    assert torch.equal(plain, ones) and all(torch.equal(a, b) for a, b in zip(g_plain, g_ones, strict=True))
    assert n.dtype == torch.int64 and n1.dtype == torch.float64 and float(n1) == int(n) == 24

    zeroed, ignored = wt.clone(), y.clone()
    zeroed[:, 4:9] = 0
    ignored[:, 4:9] = -100
    a, na, ga = _loss(h, w, y, weights=zeroed, chunk_size=4)
    b, nb, gb = _loss(h, w, ignored, weights=wt, chunk_size=4)
    assert torch.equal(a, b) and torch.equal(na, nb) and all(torch.equal(p, q) for p, q in zip(ga, gb, strict=True))

    tiled, count, _ = _loss(h, w, y, weights=wt, chunk_size=5)
    whole, _, _ = _loss(h, w, y, weights=wt)
    ce = torch.nn.functional.cross_entropy((h @ w.t()).reshape(-1, 11), y.reshape(-1), reduction="none")
    seen = y.reshape(-1) != -100
    assert torch.allclose(tiled, whole, rtol=1e-13)
    assert torch.allclose(tiled, (ce * wt.reshape(-1)).sum(), rtol=1e-13)
    assert torch.allclose(count, wt.reshape(-1)[seen].sum(), rtol=1e-14)


def test_bad_weights_raise():
    """Each bad ``weights`` raises naming the argument and what it got (one process: no rank in the message)."""
    h, w = torch.randn(1, 6, 4), torch.randn(5, 4)
    y = torch.randint(0, 5, (1, 6))
    nan = torch.ones(1, 6)
    nan[0, 2] = float("nan")
    inf = torch.ones(1, 6)
    inf[0, 4] = float("inf")
    cases = [(torch.ones(1, 5), ValueError, r"weights must have the shape of shift_labels \(1, 6\), got \(1, 5\)"),
             (torch.ones(1, 6, dtype=torch.long), TypeError, "weights must be a floating tensor.*torch.int64"),
             (nan, ValueError, r"weights must be finite and non-negative, got nan at index \(0, 2\)"),
             (inf, ValueError, r"weights must be finite and non-negative, got inf at index \(0, 4\)"),
             (-torch.ones(1, 6), ValueError, r"got -1.0 at index \(0, 0\) \(6 such value"),
             ([1.0] * 6, TypeError, "weights must be a floating tensor shaped like shift_labels")]
    for bad, err, match in cases:
        with pytest.raises(err, match=match):
            sp_hf.token_loss_sum(h, w, y, weights=bad)
    with pytest.raises(ValueError, match="loss_weights must be finite and non-negative, got nan"):
        sp_hf.shard_batch({"input_ids": y, "labels": y, "loss_weights": nan})
