"""All-gather and reduce-scatter of packed buffers along dim 0, with the wait visible: ``post -> wait()``.

    ag = AllGather(group)
    h = ag.gather(kv_send_LX, kv_all_WLX)     # post: rank j's rows land at rows [j L, (j+1) L) of kv_all
    ... compute on something else ...          # overlaps the transfer
    h.wait()                                   # kv_all is complete
    h = ag.reduce_scatter(dkv_all_WLX, dkv_LX) # post: the sum over ranks of rows [r L, (r+1) L) lands here
    h.wait()
    h = ag.gather_parts([(a_send, a_all), (b_send, b_all)])   # several gathers, one coalesced collective
    h.wait()
    h = AllToAllV(group).exchange(send, recv, send_splits, recv_splits)   # uneven: rows for each destination
    h.wait()

Buffers are preallocated by the caller and contiguous; dim 0 is the rank-major dimension (rank order, the
group's own ranks, never global ones). ``wait()`` on NCCL orders the current stream after the collective
without synchronising the host; on gloo it blocks. The wire dtype is whatever the caller's buffer has:
methods keep gradient partials in ``cfg.grad_dtype`` (fp32 by default) on the wire.

Pure communication: nothing here computes attention or reorders tokens.

Note [Coalesced parts]
    A layout gathered by parts (Note [Gather by parts] in ``seqpar.methods.allgather``) posts one all-gather per
    part, and its backward one reduce-scatter per part. On NCCL each collective is a launch of its own, about 0.1 ms
    of fixed cost on H100s (the real W = 4 table of 2026-11-26: all-gather at 4K tokens per GPU ran at 0.44 of the
    kernel where its emulation, which moves nothing, reached 0.67). ``gather_parts`` and ``reduce_scatter_parts``
    post the parts inside torch's coalescing manager, so NCCL runs them as one grouped collective (one launch, one
    completion to wait for); gloo and the fake group take the same coalesced calls. One part is posted alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import link as _link

__all__ = ["AllGather", "AllToAllV", "Handle"]

# torch >= 2.12 renames the tensor-in/tensor-out collectives; older releases only have the first names.
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An in-flight collective; ``wait()`` completes it (idempotent)."""

    def __init__(self, work=None):
        self._work = work

    def wait(self) -> None:
        """Order the current stream after the collective (NCCL) or block until it is done (gloo)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


class AllGather:
    """All-gather / reduce-scatter over ``group`` (None = the default group), rank-major along dim 0."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _check(self, small: torch.Tensor, big: torch.Tensor, what: str) -> None:
        if small.dtype != big.dtype or small.device != big.device:
            raise ValueError(f"{what} buffers must share dtype and device, got {small.dtype}/{small.device} and "
                             f"{big.dtype}/{big.device}")
        if big.shape[0] != self.world * small.shape[0] or big.shape[1:] != small.shape[1:]:
            raise ValueError(f"{what} needs a buffer of shape ({self.world} * {small.shape[0]}, "
                             f"{', '.join(map(str, small.shape[1:]))}), got {tuple(big.shape)}")
        if not (small.is_contiguous() and big.is_contiguous()):
            raise ValueError(f"{what} buffers must be contiguous")

    def gather(self, send: torch.Tensor, recv: torch.Tensor) -> Handle:
        """Post: every rank's ``send (L, ...)`` into ``recv (W L, ...)`` at rows ``[j L, (j+1) L)``."""
        self._check(send, recv, "all-gather")
        if self.world == 1:
            recv.copy_(send)
            return Handle()
        work = _GATHER(*_link.wire(self.group, recv, send), group=self.group, async_op=True)
        return Handle(_link.delay(work, "allgather", recv.nbytes - send.nbytes, self.world, send.device))

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor) -> Handle:
        """Post: ``recv (L, ...)`` = the sum over ranks of their ``send (W L, ...)`` rows ``[r L, (r+1) L)``."""
        self._check(recv, send, "reduce-scatter")
        if self.world == 1:
            recv.copy_(send)
            return Handle()
        work = _REDUCE_SCATTER(*_link.wire(self.group, recv, send), op=dist.ReduceOp.SUM, group=self.group,
                               async_op=True)
        return Handle(_link.delay(work, "reduce_scatter", send.nbytes - recv.nbytes, self.world, send.device))

    def gather_parts(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Handle:
        """Post ``gather(send, recv)`` for every pair as one coalesced collective (Note [Coalesced parts])."""
        return self._coalesced(self.gather, _GATHER, parts, "all-gather", "allgather", small_first=True)

    def reduce_scatter_parts(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Handle:
        """Post ``reduce_scatter(send, recv)`` for every pair as one coalesced collective (Note [Coalesced parts])."""
        return self._coalesced(self.reduce_scatter, _REDUCE_SCATTER, parts, "reduce-scatter", "reduce_scatter",
                               small_first=False, op=dist.ReduceOp.SUM)

    def _coalesced(self, one, collective, parts, what: str, pattern: str, *, small_first: bool, **kwargs) -> Handle:
        """``parts`` posted inside the coalescing manager; ``small_first``: each pair's send is the one-rank buffer
        (a gather), else its receive (a reduce-scatter)."""
        if len(parts) == 1 or self.world == 1:
            handles = [one(send, recv) for send, recv in parts]
            return handles[0] if len(handles) == 1 else Handle()      # several only at W = 1: copied already
        smalls = [(send, recv) if small_first else (recv, send) for send, recv in parts]
        for small, big in smalls:
            self._check(small, big, what)
        with dist._coalescing_manager(group=self.group, async_ops=True) as cm:
            for send, recv in parts:
                collective(*_link.wire(self.group, recv, send), group=self.group, **kwargs)
        moved = sum(big.nbytes - small.nbytes for small, big in smalls)
        return Handle(_link.delay(cm, pattern, moved, self.world, parts[0][0].device))


class AllToAllV:
    """Uneven all-to-all over ``group`` along dim 0: the selective gather and its adjoint."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.world = dist.get_world_size(group)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, send_splits: list[int],
                 recv_splits: list[int]) -> Handle:
        """Post: ``send`` rows cut into ``send_splits`` go to ranks 0..W-1 in order; ``recv`` gets
        ``recv_splits[j]`` rows from rank j, stacked in rank order."""
        if sum(send_splits) != send.shape[0] or sum(recv_splits) != recv.shape[0]:
            raise ValueError(f"all-to-all splits {send_splits} / {recv_splits} do not cover buffers of "
                             f"{send.shape[0]} / {recv.shape[0]} rows")
        if send.shape[1:] != recv.shape[1:] or send.dtype != recv.dtype or not (send.is_contiguous()
                                                                             and recv.is_contiguous()):
            raise ValueError(f"all-to-all buffers must be contiguous with one row shape and dtype, got "
                             f"{tuple(send.shape)} {send.dtype} and {tuple(recv.shape)} {recv.dtype}")
        if self.world == 1:
            recv.copy_(send)
            return Handle()
        wired = _link.wire(self.group, recv, send)
        splits = (recv_splits, send_splits) if wired[0] is recv else (None, None)     # a fake group: empty views
        work = dist.all_to_all_single(*wired, *splits, group=self.group, async_op=True)
        if _link.installed() is not None:               # Note [Modelled link]: the rows bound for other ranks
            row = send[0].nbytes if send.shape[0] else 0
            away = send.shape[0] - send_splits[dist.get_rank(self.group)]
            work = _link.delay(work, "a2a", away * row, self.world, send.device)
        return Handle(work)
