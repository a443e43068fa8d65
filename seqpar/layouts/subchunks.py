"""Sub-chunks: a layout whose per-rank pieces are each cut into ``parts`` equal sub-chunks (TASP, §8.2).

A rank of the base layout holds ``base.pieces`` pieces (zigzag: ``[chunk r | chunk 2W-1-r]``, contiguous and
stripe: one). ``Subchunked(W, base=Zigzag(W), parts=m)`` cuts every piece into m parts; sub-chunk c is part c
of every piece. Zigzag, W = 2, m = 3 (local rows of one rank, ``f``/``b`` = front/back chunk)::

    local rows:   f0 f1 f2 | b0 b1 b2          sub-chunk 1 = rows of f1 and b1 (two pieces)

Token placement is the base layout's (``segments``, ``shard``, ``unshard``, ``positions`` are unchanged);
only the divisor grows so that every part has the same length: the global length must be a multiple of
``base.divisor * parts``. ``blocks.slice_rows`` turns rows of a rank into their own ``Segments`` for the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Layout
from .blocks import Segments

__all__ = ["Subchunked"]


@dataclass(frozen=True)
class Subchunked(Layout):
    """``base`` with each per-rank piece cut into ``parts`` equal sub-chunks (same token placement)."""

    base: Layout = None  # type: ignore[assignment]
    parts: int = 1
    name: ClassVar[str] = "subchunked"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.base is None or self.base.world != self.world:
            raise ValueError(f"base layout over {self.world} ranks required, got {self.base}")
        if not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"parts must be a positive int, got {self.parts!r}")

    @property
    def divisor(self) -> int:
        return self.base.divisor * self.parts

    @property
    def pieces_per_rank(self) -> int:
        return self.base.pieces

    def described(self) -> str:
        return f"the {self.base.name} layout over {self.world} ranks with every piece cut into {self.parts} sub-chunks"

    def segments(self, rank: int, seq_len: int) -> Segments:
        self.check_len(seq_len)
        return self.base.segments(rank, seq_len)

    def piece_rows(self, local_len: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """``rows[c][p] = (start, stop)``: local rows of piece p of sub-chunk c (the same on every rank)."""
        per_piece = local_len // self.base.pieces
        size = per_piece // self.parts
        if size * self.parts * self.base.pieces != local_len:
            raise ValueError(f"local length must be a multiple of {self.base.pieces * self.parts}, got {local_len}")
        return tuple(tuple((p * per_piece + c * size, p * per_piece + (c + 1) * size)
                           for p in range(self.base.pieces)) for c in range(self.parts))
