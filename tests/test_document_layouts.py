"""Document layouts (``seqpar.layouts.documents``) in one process: round trips, ring-flash-attn's
conventions, the balanced layout's token and work balance, edge cases, errors, and the planner on them."""

from __future__ import annotations

import bisect
import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_blocks import _check

from seqpar.layouts import (
    ALL_LAYOUT_NAMES,
    DOCUMENT_LAYOUTS,
    LAYOUTS,
    Balanced,
    BalancedWhole,
    DocContiguous,
    DocZigzag,
    Rule,
    Zigzag,
    make_layout,
)

WORLDS = [1, 2, 3, 4, 8]


def _bounds(lengths) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def _lengths(rng: random.Random, multiple: int, docs: int) -> list[int]:
    """Random document lengths that are multiples of ``multiple`` (empty ones included)."""
    return [multiple * rng.choice([0, 1, 1, 2, 3, 7]) for _ in range(docs)]


def _layouts(world: int, rng: random.Random) -> list[tuple[object, int]]:
    """``(layout, sharded length)`` for every layout at ``world``, the document ones with end padding."""
    out = [(cls(world), cls(world).divisor * 3) for cls in LAYOUTS.values()]
    for cls, multiple in ((DocContiguous, world), (DocZigzag, 2 * world)):
        bounds = _bounds([multiple, *_lengths(rng, multiple, 6)])
        out.append((cls(world, bounds), bounds[-1] + 2 * world))
    bounds = _bounds([rng.randint(0, 9) for _ in range(7)] + [5])
    out.append((Balanced(world, bounds), -(-(bounds[-1] + 3) // world) * world))
    return out


def _work(lay, seq_len: int) -> list[int]:
    """Causal work per rank, token by token: a token at offset p of its document sees p + 1 keys."""
    b = lay.bounds

    def one(p: int) -> int:
        return 0 if p >= b[-1] else p - b[bisect.bisect_right(b, p) - 1] + 1
    return [sum(one(p) for p in lay.segments(r, seq_len).positions()) for r in range(lay.world)]


@pytest.mark.parametrize("world", WORLDS)
def test_unshard_of_shards_is_identity_and_positions_a_permutation(world):
    rng = random.Random(world)
    for lay, seq in _layouts(world, rng):
        x = torch.randn(2, seq, 3)
        parts = [lay.shard(x, r) for r in range(world)]
        assert all(p.shape == (2, seq // world, 3) for p in parts), lay
        torch.testing.assert_close(lay.unshard(parts), x)
        owned = sorted(int(p) for r in range(world) for p in lay.positions(r, seq))
        assert owned == list(range(seq)), lay


def _ring_flash_attn_local(x: torch.Tensor, cu_seqlens, rank: int, world: int, zigzag: bool) -> torch.Tensor:
    """ring-flash-attn's test-side ``extract_local`` for its varlen functions, written out again: every
    document chunked (torch.chunk) into W parts (part r) or 2W parts (parts r and 2W-1-r), in document order."""
    local = []
    for start, end in itertools.pairwise(cu_seqlens):
        parts = x[start:end].chunk(2 * world if zigzag else world, dim=0)
        local += [parts[rank], parts[2 * world - 1 - rank]] if zigzag else [parts[rank]]
    return torch.cat(local, dim=0)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_doc_layouts_are_ring_flash_attn_conventions(world):
    rng = random.Random(10 + world)
    for cls, multiple, zigzag in ((DocContiguous, world, False), (DocZigzag, 2 * world, True)):
        cu = _bounds([multiple * rng.randint(1, 5) for _ in range(rng.randint(1, 6))])
        lay = cls(world, cu)
        x = torch.arange(cu[-1])
        for r in range(world):
            assert lay.shard(x, r, dim=0).tolist() == _ring_flash_attn_local(x, cu, r, world, zigzag).tolist()


def test_ring_flash_attn_test_documents():
    """The cu_seqlens of ring-flash-attn's own varlen tests at W = 8, and the diagram of the module docstring."""
    for cls, cu in ((DocContiguous, (0, 120, 1248, 4232)), (DocZigzag, (0, 128, 1248, 4240))):
        lay = cls(8, cu)
        x = torch.arange(cu[-1])
        for r in range(8):
            assert torch.equal(lay.shard(x, r, dim=0), _ring_flash_attn_local(x, cu, r, 8, cls is DocZigzag))
    cu = (0, 8, 12, 16)
    assert DocContiguous(2, cu).positions(0, 16).tolist() == [0, 1, 2, 3, 8, 9, 12, 13]
    assert DocZigzag(2, cu).positions(0, 16).tolist() == [0, 1, 6, 7, 8, 11, 12, 15]
    bal = Balanced(2, _bounds([12, 4, 3, 3, 2]))
    assert bal.positions(0, 24).tolist() == [0, 1, 2, 9, 10, 11, 12, 15, 16, 17, 18, 22]
    assert _work(bal, 24) == [51, 52]


# ---- the balanced layout ----

S = 128 * 1024


def _packed(rng: random.Random, long_tail: bool) -> tuple[int, ...]:
    """A 128K row of documents: lognormal lengths with mean 2K, or 80% of those and 20% Pareto(1.1) from 8K
    (up to the whole row); the last document is cut at the row's end."""
    mu, lengths = math.log(2048) - 0.5, []
    while sum(lengths) < S:
        n = 8192 * rng.paretovariate(1.1) if long_tail and rng.random() < 0.2 else rng.lognormvariate(mu, 1.0)
        lengths.append(min(max(1, round(n)), S - sum(lengths)))
    return _bounds(lengths)


@pytest.mark.parametrize("long_tail", [False, True])
def test_balanced_equal_tokens_and_work_within_5_percent_at_w8(long_tail):
    rng = random.Random(7 + long_tail)
    for _ in range(3):
        lay = Balanced(8, _packed(rng, long_tail))
        assert {lay.segments(r, S).length for r in range(8)} == {S // 8}
        work = _work(lay, S)
        assert max(work) <= 1.05 * sum(work) / 8, work


@pytest.mark.parametrize("long_tail", [False, True])
def test_balanced_whole_keeps_documents_that_fit_whole_with_equal_tokens_and_work(long_tail):
    """Note [Whole documents]: the same balance as ``balanced``; only documents longer than a rank's tokens are
    split over every rank, and each rank cuts at most two more - so far fewer runs per rank."""
    rng = random.Random(7 + long_tail)
    C = S // 8
    for _ in range(3):
        bounds = _packed(rng, long_tail)
        whole, zig = BalancedWhole(8, bounds), Balanced(8, bounds)
        assert {whole.segments(r, S).length for r in range(8)} == {C}
        work = _work(whole, S)
        assert max(work) <= 1.05 * sum(work) / 8, work
        held = [set() for _ in range(len(bounds) - 1)]          # the ranks holding part of each document
        for r in range(8):
            for run in whole.segments(r, S).cut(bounds).runs:
                held[run.doc].add(r)
        long_docs = sum(b - a > C for a, b in itertools.pairwise(bounds))
        cut = [d for d, ranks in enumerate(held) if len(ranks) > 1]
        assert len(cut) <= long_docs + 2 * 8, (len(cut), long_docs)
        assert all(len(held[d]) == 8 for d, (a, b) in enumerate(itertools.pairwise(bounds)) if b - a > C)
        runs = [len(whole.segments(r, S).runs) for r in range(8)]
        assert sum(runs) < sum(len(zig.segments(r, S).runs) for r in range(8)), runs
    assert make_layout("balanced_whole", 4, (0, 3, 8)) == BalancedWhole(4, (0, 3, 8)) != Balanced(4, (0, 3, 8))


def test_balanced_edge_cases():
    # documents shorter than one zigzag chunk (1 token each, W = 8): every rank gets 16 whole ones
    lay = Balanced(8, tuple(range(129)))
    assert all(len(lay.segments(r, 128).cut(lay.bounds).runs) == 16 for r in range(8))
    assert _work(lay, 128) == [16] * 8
    # empty documents anywhere
    lay = Balanced(4, (0, 0, 5, 5, 5, 30, 32, 32))
    assert sorted(p for r in range(4) for p in lay.positions(r, 32).tolist()) == list(range(32))
    # one document over the whole row: exactly zigzag
    for world in (2, 4, 8):
        seq = 16 * world
        assert all(Balanced(world, (0, seq)).positions(r, seq).tolist() == Zigzag(world).positions(r, seq).tolist()
                   for r in range(world))
    # padding at the end: placed, document -1, no work; tokens still equal
    lay = Balanced(4, _bounds([30, 5, 2]))
    pads = [sum(1 for run in lay.segments(r, 48).cut(lay.bounds).runs if run.doc < 0 for _ in range(run.length))
            for r in range(4)]
    assert sum(pads) == 11 and all(lay.segments(r, 48).length == 12 for r in range(4))
    assert max(_work(lay, 48)) - min(_work(lay, 48)) <= 30
    # W = 1: the identity order
    lay = Balanced(1, _bounds([5, 900, 3, 40]))
    assert lay.positions(0, 950).tolist() == list(range(950))


def test_balanced_is_deterministic_and_cached_by_value():
    bounds = _packed(random.Random(3), True)
    a = [Balanced(8, bounds).positions(r, S) for r in range(8)]
    b = [Balanced(8, tuple(list(bounds))).positions(r, S) for r in range(8)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert Balanced(8, bounds) == Balanced(8, torch.tensor(bounds))         # tensors become int tuples


# ---- registry and errors ----

def test_registry_and_make_layout():
    assert set(ALL_LAYOUT_NAMES) == {*LAYOUTS, *DOCUMENT_LAYOUTS}
    assert not any(cls.documents for cls in LAYOUTS.values())
    assert all(cls.documents for cls in DOCUMENT_LAYOUTS.values())
    assert make_layout("zigzag", 4, cu_seqlens=[0, 3, 8]) == Zigzag(4)          # plain layouts ignore documents
    assert make_layout("balanced", 4, torch.tensor([0, 3, 8])) == Balanced(4, (0, 3, 8))
    with pytest.raises(ValueError, match=r"cu_seqlens .* must be given for the doc_zigzag layout"):
        make_layout("doc_zigzag", 4)
    with pytest.raises(ValueError, match=r"layout must be one of .*'balanced'"):
        make_layout("spiral", 4)


@pytest.mark.parametrize("bounds", [(), (0,), (1, 8), (0, 5, 3, 8), (0, 0)])
def test_bad_bounds(bounds):
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0, be non-decreasing and end at the valid length"):
        Balanced(4, bounds)


def test_length_errors_name_the_document_and_what_is_needed():
    with pytest.raises(ValueError, match=r"document 3 has length 10, not a multiple of 2W = 8 for the doc_zigzag "
                                         r"layout over 4 ranks \(cu_seqlens\[3:5\] = \(24, 34\)"):
        DocZigzag(4, (0, 8, 16, 24, 34, 42))
    with pytest.raises(ValueError, match=r"document 0 has length 6, not a multiple of W = 4 for the doc_contiguous"):
        DocContiguous(4, (0, 6, 8))
    lay = Balanced(4, (0, 5, 10))
    with pytest.raises(ValueError, match=r"at least the documents' end cu_seqlens\[-1\] = 10 for the balanced layout"):
        lay.local_len(8)
    with pytest.raises(ValueError, match=r"multiple of 4 for the balanced layout over 4 ranks, got 14 \(pad to 16"):
        lay.local_len(14)
    assert lay.local_len(12) == 3 and DocZigzag(2, (0, 4, 12)).divisor == 4


# ---- the planner on balanced layouts ----

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(0, 12), min_size=1, max_size=14), st.integers(0, 7),
       st.booleans(), st.sampled_from([(-1, -1), (3, -1), (0, 2)]), st.data())
def test_plan_over_balanced_layouts_covers_the_dense_mask(world, lengths, pad, causal, window, data):
    bounds = _bounds([*lengths[:-1], lengths[-1] + 1])
    seq = -(-(bounds[-1] + pad) // world) * world
    lay = Balanced(world, bounds)
    r, j = data.draw(st.integers(0, world - 1)), data.draw(st.integers(0, world - 1))
    _check(lay.segments(r, seq).cut(bounds), lay.segments(j, seq).cut(bounds), Rule(causal, window))


def test_every_layout_name_builds():
    for name in ALL_LAYOUT_NAMES:
        lay = make_layout(name, 2, (0, 4, 8))
        assert lay.name == name and lay.world == 2


# ---- shard_info ----

def test_shard_info_for_document_layouts():
    from seqpar.layouts.varlen import shard_info

    cu = (0, 8, 24, 32)
    for cls, world in ((DocContiguous, 4), (DocZigzag, 2), (DocZigzag, 4)):
        lay = cls(world, cu)
        local_cu = lay.local_cu_seqlens()
        assert local_cu == tuple(c // world for c in cu)                            # ring-flash-attn's local cu
        for r in range(world):
            info = shard_info(lay, r, 32)
            for d, (a, b) in enumerate(itertools.pairwise(local_cu)):
                assert info.documents[a:b].tolist() == [d] * (b - a)
            # segments are runs of consecutive positions: doc_zigzag's two chunks of a document are two
            assert set(local_cu) <= set(info.cu_seqlens.tolist())
            one = cls is DocContiguous or r == world - 1                  # rank W-1's chunks W-1 and W touch
            assert len(info.cu_seqlens) - 1 == (len(cu) - 1) * (1 if one else 2)
            assert torch.equal(info.positions, lay.positions(r, 32))
            docs = torch.tensor([bisect.bisect_right(cu, int(p)) - 1 for p in info.positions])
            assert torch.equal(info.documents, docs)
            assert torch.equal(info.positions_in_document, info.positions - torch.tensor(cu)[docs])
            assert not info.pad_mask.any() and info.padded_len == 32
    lay = Balanced(4, (0, 3, 10, 21))                                               # 21 valid, padded to 24
    infos = [shard_info(lay, r, 21) for r in range(4)]
    assert [int(i.pad_mask.sum()) for i in infos] != [0] * 4 and sum(int(i.pad_mask.sum()) for i in infos) == 3
    assert all(i.padded_len == 24 and i.positions.numel() == 6 for i in infos)
    for i in infos:
        for a, b in itertools.pairwise(i.cu_seqlens.tolist()):                      # one document per segment
            assert len(set(i.documents[a:b].tolist())) == 1
            assert i.max_seqlen >= b - a
    assert shard_info(lay, 0, 21, cu_seqlens=[0, 3, 10, 21]).seq_len == 21
    with pytest.raises(ValueError, match=r"cu_seqlens must be the documents the balanced layout was built for"):
        shard_info(lay, 0, 21, cu_seqlens=[0, 10, 21])
