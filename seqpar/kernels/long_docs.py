"""A varlen call's long documents run alone beside it, on a second stream, on the fastest dense kernel.

    plan(mask, heads, slots, squares)                     Varlen -> Alone | None (host ints only; cached)
    forward(fwd, side_fwd, q, k, v, alone)                the call's AttnOutput, the same rows as one call
    backward(bwd, side_bwd, do, q, k, v, out, lse, alone) its dq, dk, dv
    padded_forward / padded_backward(...)                 a square document at its bucket length
    bucket(n)                                             that length: n rounded up by at most 1/8
    slots(device)                                         thread blocks a varlen forward runs at once (0 off CUDA)

Note [Long documents in few heads]
    A varlen kernel (FA2's) gives each thread block one tile of a document's query rows (``TILE_ROWS``) and runs
    every key those rows see one block after another: a causal document's last tile sees all of its keys. With
    all 32 heads of a row on one GPU that chain hides among the call's other blocks, but Ulysses runs the row over
    H / W heads: at 4K tokens per rank over 8 (the bench's 32K lognormal row, GQA 32/8: 4 heads) the longest
    document's 6656 keys are 104 key blocks in one thread block, where the call's work averages about 70 per
    block slot of the GPU, so the call lasts about as long as that one tile (FA2 varlen: 468 us for 4 heads where
    the 32-head call takes 2421, 1.55x its share).

    ``plan`` takes every causal segment with at least as many keys as rows (a document; under all-gather, a rank's
    piece of one against all its earlier keys) whose last tile outweighs the call's visible cells per slot (cells
    x heads / ``slots``) out of the varlen call - its rows there see no key, its keys serve no row - and runs it
    alone as a causal block aligned bottom-right on a second stream, launched first, beside the varlen call; its
    rows of out, lse and dq and its keys' dk and dv are copied over the call's (which are 0 and -inf there). The
    side kernel is cuDNN where it serves the block (about 1.7x FA2 per cell on Hopper, so its long tile ends well
    inside the call; a piece with earlier keys runs as cuDNN's full block and causal diagonal, merged), else FA2
    itself. Measured on one H100 (``benchmarks/gpu/probe_long_docs.py``, the 32K lognormal row at 4 heads, 1 KV
    head): FA2 alone 0.49 / 1.68 ms forward / forward+backward, the long document alone on cuDNN 0.40 / 1.26, on
    FA2 0.46 / 1.53; one eighth of the 32-head call 0.30 / 1.23. The price is host time: about 265 us a forward
    against 58 for one FA2 call (the side call, the fork and join, the copies; ``benchmarks/results/2026-11-27-
    h100-long-docs``), so on a slow host, calls timed back to back with nothing else to hide them can lose the
    forward's gain (0.53 against 0.48 ms on one machine; the backward still gained there).

    Two designs measured before this one lost: cutting the long document in halves (the back half's rows
    against the front half's keys as a full block, merged with the varlen call's back rows) sped the varlen
    kernel up (468 -> 309 us forward, 1062 -> 719 us backward), but as tasks of the runner its merge and fp32
    sums over the whole call took the gain back (``benchmarks/results/2026-11-27-h100-packed-cut``), and inside
    the kernel with the full block beside the call the merge's host work (its table, a Triton launch, two copies)
    left the forward host-bound (0.64-0.69 ms of host time a call).

    Which kernel runs them (``FlashKernel.for_call``): cuDNN under ``kernel="auto"`` or ``"sdpa"`` where it serves;
    FA2 itself when the call named ``"flash"`` (no other kernel may serve any of it), for a deterministic backward,
    or where cuDNN does not serve. cuDNN takes pieces with earlier keys only when the call's block shapes recur
    (Note [Plans per shape] in ``seqpar.kernels.executor``); the other two take square documents only (FA2 alone
    on pieces was not measured).

    With all heads on one GPU nothing is taken out (the same row: 852K cells in the last tile against 4.6M per
    slot); windows, non-causal calls and segments with fewer keys than rows stay in the call. Off CUDA
    nothing is taken out (``slots`` is 0): the CPU tests run the same composition with the reference kernel and
    a forced slot count.

Note [Documents alone in buckets]
    cuDNN builds and keeps an execution plan per shape, and PyTorch never evicts them (Note [Plans per shape]):
    a stream of packed batches, each with new document lengths, would build a plan for every long document it
    meets. Where block shapes vary batch to batch, a square document therefore runs at its ``bucket`` length -
    zero rows and keys appended after its own (later than every real row, so none sees them), the result cut
    back - so the plans stay about 8 per octave of lengths (at most 1/8 more rows; the bench's 6656-token
    document is its own bucket). A piece with earlier keys cannot be bucketed so: its rows and keys must grow by
    the same number to keep its bottom-right offset (its count of earlier keys), so at most one of its lengths
    lands on a bucket, and keys put in front would be seen by every row; under varying shapes pieces stay in the
    varlen call.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..masks.forms import Band, Varlen
from ..types import AttnOutput
from .side import beside, join, on

__all__ = ["CTAS_PER_SM", "TILE_ROWS", "Alone", "backward", "bucket", "forward", "padded_backward", "padded_forward",
           "plan", "slots"]

TILE_ROWS = 128
"""Query rows of one thread block of FA2's varlen forward at head dim 128 (Note [Long documents in few heads])."""
CTAS_PER_SM = 2
"""Thread blocks of a varlen forward one SM runs at once (FA2 at head dim 128 on an H100, about)."""


