"""What every layout provides: the global positions a rank holds, and shard/unshard built on them.

A layout is a small frozen dataclass over ``world`` ranks. Its one job is ``segments(rank, seq_len)``: the
rank's rows as runs of global positions (``seqpar.layouts.blocks.Segments``). Everything else follows:
``positions`` (for RoPE), ``shard`` (global -> local, a copy), ``unshard`` (all locals -> global), and the
block plans the methods run. ``unshard([shard(x, r) for r in ranks]) == x`` for every layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from .blocks import Segments, slice_rows

__all__ = ["Layout", "Nested"]


@dataclass(frozen=True)
class Layout:
    """Base class: a token placement over ``world`` ranks."""

    world: int
    name: ClassVar[str] = "layout"
    #: pieces of the sequence per rank: the global length must be a multiple of ``world * pieces``
    pieces: ClassVar[int] = 1
    #: True for document layouts (``seqpar.layouts.documents``): the placement depends on the batch's
    #: global ``cu_seqlens``, so the layout is built per batch
    documents: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"world must be a positive int, got {self.world!r}")

    @property
    def divisor(self) -> int:
        """The global length must be a multiple of this."""
        return self.world * self.pieces

    def check_len(self, seq_len: int, what: str = "global sequence length") -> None:
        if seq_len % self.divisor:
            need = -(-seq_len // self.divisor) * self.divisor
            raise ValueError(f"{what} must be a multiple of {self.divisor} for {self.described()}, got {seq_len} "
                             f"(pad to {need}, or give the valid length so seqpar pads internally)")

    def described(self) -> str:
        """How the length-check error names this placement."""
        return f"the {self.name} layout over {self.world} ranks"

    def local_len(self, seq_len: int) -> int:
        self.check_len(seq_len)
        return seq_len // self.world

    def segments(self, rank: int, seq_len: int) -> Segments:
        raise NotImplementedError

    def positions(self, rank: int, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global position of each of ``rank``'s rows, int64 ``(L,)``."""
        return torch.tensor(self.segments(rank, seq_len).positions(), dtype=torch.long, device=device)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s rows of the global tensor ``x`` along ``dim`` (a copy)."""
        return x.index_select(dim, self.positions(rank, x.shape[dim], x.device))

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The global tensor from every rank's local tensor (``parts[r]`` from rank r)."""
        if len(parts) != self.world:
            raise ValueError(f"unshard needs {self.world} parts, got {len(parts)}")
        seq_len = parts[0].shape[dim] * self.world
        shape = list(parts[0].shape)
        shape[dim] = seq_len
        out = parts[0].new_empty(shape)
        for r, p in enumerate(parts):
            out.index_copy_(dim, self.positions(r, seq_len, p.device), p)
        return out


@dataclass(frozen=True)
class Nested(Layout):
    """An outer layout over ``world // inner`` groups, each group's tokens split contiguously ``inner`` ways.

    USP's placement: the ring layout gives ring rank rho its tokens; those are cut into U consecutive
    pieces and piece u goes to SP index ``rho * U + u``. After the Ulysses all-to-all inside the group,
    ring rank rho holds exactly its ring-layout shard, so the ring runs unchanged.
    """

    outer: Layout = None  # type: ignore[assignment]
    inner: int = 1
    name: ClassVar[str] = "nested"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.outer is None or self.outer.world * self.inner != self.world:
            raise ValueError(f"outer layout over {self.world} // {self.inner} ranks required, got {self.outer}")

    @property
    def divisor(self) -> int:
        return math.lcm(self.outer.divisor, self.world)

    def described(self) -> str:
        return f"the {self.outer.name} layout over {self.outer.world} ring ranks x {self.inner} Ulysses ranks"

    def segments(self, rank: int, seq_len: int) -> Segments:
        self.check_len(seq_len)
        rho, u = divmod(rank, self.inner)
        whole = self.outer.segments(rho, seq_len)
        piece = whole.length // self.inner
        return slice_rows(whole, u * piece, (u + 1) * piece)
