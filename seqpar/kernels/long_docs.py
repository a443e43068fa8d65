"""A varlen call's long documents cut in two, the cut's full block beside the call on a second stream.

    plan(mask, heads, slots)                   Varlen -> Cut | None (host ints only; cached)
    forward(fwd, q, k, v, cut)                 the cut call's AttnOutput, the same rows as the uncut call
    backward(bwd, do, q, k, v, out, lse, cut)  its dq, dk, dv
    slots(device)                              thread blocks a varlen forward runs at once (0 off CUDA)

Note [Long documents in few heads]
    A varlen kernel (FA2's) gives each thread block one tile of a document's query rows (``TILE_ROWS``) and runs
    every key those rows see one block after another: a causal document's last tile sees all of its keys. With
    all 32 heads of a row on one GPU that chain hides among the call's other blocks, but Ulysses runs the row over
    H / W heads and all-gather runs a rank's W-th of the rows: at 4K tokens per rank over 8 (the bench's 32K
    lognormal row, GQA 32/8: 4 heads) the longest document's 6656 keys are 104 key blocks in one thread block,
    where the call's work averages about 70 per block slot of the GPU, so the call lasts about as long as that
    one tile (FA2 varlen: 468 us for 4 heads where the 32-head call takes 2421, 1.55x its share).

    ``plan`` cuts a causal segment (``m`` query rows, ``n >= m`` keys, bottom-right) whose last tile outweighs the
    call's visible cells per slot (cells x heads / ``slots``) at row ``r = m - n / 2`` (tile-aligned, at least 0):

        front   rows [0, r)  x keys [0, n - m + r)   causal, stays in the varlen call
        back    rows [r, m)  x keys [n - m + r, n)   causal (square), stays in the varlen call
        side    rows [r, m)  x keys [0, n - m + r)   full: every back row sees all of these keys

    so no tile of the varlen call runs more than about n / 2 keys, and the side block runs as a dense call, whose
    forward FA2 splits over its keys when it has few tiles (split-KV). The back rows' two partials merge in one
    pass (``combine.merge_parts``) and the side's gradients are added to the varlen call's.

    An earlier form (2026-11-27, ``benchmarks/results/2026-11-27-h100-packed-cut``) cut the same documents as
    tasks of the runner: the varlen kernel sped up (468 -> 309 us forward, 1062 -> 719 us backward) but the side
    block ran after it on the same stream, and the task machinery merged and summed over every row of the call in
    fp32 (about 130 us in the backward), which took the gain back. Here the side blocks run on a second stream
    beside the varlen call (their few thread blocks fill the slots its tail leaves), the merge reads and writes
    only the back rows, and the gradient adds touch only the side's rows, in the kernel's dtype.

    With all heads on one GPU nothing is cut (the same row: 852K cells in the last tile against 4.6M per slot);
    windows and non-causal calls are not cut (a window bounds the chain; a full segment's tiles all see every
    key). Off CUDA nothing is cut (``slots`` is 0): the CPU tests run the same composition with the reference
    kernel and a forced slot count.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..masks.forms import Band, Varlen
from ..types import AttnOutput
from .combine import merge_parts

__all__ = ["CTAS_PER_SM", "TILE_ROWS", "Cut", "backward", "forward", "plan", "slots"]

TILE_ROWS = 128
"""Query rows of one thread block of FA2's varlen forward at head dim 128 (Note [Long documents in few heads])."""
CTAS_PER_SM = 2
"""Thread blocks of a varlen forward one SM runs at once (FA2 at head dim 128 on an H100, about)."""

FULL = Band()


@dataclass(frozen=True)
class Cut:
    """``main``: the varlen call with every cut segment as its front and back; ``sides``: the full blocks
    ``(q0, q1, k0, k1)`` in the call's rows (Note [Long documents in few heads])."""

    main: Varlen
    sides: tuple[tuple[int, int, int, int], ...]


def _cells(m: int, n: int) -> int:
    """Visible cells of a bottom-right causal segment of ``m`` rows and ``n`` keys."""
    if n >= m:
        return m * (n - m) + m * (m + 1) // 2
    return n * (n + 1) // 2