def _band(q0: int, q1: int, k0: int, k1: int) -> Band:
    """A document's causal block, aligned bottom-right: its rows see every key up to their own."""
    return Band(None, (k1 - k0) - (q1 - q0))


@dataclass(frozen=True)
class Alone:
    """``main``: the varlen call with the long documents' rows seeing no key; ``docs``: those documents as
    ``(q0, q1, k0, k1)`` in the call's rows, each causal, aligned bottom-right (Note [Long documents in few
    heads])."""

    main: Varlen
    docs: tuple[tuple[int, int, int, int], ...]


def _cells(m: int, n: int) -> int:
    """Visible cells of a bottom-right causal segment of ``m`` rows and ``n`` keys."""
    if n >= m:
        return m * (n - m) + m * (m + 1) // 2
    return n * (n + 1) // 2


@functools.lru_cache(maxsize=256)
def plan(mask: Varlen, heads: int, slots: int, squares: bool = False) -> Alone | None:
    """The long causal segments of ``mask`` (at least as many keys as rows; ``squares``: as many) taken out, for a
    call of ``heads`` query heads on a device running ``slots`` thread blocks at once; None when no segment's last
    tile outweighs a slot's share."""
    if mask.window != (-1, 0) or slots <= 0:
        return None
    segs = list(zip(itertools.pairwise(mask.cu_q), itertools.pairwise(mask.cu_k)))
    per_slot = heads * sum(_cells(q1 - q0, k1 - k0) for (q0, q1), (k0, k1) in segs) / slots
    cu_q, cu_k, docs = [mask.cu_q[0]], [mask.cu_k[0]], []
    for (q0, q1), (k0, k1) in segs:
        m, n = q1 - q0, k1 - k0
        if 0 < m <= n and (m == n or not squares) and n >= 2 * TILE_ROWS and n * TILE_ROWS > per_slot:
            docs.append((q0, q1, k0, k1))
            cu_q += [q1, q1]                 # its rows with no keys, then its keys with no rows
            cu_k += [k0, k1]
        else:
            cu_q.append(q1)
            cu_k.append(k1)
    if not docs:
        return None
    return Alone(Varlen(tuple(cu_q), tuple(cu_k), mask.window), tuple(docs))


