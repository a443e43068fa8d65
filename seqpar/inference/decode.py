"""Decode: the new token's query, the same on every rank, against every rank's slice; one collective per layer.

Note [Exact decode merge]
    Context parallelism replicates the new token: every rank computes the same q, k, v. Each rank attends the
    query to its own slice (the token's k, v are already in it on the rank that owns it, ``p mod W``) and gets
    a partial ``(out, lse)`` normalised over its own keys, in fp32. One all-gather moves the W partials of the
    new rows - ``B n H (Dv + 1)`` floats per rank, whatever the context length - and every rank MERGEs them
    (``seqpar.kernels.merge``) in index order 0..W-1: the same inputs in the same order, so every rank ends
    with the bitwise-same result, which keeps sampling and every later layer identical across ranks. A rank
    with nothing visible contributes (0, -inf), which the merge ignores. On a 2D mesh the gather runs on each
    axis in turn (``SeqParallelGroups.all_gather``).

Note [Static decode step]
    ``StaticDecode`` is the step a CUDA graph can capture: on a static cache (preallocated, never
    reallocated) it does only device work of fixed shape. The position p is a device scalar; the owner's
    write goes to row ``fill`` of every layer, the other ranks write into a scratch row that nothing sees;
    which rows are visible is a device mask over the whole buffer (``_local.SlotMask``: positions in
    ``[max(start_b, p - w), p]``); the merge is the all-gather above into preallocated buffers. The host learns
    where p is once, at ``close()`` (one read of p), and records the tokens like ``begin_decode`` does.
    The price of fixed shapes: every step reads the whole buffer, so size ``max_len`` to the run.

    The buffer's bound is kept on the host, before anything is written: ``max_steps`` (the steps before some
    rank's rows run out, agreed over the ranks when the step is built) against the steps the host has
    launched - each eager ``begin()`` and each ``replay(graph)`` counts one, a ``begin()`` being captured
    counts none (its graph counts when replayed). The step past the bound raises before its first write, on
    every rank alike, with no device read: an out-of-range ``index_copy_`` on a GPU would poison the context.
    A graph replayed around ``replay`` is not counted; ``close()`` still catches it, too late to prevent it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..errors import rank_suffix
from ..kernels.merge import Accumulator
from ..layouts.blocks import Task
from ..numerics import apply_sinks
from ._local import SlotMask, attend_block
from .cache import host_gather
from .extend import Partials, out_like, run_tasks
from .plans import check_window

__all__ = ["StaticDecode", "decode_attend", "merge_ranks"]


def merge_ranks(out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, groups, parts: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Note [Exact decode merge]: every rank's partial of the same rows, merged in index order.

    Args:
        out_BSHD: this rank's partial ``(B, n, H, Dv)`` in the accumulation dtype (fp32, fp64 for fp64).
        lse_BHS: its lse ``(B, H, n)``, same dtype.
        groups: the cache's ``SeqParallelGroups``.
        parts: W preallocated receive buffers of ``out.numel() + lse.numel()`` (the static step's), or None.

    Returns:
        The merged ``(out, lse)`` in the accumulation dtype, identical on every rank.
    """
    if groups.world == 1:
        return out_BSHD, lse_BHS
    flat = torch.cat([out_BSHD.reshape(-1), lse_BHS.reshape(-1)])
    if groups.group is not None:
        parts = parts if parts is not None else [torch.empty_like(flat) for _ in range(groups.world)]
        dist.all_gather(parts, flat, group=groups.group)
    else:
        parts = groups.all_gather(flat)
    acc = Accumulator(out_BSHD)
    rows = out_BSHD.shape[1]
    acc.add(slice(0, 0), out_BSHD[:, :0], lse_BHS[:, :, :0])      # own buffers: never a view of a receive buffer
    n = out_BSHD.numel()
    for part in parts:
        acc.add(slice(0, rows), part[:n].view_as(out_BSHD), part[n:].view_as(lse_BHS))
    assert acc.out is not None and acc.lse is not None
    return acc.out, acc.lse


