"""ring-flash-attn's names (``seqpar.flash_api``), fuzzed: random calls, made as a ring-flash-attn user makes
them, against the dense fp64 oracle (hypothesis).

A drawn call fixes the name - a family (ring, zigzag_ring, stripe, llama3), packing (none, kvpacked,
qkvpacked) and batch or varlen - and the call: world size, length (a multiple of the layout's), heads and KV
heads (equal where q, k and v come packed together), head dim, dtype (fp32 or fp64, where every result must be
exact: the low-precision rule's edge cases at a handful of tokens are the main fuzz's, ``tests/test_fuzz.py`` and
``seqpar.tolerances``; the names' bf16 plumbing is ``tests/test_flash_api.py``'s), causal, window, scale, and for varlen
names the documents (any boundaries, length-1 and empty documents included; for llama3 the all-gather's
``heads_k_stride`` too). Each is judged as ``tests/test_flash_api.py`` judges its fixed cases (out, lse, dq, dk,
dv, dtypes). CI runs a derandomized sample; the long run draws fresh ones::

    SEQPAR_FUZZ_EXAMPLES=200 python -m pytest tests/test_flash_api_fuzz.py -m slow -q -p no:cacheprovider
"""

from __future__ import annotations

import fuzzing
import pytest
from hypothesis import strategies as st
from reliability_methods import length_divisor
from test_flash_api import LAYOUT, _judge

from seqpar.testing import Case

EXAMPLES = 8


@st.composite
def calls(draw, world: int) -> tuple[Case, str]:
    family = draw(st.sampled_from([*LAYOUT, "llama3"]))
    packing = draw(st.sampled_from(["", "kvpacked_", "qkvpacked_"]))
    varlen = family == "llama3" or draw(st.booleans())
    name = f"{family}_flash_attn_{'varlen_' if varlen else ''}{packing}func"
    method, layout = ("allgather", draw(st.sampled_from(["contiguous", "zigzag"]))) if family == "llama3" \
        else ("ring", LAYOUT[family])
    div = length_divisor(method, layout, world)
    seq = div * draw(st.integers(1, max(1, 40 // div)))
    kv = draw(st.sampled_from([1, 2, 3]))
    heads = kv if packing == "qkvpacked_" else kv * draw(st.sampled_from([1, 2]))
    docs = None
    if varlen and draw(st.booleans()):
        cuts = draw(st.lists(st.integers(0, seq), max_size=4))
        docs = (0, *sorted(cuts), seq)
    window = (-1, -1)
    if draw(st.booleans()):
        window = (draw(st.integers(-1, seq)), draw(st.integers(-1, seq)))
    options = (("heads_k_stride", draw(st.sampled_from([d for d in (1, 2, 3) if kv % d == 0]))),) \
        if family == "llama3" and draw(st.booleans()) else ()
    case = Case(method=method, layout=layout, causal=draw(st.booleans()), seq_len=seq, heads=heads, kv_heads=kv,
                head_dim=draw(st.sampled_from([4, 8])), dtype=draw(st.sampled_from(["float32", "float64"])),
                window=window, cu_seqlens=docs, options=options, scale=draw(st.sampled_from([None, 0.5])),
                seed=draw(st.integers(0, 2**16)))
    return case, name


def _check(pools, world: int, call: tuple[Case, str]) -> None:
    report = _judge(pools(world), *call)
    assert report.ok, f"W={world} {call[1]} {call[0]!r}\n{report}"


@pytest.mark.parametrize("world", [2, 3])
def test_fuzz_flash_api(pools, world):
    fuzzing.sample(calls(world), EXAMPLES, lambda call: _check(pools, world, call))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_fuzz_flash_api_long(pools, world):
    fuzzing.long_run(calls(world), 100, lambda call: _check(pools, world, call), f"W={world}")
