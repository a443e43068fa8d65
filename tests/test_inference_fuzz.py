"""The sharded KV cache, fuzzed: random serving sessions against the dense fp64 oracle (hypothesis).

A drawn session fixes the batch (left-padded rows), two layers' windows, sinks, the value head dim, the
extension rule (``passes``) and a run of chunks: a first prefill filled by a drawn method and layout, then
decode steps, more prefill chunks (each filled by a drawn method) and static (graph-capturable) decode steps
in any order. Every output row of every layer must equal dense causal attention over the whole sequence in fp64
(``test_inference._check_cache``, within 1e-10: the inputs are fp64), and replicated rows must agree bitwise
across ranks. CI runs a derandomized sample (``EXAMPLES`` per world size); the long run draws fresh ones::

    SEQPAR_FUZZ_EXAMPLES=200 python -m pytest tests/test_inference_fuzz.py -m slow -q -p no:cacheprovider
"""

from __future__ import annotations

import fuzzing
import pytest
from hypothesis import strategies as st

pytest.importorskip("transformers")

from _workers_inference import cache_run
from test_inference import _check_cache

EXAMPLES = 6


def _fills(world: int, mesh: int | None) -> list[dict]:
    """The (method, layout, options) that fill a cache at ``world`` ranks: USP alone on a 2D mesh; Ulysses where
    the ranks divide the 4 query heads."""
    if mesh:
        return [{"method": "usp", "layout": "zigzag"}]
    fills = [{"method": "ring", "layout": lay} for lay in ("zigzag", "contiguous", "stripe")]
    fills += [{"method": "allgather", "layout": "zigzag"}, {"method": "tokenring", "layout": "zigzag"},
              {"method": "tasp", "layout": "zigzag"}]
    fills += [{"method": "double_ring", "layout": "zigzag", "node_size": n} for n in range(1, world + 1)
              if world % n == 0]
    if 4 % world == 0:
        fills.append({"method": "ulysses", "layout": "contiguous"})
    return fills


@st.composite
def sessions(draw, world: int) -> dict:
    mesh = 2 if world % 2 == 0 and draw(st.integers(0, 4)) == 0 else None
    fills = _fills(world, mesh)
    batch = draw(st.integers(1, 2))
    first = draw(st.integers(1, 20))
    chunks: list[tuple] = [("prefill", first, draw(st.sampled_from(fills)))]
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["decode", "prefill", "static"]))
        n = draw(st.integers(1, 3)) if kind != "prefill" else draw(st.integers(1, 12))
        chunks.append((kind, n, draw(st.sampled_from(fills))) if kind == "prefill" else (kind, n))
    total = sum(c[1] for c in chunks)
    spec = {"label": "fuzz", "chunks": chunks, "batch": batch, "seed": draw(st.integers(0, 2**16)),
            "passes": draw(st.sampled_from(["auto", "kv", "q"])), "sinks": draw(st.booleans()),
            "windows": {layer: w for layer in (0, 1) if (w := draw(st.sampled_from([-1, -1, 0, 1, 3, 8]))) >= 0}}
    if batch == 2:
        spec["starts"] = (draw(st.integers(0, first - 1)), draw(st.integers(0, first - 1)))
    if draw(st.booleans()):
        spec["value_head_dim"] = draw(st.sampled_from([4, 12]))
    if any(c[0] == "static" for c in chunks):
        spec["max_len"] = 2 * total + 8
    if mesh:
        spec["ulysses"] = mesh
    return spec


def _check(pools, world: int, spec: dict) -> None:
    problems = _check_cache(spec, [r[0] for r in pools(world).run(cache_run, [spec])])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fuzz_cache(pools, world):
    fuzzing.sample(sessions(world), EXAMPLES, lambda spec: _check(pools, world, spec))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8])
def test_fuzz_cache_long(pools, world):
    fuzzing.long_run(sessions(world), 100, lambda spec: _check(pools, world, spec), f"W={world}")
