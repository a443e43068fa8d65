"""Contiguous layout: rank r owns tokens ``[r L, (r+1) L)``.

Causal mask over W = 4 ranks (rows: queries, columns: keys; each cell an L x L block)::

            k: r0 r1 r2 r3
    q r0       \\  .  .  .
    q r1       #  \\  .  .
    q r2       #  #  \\  .
    q r3       #  #  #  \\      rank 3 computes 4 blocks, rank 0 one: causal efficiency W / (2W - 1)

Used by Ulysses (the all-to-all needs global order) and wherever causal balance does not matter
(non-causal, sliding windows, the all-gather baseline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Layout
from .blocks import Run, Segments

__all__ = ["Contiguous"]


@dataclass(frozen=True)
class Contiguous(Layout):
    """Rank r owns the r-th of W equal consecutive pieces."""

    name: ClassVar[str] = "contiguous"
    pieces: ClassVar[int] = 1

    def segments(self, rank: int, seq_len: int) -> Segments:
        n = self.local_len(seq_len)
        return Segments((Run(0, rank * n, n),))
