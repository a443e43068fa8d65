"""Layouts in one process: ownership rules, shard/unshard round trips, positions."""

import pytest
import torch

from seqpar.layouts import Contiguous, Nested, Stripe, Zigzag, make_layout


@pytest.mark.parametrize("cls", [Contiguous, Zigzag, Stripe])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_unshard_of_shards_is_identity(cls, world):
    lay = cls(world)
    x = torch.randn(2, lay.divisor * 3, 3)
    parts = [lay.shard(x, r) for r in range(world)]
    assert all(p.shape == (2, x.shape[1] // world, 3) for p in parts)
    torch.testing.assert_close(lay.unshard(parts), x)
    owned = sorted(int(p) for r in range(world) for p in lay.positions(r, x.shape[1]))
    assert owned == list(range(x.shape[1]))


def test_ownership_rules():
    assert Zigzag(4).positions(1, 16).tolist() == [2, 3, 12, 13]      # chunks r and 2W-1-r
    assert Stripe(4).positions(1, 16).tolist() == [1, 5, 9, 13]       # token i on rank i mod W
    assert Contiguous(4).positions(1, 16).tolist() == [4, 5, 6, 7]


def test_nested_usp_placement_both_orders():
    """USP: ring layout over R, each ring shard split contiguously over U (index = rho * U + u)."""
    lay = Nested(4, outer=Zigzag(2), inner=2)
    assert [lay.positions(i, 16).tolist() for i in range(4)] == [[0, 1, 2, 3], [12, 13, 14, 15],
                                                                 [4, 5, 6, 7], [8, 9, 10, 11]]
    x = torch.arange(16.0).view(1, 16)
    torch.testing.assert_close(lay.unshard([lay.shard(x, i) for i in range(4)]), x)


def test_lengths_that_do_not_divide_say_what_is_needed():
    with pytest.raises(ValueError, match=r"multiple of 8 .*zigzag.*got 12 \(pad to 16"):
        Zigzag(4).local_len(12)
    with pytest.raises(ValueError, match="layout must be one of"):
        make_layout("spiral", 2)
