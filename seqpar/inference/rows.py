"""Which global positions every rank's cached rows hold: host-side index math, the same on every rank.

A rank's cache rows are appended in position order, so its positions only grow. They are kept as ``Piece``s:
arithmetic runs of rows (a prefill chunk in a layout gives one or two pieces per rank, stride 1 or W; decode
tokens owned round-robin give one piece of stride W per decode phase). ``RankRows`` holds one rank's pieces;
the cache holds one per rank, on every rank, so any rank can plan against any other rank's slice.

Note [Pieces and segments]
    The block planner takes ``Segments``: runs sharing ONE stride. A rank's rows mix strides (a zigzag prefill,
    stride 1, then decode tokens, stride W), so ``segment_groups`` cuts them into maximal groups of pieces
    that share a stride (a one-row piece takes any stride) and the planner runs once per group; the tasks of
    all groups are merged in fp32 like any other partials. Groups only grow with prefill chunks and decode
    phases, never with tokens.

Positions here are cache positions: the column of a token in the batch's global sequence (padding
included), not RoPE positions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layouts.blocks import Run, Segments

__all__ = ["Piece", "RankRows", "segments_of"]


@dataclass(frozen=True)
class Piece:
    """``length`` rows from logical row ``row``; row ``row + i`` holds position ``pos + stride * i``."""

    row: int
    pos: int
    length: int
    stride: int = 1

    @property
    def end_row(self) -> int:
        return self.row + self.length

    @property
    def last_pos(self) -> int:
        return self.pos + self.stride * (self.length - 1)

    def first_row_at(self, position: int) -> int:
        """The first row of this piece whose position is ``>= position`` (``end_row`` if none)."""
        if position <= self.pos:
            return self.row
        return min(self.end_row, self.row - (-(position - self.pos) // self.stride))


def segments_of(positions: Sequence[int]) -> list[Piece]:
    """Increasing positions (a rank's rows in local order) as pieces with logical rows ``0..len - 1``."""
    pieces: list[Piece] = []
    for i, p in enumerate(positions):
        if pieces:
            last = pieces[-1]
            if p <= last.last_pos:
                raise ValueError(f"cached positions must increase along a rank's rows, got {p} after "
                                 f"{last.last_pos}")
            if last.length == 1 or p - last.last_pos == last.stride:
                pieces[-1] = Piece(last.row, last.pos, last.length + 1, p - last.pos if last.length == 1
                                   else last.stride)
                continue
        pieces.append(Piece(i, p, 1))
    return pieces


class RankRows:
    """One rank's cached rows: pieces in row (= position) order, and the number of rows ever appended."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.total = 0

    def __repr__(self) -> str:
        return f"RankRows(total={self.total}, pieces={self.pieces})"

    def append(self, positions: Sequence[int]) -> None:
        """Append rows holding ``positions`` (increasing, after every cached position)."""
        self.append_runs([(p.pos, p.length, p.stride) for p in segments_of(positions)])

    def append_runs(self, runs: Sequence[tuple[int, int, int]]) -> None:
        """Append arithmetic runs ``(first position, length, stride)`` of rows, in position order (a layout's
        segments: O(runs), never a loop over tokens)."""
        for pos, length, stride in runs:
            if length <= 0:
                continue
            if self.pieces and pos <= self.pieces[-1].last_pos:
                raise ValueError(f"appended positions must follow the cached ones, got {pos} after "
                                 f"{self.pieces[-1].last_pos}")
            if self.pieces:
                last = self.pieces[-1]
                step = pos - last.last_pos
                if (last.length == 1 or step == last.stride) and (length == 1 or stride == step):
                    self.pieces[-1] = Piece(last.row, last.pos, last.length + length, step)
                    self.total += length
                    continue
            self.pieces.append(Piece(self.total, pos, length, stride if length > 1 else 1))
            self.total += length

    def first_row_at(self, position: int) -> int:
        """The first row whose position is ``>= position`` (``total`` when there is none)."""
        starts = [p.pos for p in self.pieces]
        i = bisect.bisect_right(starts, position) - 1
        if i < 0:
            return self.pieces[0].row if self.pieces else self.total
        piece = self.pieces[i]
        row = piece.first_row_at(position)
        return row if row < piece.end_row or i + 1 == len(self.pieces) else self.pieces[i + 1].row

    def segment_groups(self, first_row: int) -> list[tuple[int, Segments]]:
        """Rows ``first_row..total`` as ``(row offset from first_row, Segments)`` groups of one stride each
        (Note [Pieces and segments]); runs inside a group are numbered from the group's first row."""
        groups: list[tuple[int, list[Piece], int | None]] = []
        for p in self.pieces:
            if p.end_row <= first_row:
                continue
            if p.row < first_row:
                cut = first_row - p.row
                p = Piece(first_row, p.pos + p.stride * cut, p.length - cut, p.stride)
            stride = None if p.length == 1 else p.stride
            if groups and (stride is None or groups[-1][2] is None or groups[-1][2] == stride):
                row0, members, gs = groups[-1]
                groups[-1] = (row0, [*members, p], gs if stride is None else stride)
            else:
                groups.append((p.row, [p], stride))
        out = []
        for row0, members, stride in groups:
            runs = tuple(Run(p.row - row0, p.pos, p.length) for p in members)
            out.append((row0 - first_row, Segments(runs, stride or 1)))
        return out

    def positions(self, first_row: int = 0) -> list[int]:
        """Every position from ``first_row`` on, in row order (tests and small checks)."""
        return [p.pos + p.stride * i for p in self.pieces for i in range(p.length) if p.row + i >= first_row]

    def positions_tensor(self, first_row: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
        """``positions(first_row)`` as an int64 tensor, built per piece (no loop over tokens)."""
        parts = [p.pos + p.stride * torch.arange(max(first_row - p.row, 0), p.length, device=device)
                 for p in self.pieces if p.end_row > first_row]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)
