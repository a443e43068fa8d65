"""The Ulysses all-to-all (``seqpar.comm.all_to_all``): placement of every head and row, GQA head slots,
and backward = adjoint (replicated KV heads' gradients summed)."""

from __future__ import annotations

import pytest
import torch
from _workers_ulysses import a2a_check

from seqpar.comm.all_to_all import HeadSlots


def test_head_slots_rules():
    assert HeadSlots.valid_degrees(12, 6) == [1, 2, 3, 6, 12]
    assert HeadSlots.valid_degrees(12, 4) == [1, 2, 4, 12]
    assert HeadSlots.valid_degrees(8, 1) == [1, 2, 4, 8]
    s = HeadSlots(8, 2, 4)
    assert (s.q_per_rank, s.kv_per_rank, s.replicas) == (2, 1, 2)
    s = HeadSlots(8, 8, 4)
    assert (s.q_per_rank, s.kv_per_rank, s.replicas) == (2, 2, 1)
    with pytest.raises(ValueError, match=r"valid degrees: \[1, 2, 3, 6, 12\]"):
        HeadSlots(12, 6, 4)


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_all_to_all_placement_and_adjoint(pools, kv_heads):
    """World 4, H = 8: every head and row lands where Note [Ulysses all-to-all] says, each rank gets exactly
    the KV heads its query heads use, and backward is the adjoint (fp64: exact up to rounding)."""
    for spec in [(2, 3, 8, kv_heads, 4, "float64"), (1, 2, 8, kv_heads, 2, "bfloat16")]:
        results = pools(4).run(a2a_check, spec)
        adjoint_limit = 1e-12 if spec[-1] == "float64" else 1e-2       # bf16 cotangents round on the way back
        for r, err in enumerate(results):
            assert err.pop("grad_dtype") == 0.0, f"rank {r}: gradients do not have the input dtype ({spec})"
            for name, e in err.items():
                limit = adjoint_limit if name.startswith("adjoint") else 0.0     # moves are exact copies
                assert e <= limit, f"rank {r}: {name} error {e:.2e} ({spec})"


def test_wide_copies_move_the_same_bits():
    """Note [Wide copies]: a permutation copy on 16-byte views equals the plain one, broadcasts included; a head
    whose bytes are not a multiple of 16, or an unaligned view, takes the plain copy."""
    from seqpar.comm.all_to_all import _copy, _wide, contiguous

    x = torch.randn(2, 6, 4, 16).to(torch.bfloat16)
    assert _wide(x.movedim(1, 0)) is not None
    assert torch.equal(contiguous(x.movedim(1, 0)), x.movedim(1, 0).contiguous())
    dst = torch.empty(3, 2, 6, 4, 16, dtype=torch.bfloat16)
    assert torch.equal(_copy(dst, x.unsqueeze(0)), x.unsqueeze(0).expand_as(dst))
    odd = torch.randn(2, 6, 4, 6)                                   # 24-byte heads
    assert _wide(odd) is None
    assert torch.equal(contiguous(odd.movedim(1, 0)), odd.movedim(1, 0).contiguous())
    assert _wide(x[..., 1:9]) is None                               # an address off 16 bytes
