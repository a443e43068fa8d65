"""yunchang's layers (``seqpar.compat.yunchang``), fuzzed: random layers and calls, made as a yunchang user
makes them, against the dense fp64 reference (hypothesis).

A drawn call fixes the Ulysses and ring degrees (every factorisation of the world), the placement
(``use_ulysses_low``), the layer (``LongContextAttention``; ``AsyncLongContextAttention`` on Ulysses alone), the
``ring_impl_type`` with its extraction (basic, zigzag, strip), causal, heads and KV heads (GQA and MQA, fewer KV
heads than the Ulysses degree included; KV heads that neither divide nor are divided by it are refused by name,
``tests/test_ulysses.py``), batch, length, dtype and seed. Each is checked as
``tests/ports/test_compat.py`` checks its fixed cases (out, dq, dk, dv and their dtypes, the flash-attn rule).
CI runs a derandomized sample; the long run draws fresh ones::

    SEQPAR_FUZZ_EXAMPLES=100 python -m pytest tests/test_yunchang_fuzz.py -m slow -q -p no:cacheprovider
"""

from __future__ import annotations

import fuzzing
import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from ports.test_compat import _inputs, _layer_case

from seqpar.compat import yunchang as yc

EXAMPLES = 6
_STATE = ("mesh", "ULYSSES_PG", "RING_PG", "ulysses_degree", "ring_degree", "use_ulysses_low")
_GROUPS: dict[tuple, dict] = {}


@st.composite
def calls(draw, world: int) -> dict:
    ud = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    rd = world // ud
    heads = ud * draw(st.integers(1, 2))
    return {"ud": ud, "rd": rd, "low": draw(st.booleans()), "async": rd == 1 and draw(st.booleans()),
            "ring": draw(st.sampled_from(["basic", "zigzag", "strip"])), "causal": draw(st.booleans()),
            "heads": heads, "kv_heads": draw(st.sampled_from([d for d in range(1, heads + 1)     # what Ulysses splits
                                                              if heads % d == 0 and (ud % d == 0 or d % ud == 0)])),
            "seq": 2 * world * draw(st.integers(1, 3)), "batch": draw(st.integers(1, 2)),
            "dtype": draw(st.sampled_from(["float32", "float64"])), "seed": draw(st.integers(0, 2**16))}


def _groups(ud: int, rd: int, low: bool) -> None:
    """yunchang's groups for these degrees: made once per worker and reused (every rank draws the same calls,
    so every rank makes the same groups in the same order), not a new set per call."""
    key = (ud, rd, low)
    if key not in _GROUPS:
        yc.set_seq_parallel_pg(ud, rd, dist.get_rank(), dist.get_world_size(), use_ulysses_low=low)
        _GROUPS[key] = {a: getattr(yc.PROCESS_GROUP, a) for a in _STATE}
    for a, value in _GROUPS[key].items():
        setattr(yc.PROCESS_GROUP, a, value)


def run_call(call: dict) -> None:
    """Worker side: the drawn layer on this rank's tokens against the dense reference (asserts)."""
    _groups(call["ud"], call["rd"], call["low"])
    q, k, v, dout = _inputs(call["seq"], call["heads"], call["kv_heads"], getattr(torch, call["dtype"]),
                            call["batch"], call["seed"])
    layer = (yc.AsyncLongContextAttention if call["async"] else yc.LongContextAttention)(ring_impl_type=call["ring"])
    _layer_case(layer, call["ring"], q, k, v, dout, call["causal"], call["rd"], call["ud"])


@pytest.mark.parametrize("world", [2, 4])
def test_fuzz_yunchang(pools, world):
    fuzzing.sample(calls(world), EXAMPLES, lambda call: pools(world).run(run_call, call))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_fuzz_yunchang_long(pools, world):
    fuzzing.long_run(calls(world), 60, lambda call: pools(world).run(run_call, call), f"W={world}")