@functools.lru_cache(maxsize=16)
def slots(device: torch.device) -> int:
    """Thread blocks a varlen forward runs at once on ``device``; 0 off CUDA (no kernel there runs one tile's keys
    on one core while others idle) or where no CUDA device answers (a plan made for one on a CPU machine)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def forward(fwd: Callable[..., AttnOutput], side_fwd: Callable[..., AttnOutput], q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, alone: Alone) -> AttnOutput:
    """``fwd(q, k, v, mask) -> AttnOutput``: the varlen kernel; ``side_fwd``: the kernel of the documents alone
    (on the second stream, launched first). q ``(B, S, H, D)``, k and v ``(B, S, Hkv, D)``."""
    side = beside(q.device)
    with on(side):
        parts = [side_fwd(q[:, a:b], k[:, c:d], v[:, c:d], _band(a, b, c, d)) for a, b, c, d in alone.docs]
    o, lse = fwd(q, k, v, alone.main)
    join(side, [t for p in parts for t in p])
    for (a, b, _, _), (po, pl) in zip(alone.docs, parts):
        o[:, a:b].copy_(po)
        lse[:, :, a:b].copy_(pl)
    return AttnOutput(o, lse)


def backward(bwd: Callable[..., tuple[torch.Tensor, ...]], side_bwd: Callable[..., tuple[torch.Tensor, ...]],
             do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, alone: Alone) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``bwd(do, q, k, v, out, lse, mask) -> (dq, dk, dv)``: the varlen kernel; ``side_bwd``: the documents'
    kernel, as in ``forward``; from the call's final ``out`` and ``lse``."""
    side = beside(q.device)
    with on(side):
        parts = [side_bwd(do[:, a:b], q[:, a:b], k[:, c:d], v[:, c:d], out[:, a:b], lse[:, :, a:b],
                          _band(a, b, c, d)) for a, b, c, d in alone.docs]
    dq, dk, dv = bwd(do, q, k, v, out, lse, alone.main)
    join(side, [t for p in parts for t in p])
    for (a, b, c, d), (gq, gk, gv) in zip(alone.docs, parts):
        dq[:, a:b].copy_(gq)
        dk[:, c:d].copy_(gk)
        dv[:, c:d].copy_(gv)
    return dq, dk, dv


def bucket(n: int) -> int:
    """``n`` rounded up to a multiple of ``TILE_ROWS`` and of an eighth of the power of two at or below ``n``: at
    most 1/8 more rows, and about 8 lengths per octave (Note [Documents alone in buckets])."""
    g = max(TILE_ROWS, 1 << max(0, n.bit_length() - 4))
    return -(-n // g) * g


def _padded(x: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    """``x`` with ``rows`` more rows of ``value`` at the end of dim 1."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, rows), value=value)


def padded_forward(fwd: Callable[..., AttnOutput], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> AttnOutput:
    """A square causal document's ``fwd(q, k, v, causal)`` at its ``bucket`` length (Note [Documents alone in
    buckets]): zero rows and keys appended after its own, which none of its rows sees; the result cut back."""
    m = q.shape[1]
    pad = bucket(m) - m
    if pad == 0:
        return fwd(q, k, v, _band(0, m, 0, m))
    o, lse = fwd(_padded(q, pad), _padded(k, pad), _padded(v, pad), _band(0, m, 0, m))
    return AttnOutput(o[:, :m], lse[:, :, :m])


def padded_backward(bwd: Callable[..., tuple[torch.Tensor, ...]], do: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``padded_forward``: the appended rows carry zero queries, outputs and output gradients and
    an lse of 0 (every weight they give is exp(0 - 0) = 1, finite, and multiplies a zero), so they add nothing to
    any key's gradient; the gradients cut back."""
    m = q.shape[1]
    pad = bucket(m) - m
    if pad == 0:
        return bwd(do, q, k, v, out, lse, _band(0, m, 0, m))
    dq, dk, dv = bwd(*(_padded(x, pad) for x in (do, q, k, v, out)), F.pad(lse, (0, pad)), _band(0, m, 0, m))
    return dq[:, :m], dk[:, :m], dv[:, :m]
