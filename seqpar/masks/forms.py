"""The mask forms a local kernel is asked to apply, in the coordinates of ONE kernel call.

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

``Modded(base, fn, q, k, stride)``: a user's ``mask_mod`` ``fn`` on top of a band or varlen ``base``. The call's
rows keep their global positions (runs ``(glob, length)`` advancing by ``stride``), so a kernel evaluates
``base(i, j) & fn(b, h, pos_q[i], pos_k[j])``. Only flex (GPU) and the reference kernel (CPU) serve it; the block
planner hands out this form only for blocks the mask leaves partly visible (Note [Generic mask_mod]).

``Joined(parts)``: several planned blocks of one step served by ONE kernel call over their bounding box (the
runner joins them, Note [Bands on flex] in ``seqpar.kernels.executor``). Each part ``(q0, q1, k0, k1, band)``
shows query rows ``q0:q1`` the key rows ``k0:k1`` under ``band`` in the part's own coordinates (as a ``Task``
does); a key is visible when a part shows it. Parts never overlap (they are the planner's blocks). Each query
row then sees a few intervals of keys (``row_intervals``), which is how flex evaluates it; only flex (GPU) and
the reference kernel serve it::

    sink_window(2, sinks=2) on 8 x 8: three blocks, one call
    x . . . . . . .      rows 0:2 x keys 0:2  Band(None, 0)
    x x . . . . . .      rows 2:8 x keys 0:2  Band()          (the sink columns)
    x x x . . . . .      rows 2:8 x keys 2:8  Band(-2, 0)     (the window)
    x x x x . . . .
    x x x x x . . .
    x x . x x x . .      row 5 sees two intervals of keys: [0, 1] and [3, 5]
    x x . . x x x .
    x x . . . x x x

``Stacked(count, band)``: ``count`` equal blocks one after another on the diagonal of the call, each
``rows / count`` query rows against ``cols / count`` key rows under ``band`` (full or causal): Llama 4's chunks,
equal documents. The runner serves it as ONE call of any kernel that serves ``band``, the blocks as its batch
(Note [Equal blocks as a batch] in ``seqpar.kernels.executor``)::

    Stacked(2, Band(None, 0)) on 4 x 4
    x . . .
    x x . .
    . . x .
    . . x x
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Band", "Joined", "Mask", "Modded", "Stacked", "Varlen", "bottom_right_window", "dense", "fa2_exact",
           "run_positions"]


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


@dataclass(frozen=True)
class Modded:
    """``base`` and a flex-style ``fn(b, h, q_pos, k_pos) -> bool`` on the rows' global positions."""

    base: Band | Varlen
    fn: Callable[..., Any]
    q: tuple[tuple[int, int], ...]
    k: tuple[tuple[int, int], ...]
    stride: int = 1
    stamp: tuple = ()
    """The function's captured tensors by version (``seqpar.masks.mod.stamp``): block masks are cached on it."""

    @property
    def is_full(self) -> bool:
        """Never: a mask_mod block hides some of its band (the planner keeps blocks it leaves whole as bands)."""
        return False

    def positions(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions of the call's query rows and key rows, int64 on ``device``."""
        return run_positions(self.q, self.stride, device), run_positions(self.k, self.stride, device)


@dataclass(frozen=True)
class Joined:
    """Blocks ``(q0, q1, k0, k1, band)`` (band in the block's own coordinates) served as one call; no overlaps."""

    parts: tuple[tuple[int, int, int, int, Band], ...]

    @property
    def is_full(self) -> bool:
        """Never: a call of several blocks hides the cells between them."""
        return False

    def row_intervals(self, m: int) -> torch.Tensor:
        """``(2K, m)`` int32 on CPU: rows ``2c`` and ``2c + 1`` hold the first and last key of query row i's c-th
        visible interval (an empty slot is ``(1, 0)``); K is the most parts any row meets."""
        cover = torch.zeros(m, dtype=torch.long)
        for q0, q1, *_ in self.parts:
            cover[q0:q1] += 1
        slots = int(cover.max()) if m else 0
        out = torch.empty(2 * max(slots, 1), m, dtype=torch.int64)
        out[0::2], out[1::2] = 1, 0
        used = torch.zeros(m, dtype=torch.long)
        for q0, q1, k0, k1, band in self.parts:
            i = torch.arange(q1 - q0)
            first = i + band.lo if band.lo is not None else torch.zeros_like(i)
            last = i + band.hi if band.hi is not None else torch.full_like(i, k1 - k0 - 1)
            first, last = first.clamp(min=0) + k0, last.clamp(max=k1 - k0 - 1) + k0
            slot = used[q0:q1]
            rows = torch.arange(q0, q1)
            out[2 * slot, rows], out[2 * slot + 1, rows] = first, last
            used[q0:q1] += 1
        return out.to(torch.int32)


@dataclass(frozen=True)
class Stacked:
    """``count`` equal blocks on the call's diagonal, each under ``band`` (full or causal), served as one batch."""

    count: int
    band: Band

    @property
    def is_full(self) -> bool:
        """Never: the blocks hide the cells between them."""
        return False


Mask = Band | Varlen | Modded | Joined | Stacked


def run_positions(runs: tuple[tuple[int, int], ...], stride: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The positions ``glob + stride * i`` of every ``(glob, length)`` run, in order."""
    if not runs:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(g, g + stride * n, stride, device=device) for g, n in runs])


def dense(mask: Mask, m: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The boolean ``(m, n)`` visibility of ``mask`` on an m x n call (tests, the reference kernel, planning)."""
    if isinstance(mask, Band):
        d = torch.arange(n, device=device)[None, :] - torch.arange(m, device=device)[:, None]
        vis = torch.ones(m, n, dtype=torch.bool, device=device)
        if mask.lo is not None:
            vis &= d >= mask.lo
        if mask.hi is not None:
            vis &= d <= mask.hi
        return vis
    if isinstance(mask, Varlen):
        vis = torch.zeros(m, n, dtype=torch.bool, device=device)
        left, right = mask.window
        for s in range(len(mask.cu_q) - 1):
            qa, qb, ka, kb = mask.cu_q[s], mask.cu_q[s + 1], mask.cu_k[s], mask.cu_k[s + 1]
            if qa < qb and ka < kb:
                shift = (kb - ka) - (qb - qa)
                band = Band(None if left < 0 else shift - left, None if right < 0 else shift + right)
                vis[qa:qb, ka:kb] = dense(band, qb - qa, kb - ka, device)
        return vis
    if isinstance(mask, Joined):
        vis = torch.zeros(m, n, dtype=torch.bool, device=device)
        for q0, q1, k0, k1, band in mask.parts:
            vis[q0:q1, k0:k1] |= dense(band, q1 - q0, k1 - k0, device)
        return vis
    if isinstance(mask, Stacked):
        vis = torch.zeros(m, n, dtype=torch.bool, device=device)
        r, c = m // mask.count, n // mask.count
        for i in range(mask.count):
            vis[i * r:(i + 1) * r, i * c:(i + 1) * c] = dense(mask.band, r, c, device)
        return vis
    qp, kp = mask.positions(device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return dense(mask.base, m, n, device) & mask.fn(zero, zero, qp[:, None], kp[None, :])


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


def fa2_exact(band: Band, m: int, n: int) -> bool:
    """Whether FA2's window, clamped as FA2 clamps it, equals ``band`` (trimmed) on an m x n block (Note [FA2's
    capped windows] in ``seqpar.kernels.sdpa``). A left side clamped to ``n`` still starts before the first key, as
    the band does."""
    s = n - m
    right = None if band.hi is None else band.hi - s
    if band.lo is None or band.lo <= s - n:       # the left side dropped
        if right is None or right >= n:           # and the right: FA2 runs every key
            return band.hi is None or band.hi >= n - 1
        return True
    return (right is not None and right <= n) or m <= n + 1    # a right side clamped to n reaches key i + 2n - m
