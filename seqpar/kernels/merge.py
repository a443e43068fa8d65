"""MERGE: combine partial attention results over disjoint key sets, in fp32, in place (ALGORITHMS.md §1.3).

Two partials of the same query rows, each normalised over its own keys, ``(o_a, l_a)`` and ``(o_b, l_b)``::

    l = logaddexp(l_a, l_b)                 # = max + log1p(exp(-|l_a - l_b|)): never overflows
    o = exp(l_a - l) * o_a + exp(l_b - l) * o_b

Only exponentials of non-positive numbers are taken. A row that neither part saw (both -inf) stays
(0, -inf): the weights ``exp(-inf - -inf)`` are NaN and are replaced by 0, so fully masked queries give
zeros, never NaN. The accumulator starts as (0, -inf); the merge order is fixed by each schedule, so
results are bitwise reproducible for a given kernel.
"""

from __future__ import annotations

import torch

from ..numerics import acc_dtype
from . import combine
from .combine import Covered, union

__all__ = ["DEFER_BYTES", "Accumulator", "RowSum", "merge_", "merge_weights"]


def merge_weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(w_a, w_b, lse)`` with ``lse = logaddexp(lse_a, lse_b)`` and ``w = exp(lse_x - lse)`` (0, not NaN)."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).nan_to_num_(0.0)
    w_b = torch.exp(lse_b - lse).nan_to_num_(0.0)
    return w_a, w_b, lse


def merge_(acc_out_BSHD: torch.Tensor, acc_lse_BHS: torch.Tensor, out_BSHD: torch.Tensor,
           lse_BHS: torch.Tensor) -> None:
    """Merge the partial ``(out, lse)`` into the fp32 accumulator views ``(acc_out, acc_lse)``, in place.

    Args:
        acc_out_BSHD: fp32 (or fp64) accumulator rows ``(B, S, H, D)``, a view into the full accumulator.
        acc_lse_BHS: the matching lse rows ``(B, H, S)``.
        out_BSHD: the partial output of the same rows, any float dtype.
        lse_BHS: its lse, fp32.
    """
    w_a, w_b, lse = merge_weights(acc_lse_BHS, lse_BHS.to(acc_lse_BHS.dtype))
    acc_out_BSHD.mul_(w_a.transpose(1, 2).unsqueeze(-1))
    acc_out_BSHD.addcmul_(out_BSHD, w_b.transpose(1, 2).unsqueeze(-1).to(acc_out_BSHD.dtype))
    acc_lse_BHS.copy_(lse)


DEFER_BYTES = 2 << 30
"""Partials an ``Accumulator(defer=True)`` holds before folding them into its fp32 accumulator (Note [One merge
per call] in ``seqpar.kernels.combine``): a ring of 8 at 16K tokens per rank (nine partials of 128 MiB for 32
heads of 128 in bf16) merges once, with no fp32 accumulator and no cast; at 128K tokens per rank a partial alone
is 1 GiB and a fold comes every third one, where the merge is cheap next to the attention."""


