"""Collectives on small per-rank summaries (linear-attention states), posted async: ``start -> wait``.

LASP-2 moves one ``(B, H, K, V)``-sized fp32 summary per rank and direction, independent of the sequence
length, so the whole exchange is one all-gather (or one all-reduce for non-causal attention). Each is
posted before the local compute it hides behind and completed after it::

    pending = gather_states(summary, group)     # post: every rank's summary, in group-rank order
    ... local intra-chunk compute ...           # overlaps the collective
    every = pending.wait()                      # (W, *summary.shape); a stream dependency on NCCL

The gather runs on flat buffers (``all_gather_into_tensor`` semantics on every backend, gloo included);
the output buffer is allocated once per call, never inside a loop. Ranks are the group's, never global.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import link as _link

__all__ = ["Pending", "all_reduce_states", "gather_states"]


class Pending:
    """An in-flight collective; ``wait()`` completes it and returns its result tensor."""

    def __init__(self, work, result: torch.Tensor):
        self._work, self._result = work, result

    def wait(self) -> torch.Tensor:
        """Complete the collective (no host synchronisation on NCCL) and return the result."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._result


def _gather_flat():
    # torch >= 2.12 names the flat all-gather ``all_gather_single``; older releases ``all_gather_into_tensor``
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_states(x: torch.Tensor, group: dist.ProcessGroup | None, out: torch.Tensor | None = None) -> Pending:
    """Post an all-gather of ``x`` over ``group``; ``wait()`` gives ``(W, *x.shape)`` in group-rank order.

    Args:
        x: this rank's summary (any shape, contiguous or not; same shape and dtype on every rank).
        group: the process group (None = default group).
        out: optional preallocated ``(W, *x.shape)`` result buffer (contiguous).
    """
    world = dist.get_world_size(group)
    res = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device) if out is None else out
    if world == 1:
        res[0].copy_(x)
        return Pending(None, res)
    work = _gather_flat()(*_link.wire(group, res.view(-1), x.contiguous().view(-1)), group=group, async_op=True)
    return Pending(_link.delay(work, "allgather", res.nbytes - x.nbytes, world, x.device), res)


def all_reduce_states(x: torch.Tensor, group: dist.ProcessGroup | None) -> Pending:
    """Post an in-place sum all-reduce of ``x`` (contiguous) over ``group``; ``wait()`` returns ``x``."""
    if dist.get_world_size(group) == 1:
        return Pending(None, x)
    return Pending(dist.all_reduce(x, group=group, async_op=True), x)
