"""LASP-2H: a hybrid model (gated linear + softmax layers on one zigzag layout) trained with sequence
parallelism gives the single-process losses and parameter gradients, step after step."""

from __future__ import annotations

import pytest

import seqpar
from examples.hybrid_lasp2h import ModelConfig, compare, train_single, train_sp
from seqpar.hybrid import HybridContext

# the all-gather KV method is the LASP-2H choice; the ring computes the same thing on the same layout
SOFTMAX = "allgather" if "allgather" in seqpar.methods.available() else "ring"
TOL = 1e-9          # fp64 model: differences are rounding only


def _check(results, single):
    for r in results[1:]:
        assert all(a.equal(b) for a, b in zip(r["loss"], results[0]["loss"])), "ranks disagree on the loss"
    diff = compare(results[0], single)
    assert diff["loss"] <= TOL and diff["grads"] <= TOL, diff


@pytest.mark.parametrize("world", [2, 4])
def test_training_matches_single_process(pools, world):
    cfg = ModelConfig()
    results = pools(world).run(train_sp, cfg, 2, 24, 3, SOFTMAX)
    _check(results, train_single(cfg, 2, 24, 3))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_documents_and_padding(pools, layout):
    """Packed documents spanning ranks and a length the layout does not divide (end padding)."""
    cfg = ModelConfig(layers="SLL")
    docs = (0, 5, 14, 21)
    results = pools(4).run(train_sp, cfg, 1, 21, 2, SOFTMAX, layout, docs)
    _check(results, train_single(cfg, 1, 21, 2, docs))


def test_context_needs_one_layout_for_both_layer_types():
    with pytest.raises(ValueError, match="layout must be accepted by both layer types"):
        HybridContext(layout="stripe", softmax_method="ring")
    with pytest.raises(ValueError, match="softmax_method must be one of"):
        HybridContext(softmax_method="flash")
    with pytest.raises(ValueError, match="method must be one of"):
        HybridContext(softmax_method="ring", linear_method="lasp3")