class Accumulator:
    """The running ``(out (B, S, H, Dv), lse (B, H, S))`` of one rank's query rows: fp32 (fp64 for fp64 inputs).

    ``add(rows, out, lse)`` merges a partial for ``rows``. The first partial that covers every row is kept as
    it is (no pass over a zero accumulator); it is widened to fp32 only when a second partial arrives, so a
    single-block call returns the kernel's output untouched. ``result(dtype)`` ends the pass.

    ``defer=True`` (partials that are fresh kernel outputs, never views of a buffer that is written again):
    partials are held and merged in one pass (Note [One merge per call] in ``seqpar.kernels.combine``), up to
    ``DEFER_BYTES`` of them at a time; ``result`` then writes the output dtype directly.
    """

    def __init__(self, like_BSHD: torch.Tensor, value_dim: int | None = None, *, defer: bool = False):
        B, S, H, D = like_BSHD.shape
        self.shape = (B, S, H, D if value_dim is None else value_dim)
        self.device = like_BSHD.device
        self.acc_dtype = acc_dtype(like_BSHD.dtype)
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.defer = defer
        self._covered: Covered = None             # the rows of a folded accumulator that may hold a result
        self._held: list[tuple[slice, torch.Tensor, torch.Tensor, Covered]] = []
        self._held_bytes = 0

    def _init(self) -> None:
        B, S, H, _ = self.shape
        self.out = torch.zeros(self.shape, dtype=self.acc_dtype, device=self.device)
        self.lse = torch.full((B, H, S), float("-inf"), dtype=self.acc_dtype, device=self.device)

    def owned(self) -> Accumulator:
        """Allocate the accumulator now, so no later partial is adopted without a copy (a partial that is a view
        of a receive buffer must never be kept: the next receive would overwrite the result)."""
        if self.defer:
            raise ValueError("an Accumulator that defers its merges holds its partials: it cannot be owned")
        if self.out is None:
            self._init()
        return self

    def add(self, rows: slice, out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, covered: Covered = None) -> None:
        """``covered``: the ranges of the partial's rows (relative to ``rows.start``) that may hold a result, the
        others being (0, -inf) (a varlen call's gap rows, ``Task.covered``): a deferred merge reads only those."""
        if self.defer:
            self._held.append((rows, out_BSHD, lse_BHS, covered))
            self._held_bytes += out_BSHD.numel() * out_BSHD.element_size()
            if self._held_bytes > DEFER_BYTES and len(self._held) > 1:
                self._fold(self.acc_dtype)
            return
        full = rows.start == 0 and rows.stop == self.shape[1]
        if self.out is None and full:
            self.out, self.lse = out_BSHD, lse_BHS      # a kernel's fresh output: ours to keep
            return
        if self.out is None:
            self._init()
        assert self.out is not None and self.lse is not None
        if self.out.dtype != self.acc_dtype or self.lse.dtype != self.acc_dtype:
            self.out, self.lse = self.out.to(self.acc_dtype), self.lse.to(self.acc_dtype)
        merge_(self.out[:, rows], self.lse[:, :, rows], out_BSHD, lse_BHS)

    def _fold(self, dtype: torch.dtype) -> None:
        """Merge the held partials (and the accumulator, if any) in one pass into ``(out, lse)`` of ``dtype``."""
        whole = slice(0, self.shape[1])
        parts = self._held if self.out is None else [(whole, self.out, self.lse, self._covered), *self._held]
        self._held, self._held_bytes = [], 0
        if len(parts) == 1 and parts[0][0] == whole:
            self.out, self.lse, self._covered = parts[0][1], parts[0][2], parts[0][3]   # one whole partial
            return
        self.out, self.lse = combine.merge_parts(parts, self.shape, dtype)
        self._covered = union(parts, self.shape[1])

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out in dtype, lse in fp32 or fp64)``; rows no partial reached are (0, -inf)."""
        if self._held:
            self._fold(dtype)
        if self.out is None:
            self._init()
        assert self.out is not None and self.lse is not None
        return self.out.to(dtype), self.lse.to(self.acc_dtype)


class RowSum:
    """The sum of gradient partials of one rank's rows (a dQ over ring steps): ``add(rows, x_BSHD)`` holds fresh
    kernel outputs and ``result(dtype)`` sums them in one pass (Note [One merge per call] in
    ``seqpar.kernels.combine``), in fp32 (fp64 for fp64), folding into an fp32 running sum past ``DEFER_BYTES``."""

    def __init__(self, shape: tuple[int, ...], acc: torch.dtype, device: torch.device):
        self.shape, self.acc, self.device = tuple(shape), acc, device
        self._held: list[tuple[slice, torch.Tensor, Covered]] = []
        self._held_bytes = 0
        self._added = 0                   # tensors added since the last fold (the caller's, not ours)

    def add(self, rows: slice, x_BSHD: torch.Tensor, covered: Covered = None) -> None:
        """``covered``: as ``Accumulator.add``'s, the rows outside it being 0."""
        self._held.append((rows, x_BSHD, covered))
        self._held_bytes += x_BSHD.numel() * x_BSHD.element_size()
        self._added += 1
        if self._held_bytes > DEFER_BYTES and len(self._held) > 1:
            self.fold()

    def fold(self) -> None:
        """Sum what is held into one fp32 partial of its own now, so the tensors added so far may be reused."""
        if self._added:
            whole = slice(0, self.shape[1])
            self._held = [(whole, self._sum(self.acc), union(self._held, self.shape[1]))]
        self._held_bytes, self._added = 0, 0

    def _sum(self, dtype: torch.dtype) -> torch.Tensor:
        if not self._held:
            return torch.zeros(self.shape, dtype=dtype, device=self.device)
        return combine.sum_parts(self._held, self.shape, dtype)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self._sum(dtype)
