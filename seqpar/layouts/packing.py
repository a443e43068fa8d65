"""Packed rows: document lengths from two stated distributions, from a fixed seed. The bench's packed suite draws
its rows here, and the planner's validator regenerates a record's row from what the record names (layouts, not
bench: the planner may not import the bench).

  lognormal   lognormal lengths with mean about 2K tokens (mu = ln 2048 - 1/2, sigma 1); the row's end cuts the
              last document;
  long-tail   a pretraining mix: 80% of the documents as above, 20% Pareto(alpha 1.1) from 8K, up to the
              whole row.

``multiple`` rounds every document up to a multiple (ring-flash-attn's zigzag varlen needs each document to
divide by 2W); the last one takes what is left, rounded down, and the row ends with padding if needed.
"""

from __future__ import annotations

import math
import random

__all__ = ["DISTRIBUTIONS", "SEED", "packed_row"]

DISTRIBUTIONS = ("lognormal", "long-tail")
SEED = 7
"""The seed of the bench's packed rows (``packed_row(total, distribution, SEED, multiple=2 W)``), named in its
records as ``packing_seed``."""


def packed_row(seq_len: int, distribution: str, seed: int, multiple: int = 1) -> tuple[int, ...]:
    """Global ``cu_seqlens`` of one packed row of ``seq_len`` tokens (module docstring)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {list(DISTRIBUTIONS)}, got {distribution!r}")
    rng = random.Random(seed)
    mu, bounds = math.log(2048) - 0.5, [0]
    while seq_len - bounds[-1] >= multiple:
        if distribution == "long-tail" and rng.random() < 0.2:
            n = 8192 * rng.paretovariate(1.1)
        else:
            n = rng.lognormvariate(mu, 1.0)
        n = -(-max(1, round(n)) // multiple) * multiple
        room = (seq_len - bounds[-1]) // multiple * multiple
        bounds.append(bounds[-1] + min(n, room))
    return tuple(bounds)
