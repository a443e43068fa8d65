"""Every softmax method x every named mask, and seeded ``mask_mod`` functions, against the fp64 oracle.

The oracle (``seqpar.testing.oracle``) evaluates the mask on the full grid, independently of the planner's
pieces (Note [Masks as pieces]) and its per-block classification (Note [Generic mask_mod]). W = 1, 2, 3, 4 and
8; out, lse, dq, dk, dv; with documents and end padding on some cases.
"""

from __future__ import annotations

import pytest
from conftest import assert_all_ok, run_cases_batched
from reliability_methods import SOFTMAX, length_divisor, softmax_setup

from seqpar import masks
from seqpar.methods import causal_layouts, get
from seqpar.testing import Case
from seqpar.testing.cases import HashMask

WORLDS = [1, 2, 3, 4, 8]


def _round(n: int, div: int) -> int:
    return div * max(1, -(-n // div))


def mask_cases(method: str, world: int, base_len: int = 8) -> list[Case]:
    """The named masks and two seeded mask_mods on ``method`` at ``world`` ranks."""
    setup = softmax_setup(method, world)
    causal_ok = setup.layout in causal_layouts(get(method))
    heads, kv_heads = {3: (6, 3), 8: (8, 2)}.get(world, (4, 2))
    S = _round(base_len * world, length_divisor(method, setup.layout, world, setup.ulysses))
    base = Case(method=method, layout=setup.layout, ulysses=setup.ulysses, options=setup.options, heads=heads,
                kv_heads=kv_heads, head_dim=8, seq_len=S, seed=world, causal=False, lse_grad=True)
    third = max(2, S // 3)
    docs = (0, S // 2 + 1, S - 3)                  # two documents and 3 rows of end padding
    named = [
        base.with_(mask=masks.chunked(third), causal=causal_ok),
        base.with_(mask=masks.chunked(third), causal=causal_ok, cu_seqlens=docs, valid_len=S - 3),
        base.with_(mask=masks.spans([(1, 4), (S // 2, S // 2 + third)])),
        base.with_(mask=masks.spans([(0, 3)], window=2)),
        base.with_(mask=masks.prefix_lm(third)),
        base.with_(mask=masks.block_causal(max(2, S // 5))),
        base.with_(mask=masks.shared_prefix(third, [third // 2 + 1, S - third - (third // 2 + 1)])),
        base.with_(mask=masks.sink_window(3, 2)),
        base.with_(mask=masks.sink_window(2, 3), cu_seqlens=docs, valid_len=S - 3),
    ]
    mods = [
        base.with_(mask=HashMask(world, keep=0.6), causal=causal_ok),
        base.with_(mask=HashMask(world + 1, keep=0.5, period=3), cu_seqlens=docs, valid_len=S - 3),
    ]
    return named + mods + _balanced(method, world, base_len)


def _balanced(method: str, world: int, base_len: int) -> list[Case]:
    """Named masks on ``balanced``, which places tokens by the visible pairs under the mask."""
    if "balanced" not in get(method).layouts or world == 8:
        return []
    setup = softmax_setup(method, world, "balanced")
    S = _round(base_len * world, length_divisor(method, "balanced", world, setup.ulysses))
    cu = (0, S // 3, S - 2)
    base = Case(method=method, layout="balanced", ulysses=setup.ulysses, options=setup.options, heads=4,
                kv_heads=2, head_dim=8, seq_len=S, seed=world, causal=False, cu_seqlens=cu, valid_len=S - 2)
    return [base.with_(mask=masks.shared_prefix(3, [2, max(1, S // 3 - 5), S // 2])),
            base.with_(mask=masks.chunked(3), causal=True),
            base.with_(mask=masks.chunked(3), causal=True, balance="causal"),     # placed by causal work
            base.with_(mask=masks.spans([(1, 3), (S // 2, S // 2 + 3)]), lse_grad=True)]


@pytest.mark.parametrize("world", WORLDS)
def test_masks_match_the_oracle(pools, world):
    cases = [c for m in SOFTMAX for c in mask_cases(m, world)]
    assert {c.method for c in cases} == set(SOFTMAX)
    assert_all_ok(run_cases_batched(pools(world), cases))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_open_bands_on_cpu_flash_match_the_oracle(pools, world):
    """Note [Open bands backwards] through the runtime: ``kernel="auto"`` on CPU runs a band open to the right - a
    windowed ring's farthest step, a frame's or an image's upper triangle - on the CPU flash kernel with its rows and
    keys reversed; ring (both layouts) and all-gather against the fp64 oracle, gradients and the lse's included."""
    import torch

    from seqpar.kernels.executor import TaskRunner
    from seqpar.layouts import make_layout
    from seqpar.layouts.blocks import Rule
    from seqpar.methods._passkv import schedule

    S = 16 * world
    sink = masks.sink_window(19, 2)                     # the window reaches past the neighbour's 16 rows
    steps = schedule(make_layout("contiguous", world), world - 1, S, Rule(False, mask=sink), None, None).steps
    runner = TaskRunner("auto", 0.1, training=True)
    chosen = [(t.mask, k) for st in steps if st for t, k in runner.kernels(st, (1, 16, 4, 8), (1, 16, 2, 8),
                                                                          torch.float32, "cpu")]
    assert any(m.lo is not None and m.hi is None and k == "cpu_flash" for m, k in chosen), chosen
    cases = [Case(method=method, layout=layout, heads=4, kv_heads=2, head_dim=8, seq_len=S, seed=world,
                  causal=causal, window=window, mask=mask, kernel="auto", lse_grad=True)
             for method, layout in (("ring", "contiguous"), ("ring", "zigzag"), ("allgather", "contiguous"))
             for causal, window, mask in ((False, (-1, -1), sink), (False, (-1, -1), masks.block_causal(5)),
                                          (False, (-1, -1), masks.spans([(1, 6), (S // 2, S // 2 + 9)])),
                                          (True, (21, 0), None))]
    assert_all_ok(run_cases_batched(pools(world), cases))
