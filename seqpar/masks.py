"""The two mask forms a local kernel is asked to apply, in the coordinates of ONE kernel call.

Every distributed schedule reduces its work to kernel calls on blocks (query rows x key rows). The block
planner (``seqpar.layouts.blocks``) turns global visibility rules (causal, sliding window, documents,
padding) into one of these two forms, so kernels never see global positions.

``Band(lo, hi)``: query row i sees key row j iff ``lo <= j - i <= hi`` (None = unbounded)::

    Band()            full              Band(None, 0)  causal, top-left     Band(None, 2) on 3x5
    x x x x                             x . . .                             x x x . .   (bottom-right
    x x x x                             x x . .                             x x x x .    causal: the last
    x x x x                             x x x .                             x x x x x    query sees all)

The planner trims every band to the bounding box of what it shows, so a band always satisfies
``hi >= n - m`` and ``lo <= n - m`` (m query rows, n key rows): it is expressible as a flash-attn
bottom-right window. ``bottom_right_window`` gives that window.

``Varlen(cu_q, cu_k, window)``: the call's rows are packed segments; segment s pairs query rows
``cu_q[s]:cu_q[s+1]`` with key rows ``cu_k[s]:cu_k[s+1]``, aligned bottom-right (flash-attn's varlen
convention), with the window ``(left, right)`` (-1 = unbounded; causal is right = 0) in every segment.
Segments with no query rows or no key rows fill the gaps between documents.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Band", "Mask", "Varlen", "bottom_right_window"]


@dataclass(frozen=True)
class Band:
    """Key j visible to query i iff ``lo <= j - i <= hi``; None means unbounded on that side."""

    lo: int | None = None
    hi: int | None = None

    @property
    def is_full(self) -> bool:
        return self.lo is None and self.hi is None


@dataclass(frozen=True)
class Varlen:
    """Packed segments, each aligned bottom-right with ``window = (left, right)``; host ints only."""

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    window: tuple[int, int] = (-1, -1)

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q[:-1], self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k[:-1], self.cu_k[1:]))


Mask = Band | Varlen


def bottom_right_window(band: Band, m: int, n: int) -> tuple[int, int]:
    """The flash-attn window ``(left, right)`` (-1 = unbounded) that equals ``band`` on an m x n block.

    Bottom-right alignment puts query i on key diagonal ``i + (n - m)``; the window then admits
    ``j - i`` in ``[(n - m) - left, (n - m) + right]``.
    """
    shift = n - m
    left = -1 if band.lo is None else shift - band.lo
    right = -1 if band.hi is None else band.hi - shift
    if left < -1 or right < -1 or (band.lo is not None and left < 0) or (band.hi is not None and right < 0):
        raise ValueError(f"band {band} on a {m}x{n} block is not trimmed; plan it with seqpar.layouts.blocks")
    return left, right
