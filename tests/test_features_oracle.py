"""Every softmax method against the fp64 oracle with the shapes and features current models use: a value head
dim other than the key's (MLA), attention sinks (with their gradient), softcapping, and the per-batch
``balanced`` layout on packed documents (documents shorter than a block, windows, end padding, the lse
gradient). W = 1, 2, 3, 4 and 8; out, lse, dq, dk, dv (and dsinks) against ``seqpar.testing``'s oracle.

All cases of one world size run in one pool call (the pools are shared across the test session).
"""

from __future__ import annotations

import pytest
from conftest import assert_all_ok, run_cases_batched
from reliability_methods import SOFTMAX, length_divisor, softmax_setup

from seqpar.methods import causal_layouts, get
from seqpar.testing import Case

WORLDS = [1, 2, 3, 4, 8]


def _round(n: int, div: int) -> int:
    return div * max(1, -(-n // div))


def _cases(method: str, world: int) -> list[Case]:
    """The feature cases of ``method`` at ``world`` ranks (fewer at W = 8, where 8 processes share 2 cores)."""
    module = get(method)
    feats = module.features
    setup = softmax_setup(method, world)
    heads, kv_heads = {3: (6, 3), 8: (8, 2)}.get(world, (4, 2))     # Ulysses at W splits the heads W ways
    base = Case(method=method, layout=setup.layout, ulysses=setup.ulysses, options=setup.options, heads=heads,
                kv_heads=kv_heads, head_dim=8, seed=world)
    causal = setup.layout in causal_layouts(module)
    S = _round(6 * world, length_divisor(method, setup.layout, world, setup.ulysses))
    out = []
    if {"value_dim", "sinks"} <= feats:             # MLA-style Dv with sinks, through lse too
        out.append(base.with_(seq_len=S, causal=causal, value_dim=4, sinks=True, lse_grad="lse_grad" in feats))
    if {"softcap", "sinks", "value_dim"} <= feats:  # softcap, full attention, GQA -> MQA
        out.append(base.with_(seq_len=S, causal=False, softcap=2.5, sinks=True, value_dim=12, kv_heads=1,
                              dtype="float64"))
    if "balanced" in module.layouts and (world < 8 or method == "ring"):
        out += _balanced(base, method, world)
    if "balanced_whole" in module.layouts:
        out += _balanced(base, method, world, "balanced_whole")[:1]
    return out


def _balanced(base: Case, method: str, world: int, layout: str = "balanced") -> list[Case]:
    """Packed documents on a balanced layout: tiny documents (shorter than a block), a long one split over
    every rank, end padding, a window, the lse gradient, causal and full (``balanced_whole``: the documents
    shorter than a rank's 10 tokens stay whole, the long ones are split)."""
    setup = softmax_setup(method, world, layout)
    S = _round(10 * world, length_divisor(method, layout, world, setup.ulysses))
    valid = S - 2
    cu = (0, 1, 3, 4, valid - 3 * world, valid)
    where = {"layout": layout, "ulysses": setup.ulysses, "cu_seqlens": cu, "seq_len": S}
    return [base.with_(**where, causal=True, valid_len=valid, window=(5, 0), lse_grad=True, sinks=True),
            base.with_(**where, causal=False, valid_len=valid, value_dim=4, kv_heads=1)]


@pytest.mark.parametrize("world", WORLDS)
def test_features_match_the_oracle(pools, world):
    cases = [c for m in SOFTMAX for c in _cases(m, world)]
    covered = {c.method for c in cases}
    assert covered == set(SOFTMAX), sorted(set(SOFTMAX) - covered)
    assert_all_ok(run_cases_batched(pools(world), cases, timeout=600))
