"""Zigzag layout ("load-balanced", "head-tail", "DualChunkSwap"): rank r owns chunks r and 2W-1-r of 2W.

The sequence is cut into 2W chunks of L/2; rank r holds ``[chunk r | chunk 2W-1-r]`` in that local order,
which is also global order, so a rank's own block is one causal call. Causal mask, W = 4, by chunk::

    owner:     r0 r1 r2 r3 r3 r2 r1 r0
          k:   c0 c1 c2 c3 c4 c5 c6 c7
    q c0 r0    \\  .  .  .  .  .  .  .
    q c1 r1    #  \\  .  .  .  .  .  .
    q c2 r2    #  #  \\  .  .  .  .  .
    q c3 r3    #  #  #  \\  .  .  .  .
    q c4 r3    #  #  #  #  \\  .  .  .
    q c5 r2    #  #  #  #  #  \\  .  .
    q c6 r1    #  #  #  #  #  #  \\  .
    q c7 r0    #  #  #  #  #  #  #  \\

Note [Zigzag load balance]
    Query owner i against key owner j: j == i is one causal call on the whole local block; j < i: all of
    i's queries see j's front chunk only (one full L x L/2 call); j > i: only i's back chunk sees anything,
    and it sees both of j's chunks (one full L/2 x L call). Every off-diagonal step is exactly L^2/2 of
    dense work on every rank, so the ring is balanced. The block planner derives these calls from the
    positions below; tests/test_blocks.py pins them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Layout
from .blocks import Run, Segments

__all__ = ["Zigzag"]


@dataclass(frozen=True)
class Zigzag(Layout):
    """Rank r owns chunks r and 2W-1-r of 2W equal chunks, front chunk first."""

    name: ClassVar[str] = "zigzag"
    pieces: ClassVar[int] = 2

    def segments(self, rank: int, seq_len: int) -> Segments:
        n = self.local_len(seq_len)
        h = n // 2
        return Segments((Run(0, rank * h, h), Run(h, (2 * self.world - 1 - rank) * h, h)))
