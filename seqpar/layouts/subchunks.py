"""Sub-chunks: a layout whose per-rank pieces are each cut into ``parts`` sub-chunks (TASP, §8.2).

A rank of the base layout holds ``base.pieces`` pieces (zigzag: ``[chunk r | chunk 2W-1-r]``, contiguous and
stripe: one). ``Subchunked(W, base=Zigzag(W), parts=m)`` cuts every piece into m parts; sub-chunk c is part c
of every piece. Zigzag, W = 2, m = 3 (local rows of one rank, ``f``/``b`` = front/back chunk)::

    local rows:   f0 f1 f2 | b0 b1 b2          sub-chunk 1 = rows of f1 and b1 (two pieces)

Token placement is the base layout's (``segments``, ``shard``, ``unshard``, ``positions`` are unchanged), and so
is the divisor: the parts of a piece differ by at most one row (Note [Uneven sub-chunks]; a piece shorter than
``parts`` rows has empty parts). ``blocks.slice_rows`` turns rows of a rank into their own ``Segments`` for the
planner.

Note [Uneven sub-chunks]
    The parts of a piece used to be equal, so the global length had to be a multiple of ``base.divisor * parts``
    - 2W(W-1) for zigzag - and 16K tokens over 8 ranks ran padded to 16464: every rank's chunk 1029 rows, every
    kernel call 1029 x 2058 where the ring's are 1024 x 2048. On an H100 cuDNN ran that forward in 97 us against
    60 us (query rows past a multiple of 128 spill into a third wave of tiles over 32 heads) and its backward in
    277 against 220 us: TASP's forward at 2K tokens per rank spent 0.77 ms in cuDNN where the ring spent 0.47 ms on
    the same pairs, and rank 0's forward+backward fell from 3.13 to 2.84 ms of GPU time without the padding (GQA
    32/8, emulated; ``benchmarks/results/2026-11-26-h100-tasp-aligned``). Now part c of a piece of n rows is rows
    ``[n c // m, n (c + 1) // m)``: sub-chunk sizes differ by at most one row, so the links of a round carry
    the same bytes within one row per piece, and a length the base layout splits needs no padding. Every rank
    sees the same sizes (the local length is the same), so both ends of a link agree on every message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Layout
from .blocks import Segments

__all__ = ["Subchunked"]


@dataclass(frozen=True)
class Subchunked(Layout):
    """``base`` with each per-rank piece cut into ``parts`` sub-chunks within a row of each other (same token
    placement, Note [Uneven sub-chunks])."""

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
        return self.base.divisor

    @property
    def pieces_per_rank(self) -> int:
        return self.base.pieces

    def described(self) -> str:
        return f"the {self.base.name} layout over {self.world} ranks with every piece cut into {self.parts} sub-chunks"

    def segments(self, rank: int, seq_len: int) -> Segments:
        self.check_len(seq_len)
        return self.base.segments(rank, seq_len)

    def piece_rows(self, local_len: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """``rows[c][p] = (start, stop)``: local rows of piece p of sub-chunk c (the same on every rank; Note
        [Uneven sub-chunks])."""
        n, m = local_len // self.base.pieces, self.parts
        if n * self.base.pieces != local_len:
            raise ValueError(f"local length must be a multiple of {self.base.pieces}, got {local_len}")
        cut = [n * c // m for c in range(m + 1)]
        return tuple(tuple((p * n + cut[c], p * n + cut[c + 1]) for p in range(self.base.pieces)) for c in range(m))
