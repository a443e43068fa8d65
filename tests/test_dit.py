"""Joint (text + image) attention for DiT, xDiT style, against the same block on one device.

Text tokens replicated on every rank, image tokens sharded; non-causal. Outputs, input gradients (image
gathered, text summed over the group: Note [Replicated text: partial-sum gradients]) and group-summed
parameter gradients match ``JointAttention(method=None)`` on the whole sequence (fp64, 1e-10).

xDiT defects it must not have (PEERS.md §10): the joint text K/V are attended by every query (the check
includes a proof that the text changes the image outputs); the group passed in is used, not the world
(a 2 x 2 data x sequence mesh, each replica with its own data); backward exists (4: inference only).
"""

from __future__ import annotations

import pytest
from _workers_dit import block_compare, function_compare, joint_error

import seqpar

TOL = 1e-10


def _available(name: str) -> bool:
    return name in seqpar.methods.available()


def _check(results, label):
    for r, errors in enumerate(results):
        effect = errors.pop("text_effect", None)
        bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= TOL}
        assert not bad, f"{label} rank {r}: {bad}"
        if effect is not None:
            assert effect > 1e-2, f"{label}: the text hardly changes the image outputs ({effect:.1e}); vacuous test"


@pytest.mark.parametrize("world", [2, 4])
def test_block_usp(pools, world):
    """USP (U x R = 2 x 1 and 2 x 2), T = 6 and 1 (uneven: padding ends the joint sequence) and T = 8."""
    for text in (6, 1, 8):
        spec = {"method": "usp", "ulysses": 2, "text": text}
        _check(pools(world).run(block_compare, spec), str(spec))


@pytest.mark.parametrize("method", ["ring", "ulysses", "tokenring", "allgather"])
def test_block_other_methods(pools, method):
    if not _available(method):
        pytest.skip(f"method {method!r} is not merged yet")
    spec = {"method": method, "text": 5 if method == "ulysses" else 3}     # padding at both ends / the end
    _check(pools(4).run(block_compare, spec), str(spec))


def test_function_gqa_and_fp32(pools):
    """joint_attention on heads: GQA (2 KV heads for 4 query heads), fp64 and fp32 (1e-5)."""
    for spec, tol in (({"method": "usp", "ulysses": 2, "text": 5, "kv_heads": 2}, TOL),
                      ({"method": "ring", "text": 9, "kv_heads": 1}, TOL),
                      ({"method": "usp", "ulysses": 2, "text": 5, "dtype": "float32"}, 1e-5)):
        for r, errors in enumerate(pools(4).run(function_compare, spec)):
            bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= tol}
            assert not bad, f"{spec} rank {r}: {bad}"


def test_block_on_a_data_by_sequence_mesh(pools):
    """2 replicas x 2 sequence ranks, different data per replica: each matches its own single-device run."""
    for spec in ({"method": "usp", "ulysses": 2, "dp": 2, "text": 5}, {"method": "ring", "dp": 2, "text": 5}):
        _check(pools(4).run(block_compare, spec), str(spec))


def test_text_padding_no_layout_can_place_raises(pools):
    """Ulysses (contiguous only), T = 1 over 4 ranks: 3 padding rows, but the ends of the joint sequence are on
    the first and the last rank, each with a 1-row text slot: a clear error, not a wrong answer."""
    for r, res in enumerate(pools(4).run(joint_error, {"method": "ulysses", "text": 1})):
        assert res is not None and res[0] == "ValueError", res
        assert "leaves 3 padding rows that no layout of method 'ulysses' (['contiguous'])" in res[1], res[1]
        assert f"(rank {r} of 4)" in res[1]
