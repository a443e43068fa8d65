"""Stripe layout: token t lives on rank ``t mod W``; local row a of rank r is global token ``a W + r``.

Causal mask of rank r's queries against rank j's keys, in local rows (a: query, b: key)::

    j <= r: key b visible iff b <= a        j > r: key b visible iff b < a
            x . . .                                 . . . .
            x x . .                                 x . . .
            x x x .                                 x x . .
            x x x x                                 x x x .

Every step is a (nearly) square causal call, so the load is balanced, but every step needs a masked
kernel and the whole model must run in the permuted order. With windows every rank needs every other
rank's keys on every step (avoid stripe there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Layout
from .blocks import Run, Segments

__all__ = ["Stripe"]


@dataclass(frozen=True)
class Stripe(Layout):
    """Rank r owns tokens r, r + W, r + 2W, ..."""

    name: ClassVar[str] = "stripe"
    pieces: ClassVar[int] = 1

    def segments(self, rank: int, seq_len: int) -> Segments:
        n = self.local_len(seq_len)
        return Segments((Run(0, rank, n),), stride=self.world)
