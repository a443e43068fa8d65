"""Sub-chunked layouts: same placement as the base, sub-chunks tile every rank's rows exactly once."""

from __future__ import annotations

import pytest
import torch

from seqpar.layouts import Contiguous, Stripe, Zigzag
from seqpar.layouts.blocks import slice_rows
from seqpar.layouts.subchunks import Subchunked


@pytest.mark.parametrize("base_cls", [Contiguous, Zigzag, Stripe])
@pytest.mark.parametrize("world,parts", [(1, 1), (2, 1), (3, 2), (4, 3), (5, 4)])
def test_subchunks_tile_rows_and_keep_positions(base_cls, world, parts):
    base = base_cls(world)
    lay = Subchunked(world, base=base, parts=parts)
    seq = lay.divisor * parts * 2 + lay.divisor          # parts a row apart (Note [Uneven sub-chunks])
    x = torch.arange(seq).view(1, seq, 1, 1)
    assert torch.equal(lay.unshard([lay.shard(x, r) for r in range(world)]), x)
    for r in range(world):
        seg = lay.segments(r, seq)
        assert seg == base.segments(r, seq)
        rows = lay.piece_rows(seg.length)
        cells = sorted(i for sub in rows for a, b in sub for i in range(a, b))
        assert cells == list(range(seg.length))
        pos = seg.positions()
        for sub in rows:
            for a, b in sub:
                assert slice_rows(seg, a, b).positions() == pos[a:b]


def test_divisor_and_message():
    """The base layout's divisor (Note [Uneven sub-chunks]): sub-chunks need not be equal."""
    lay = Subchunked(4, base=Zigzag(4), parts=3)
    assert lay.divisor == 8
    lay.check_len(16)
    with pytest.raises(ValueError, match="multiple of 8 for the zigzag layout"):
        lay.check_len(20)
    with pytest.raises(ValueError):
        Subchunked(4, base=Zigzag(3), parts=3)


def test_slice_rows_keeps_documents():
    seg = Zigzag(2).segments(0, 16).cut([0, 3, 16])
    part = slice_rows(seg, 2, 6)
    assert part.positions() == seg.positions()[2:6]
    assert [r.doc for r in part.runs] == [0, 1, 1]