@functools.lru_cache(maxsize=256)
def plan(mask: Varlen, heads: int, slots: int) -> Cut | None:
    """The cut of ``mask``'s long causal segments for a call of ``heads`` query heads on a device running
    ``slots`` thread blocks at once; None when no segment's last tile outweighs a slot's share."""
    if mask.window != (-1, 0) or slots <= 0:
        return None
    segs = list(zip(itertools.pairwise(mask.cu_q), itertools.pairwise(mask.cu_k)))
    per_slot = heads * sum(_cells(q1 - q0, k1 - k0) for (q0, q1), (k0, k1) in segs) / slots
    cu_q, cu_k, sides = [mask.cu_q[0]], [mask.cu_k[0]], []
    for (q0, q1), (k0, k1) in segs:
        m, n = q1 - q0, k1 - k0
        if 0 < m <= n and n >= 2 * TILE_ROWS and n * TILE_ROWS > per_slot:
            r = max(0, m - n // 2) // TILE_ROWS * TILE_ROWS
            kc = k0 + n - m + r                      # the keys every back row sees end here
            cu_q.append(q0 + r)
            cu_k.append(kc)
            sides.append((q0 + r, q1, k0, kc))
        cu_q.append(q1)
        cu_k.append(k1)
    if not sides:
        return None
    return Cut(Varlen(tuple(cu_q), tuple(cu_k), mask.window), tuple(sides))


def slots(device: torch.device) -> int:
    """Thread blocks a varlen forward runs at once on ``device``; 0 off CUDA (no kernel there runs one tile's keys
    on one core while others idle) or where no CUDA device answers (a plan made for one on a CPU machine)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _beside(device: torch.device) -> torch.cuda.Stream | None:
    """The second stream, made to wait for the current one's work so far; None off CUDA (run in order)."""
    if device.type != "cuda":
        return None
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _join(side: torch.cuda.Stream | None, made: list[torch.Tensor]) -> None:
    """The current stream waits for ``side``; tensors made there are marked as used here, so their memory is not
    handed to the side stream's next work before this stream is done with them."""
    if side is None:
        return
    cur = torch.cuda.current_stream(side.device)
    cur.wait_stream(side)
    for t in made:
        t.record_stream(cur)


def forward(fwd: Callable[..., AttnOutput], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cut: Cut, *,
            side_first: bool = True) -> AttnOutput:
    """``fwd(q, k, v, mask) -> AttnOutput`` (the kernel, uncut) over ``cut``: the side blocks on the second
    stream, the varlen call on this one, the back rows merged. q ``(B, S, H, D)``, k and v ``(B, S, Hkv, D)``.
    ``side_first``: launch the side blocks before the varlen call (Note [Long documents in few heads]; False is
    the order ``benchmarks/gpu/probe_long_docs.py`` compares it with)."""
    side = _beside(q.device)
    if not side_first:
        o, lse = fwd(q, k, v, cut.main)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        parts = [fwd(q[:, a:b], k[:, c:d], v[:, c:d], FULL) for a, b, c, d in cut.sides]
    if side_first:
        o, lse = fwd(q, k, v, cut.main)
    _join(side, [t for p in parts for t in p])
    for (a, b, _, _), (po, pl) in zip(cut.sides, parts):
        rows = slice(0, b - a)
        mo, ml = merge_parts([(rows, o[:, a:b], lse[:, :, a:b]), (rows, po, pl)], (o.shape[0], b - a, *o.shape[2:]),
                             o.dtype)
        o[:, a:b].copy_(mo)
        lse[:, :, a:b].copy_(ml)
    return AttnOutput(o, lse)


def backward(bwd: Callable[..., tuple[torch.Tensor, ...]], do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cut: Cut, *, side_first: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``bwd(do, q, k, v, out, lse, mask) -> (dq, dk, dv)`` (the kernel, uncut) over ``cut``, from the call's
    final ``out`` and ``lse``: the varlen call's gradients with the side blocks' added (``side_first`` as in
    ``forward``)."""
    side = _beside(q.device)
    if not side_first:
        dq, dk, dv = bwd(do, q, k, v, out, lse, cut.main)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        parts = [bwd(do[:, a:b], q[:, a:b], k[:, c:d], v[:, c:d], out[:, a:b], lse[:, :, a:b], FULL)
                 for a, b, c, d in cut.sides]
    if side_first:
        dq, dk, dv = bwd(do, q, k, v, out, lse, cut.main)
    _join(side, [t for p in parts for t in p])
    for (a, b, c, d), (gq, gk, gv) in zip(cut.sides, parts):
        dq[:, a:b] += gq
        dk[:, c:d] += gk
        dv[:, c:d] += gv
    return dq, dk, dv