def decode_attend(q: torch.Tensor, k_SBHD: torch.Tensor, v_SBHD: torch.Tensor, tasks: Sequence[tuple[Task, ...]],
                  row_groups, groups, scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Replicated queries ``q (B, n, H, D)`` against this rank's slice, merged over ranks (fp32 results)."""
    acc = Partials(out_like(q, v_SBHD.shape[-1]), row_groups)
    run_tasks(acc, q, k_SBHD.transpose(0, 1), v_SBHD.transpose(0, 1), tasks, scale, kernel)
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = acc.result(dt)
    return merge_ranks(out, lse, groups)


class StaticDecode:
    """Graph-capturable decode steps on a static ``ShardedKVCache`` (Note [Static decode step]).

        dec = cache.static_decode()               # after the prompt; device state from the host's records
        dec.begin()                               # capture from here ...
        for layer: out = dec.attend(q, k, v, layer, softmax_scale=..., window_size=..., sinks=...)
        dec.end()                                 # ... to here; dec.replay(graph) while ``dec.steps_left``
        dec.close()                               # one host read: the cache records the decoded tokens

    ``position`` is the device scalar of the token being decoded; ``position_ids`` its RoPE positions ``(B, 1)``.
    """

    def __init__(self, cache, batch_starts: torch.Tensor):
        self.cache = cache
        lay0 = cache.layers[0]
        assert lay0.k is not None
        device = lay0.k.device
        W, me = cache.world, cache.index
        self.scratch = cache.rank_capacity
        self.start_len = cache.length
        self.position = torch.tensor(cache.length, dtype=torch.long, device=device)
        self.starts = batch_starts.to(device)
        self.position_ids = torch.empty(cache.spec.batch, 1, dtype=torch.long, device=device)
        self.mine = torch.zeros((), dtype=torch.bool, device=device)
        self.fill = torch.empty(cache.spec.layers, dtype=torch.long, device=device)
        self.slot_pos = torch.full((cache.spec.layers, self.scratch + 1), -1, dtype=torch.long, device=device)
        for i, lay in enumerate(cache.layers):
            first, stop = cache.live(i)
            self.slot_pos[i, first - lay.base:stop - lay.base] = cache.rows[me].positions_tensor(first, device)
            self.fill[i] = stop - lay.base
        free = min(self.scratch - (cache.live(i)[1] - lay.base) for i, lay in enumerate(cache.layers))
        self.max_steps = W * min(host_gather(cache.groups, free))
        """Steps before some rank's rows run out (a rank writes every W-th token); the same on every rank."""
        self.steps = 0
        """Steps the host has launched: eager ``begin()`` calls and ``replay`` calls."""
        self._parts: dict[tuple, list[torch.Tensor]] = {}

    @property
    def steps_left(self) -> int:
        """Steps that may still run before the cache's rows run out."""
        return self.max_steps - self.steps

    def begin(self) -> None:
        """Start a step: who owns the token at ``position``, and its RoPE positions (device ops only).

        Raises RuntimeError, before writing anything, when the step would pass ``max_steps`` (a ``begin`` being
        captured in a CUDA graph is not counted: ``replay`` counts the graph's steps).
        """
        if not _capturing():
            self._take()
        self.mine.copy_(self.position % self.cache.world == self.cache.index)
        self.position_ids.copy_((self.position - self.starts).clamp(min=0).unsqueeze(1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, *, softmax_scale: float | None,
               window_size: tuple[int, int] = (-1, -1), sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store the step's ``k, v (B, 1, Hkv, D|Dv)`` on the owner and attend ``q (B, 1, H, D)``; ``(B, 1, H, Dv)``."""
        left = check_window(window_size)
        lay = self.cache.layers[layer]
        slot = torch.where(self.mine, self.fill[layer], self.scratch).view(1)
        lay.k.index_copy_(0, slot, k.transpose(0, 1))
        lay.v.index_copy_(0, slot, v.transpose(0, 1))
        self.slot_pos[layer].index_copy_(0, slot, torch.where(self.mine, self.position, -1).view(1))
        self.fill[layer] += self.mine.long()
        lo = self.starts if left < 0 else torch.maximum(self.starts, self.position - left)
        pos = self.slot_pos[layer]
        visible = (pos[None, :] >= lo[:, None]) & (pos[None, :] <= self.position)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        kernel = self.cache.spec.kernel
        out, lse = attend_block(q, lay.k.transpose(0, 1), lay.v.transpose(0, 1), SlotMask(visible), scale, kernel)
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = merge_ranks(out.to(dt), lse.to(dt), self.cache.groups, self._buffers(out, lse))
        if sinks is not None:
            out, lse = apply_sinks(out, lse, sinks)
        return out.to(q.dtype)

    def _buffers(self, out: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor] | None:
        if self.cache.groups.group is None or self.cache.world == 1:
            return None
        key = (out.shape, lse.shape)
        if key not in self._parts:
            n = out.numel() + lse.numel()
            dt = torch.float64 if out.dtype == torch.float64 else torch.float32
            self._parts[key] = [torch.empty(n, dtype=dt, device=out.device) for _ in range(self.cache.world)]
        return self._parts[key]

    def end(self) -> None:
        """End a step: the next token's position (device op)."""
        self.position += 1

    def replay(self, graph) -> None:
        """``graph.replay()`` of one captured step (``begin`` ... ``end``), counted against ``max_steps`` first:
        the step past the bound raises before the graph runs."""
        self._take()
        graph.replay()

    def _take(self) -> None:
        if self.steps >= self.max_steps:
            raise RuntimeError(
                f"a static decode may take {self.max_steps} steps before the cache's rows run out (max_len="
                f"{self.cache.spec.max_len}), got step {self.steps + 1}: refused before writing (the cache holds the "
                f"{self.steps} steps taken); close() this decode and give a larger max_len to decode further"
                f"{rank_suffix()}")
        self.steps += 1

    def close(self) -> int:
        """Record the decoded tokens in the cache's host state (one device read); returns how many."""
        n = int(self.position.item()) - self.start_len
        if n > self.max_steps:
            raise RuntimeError(f"a static decode may take {self.max_steps} steps before the cache's rows run out, "
                               f"got {n}: the cache is corrupt; give a larger max_len{rank_suffix()}")
        self.cache._close_static(self, n)
        return n


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
