"""Point-to-point exchanges with visible asynchrony: ``send_recv() -> commit() -> wait()``.

An ``Exchange`` collects sends and receives on one process group and posts them together
(``dist.batch_isend_irecv``; NCCL runs them on its own stream, gloo on its threads). ``wait()`` orders the
current stream after them without synchronising the host on NCCL. Nothing here allocates: callers pass
preallocated double buffers and swap them after ``wait()``.

``Ring`` names a group's neighbours by group rank (never global rank, so nested groups - DP x CP,
Ulysses x ring in either placement - are correct) and builds exchanges for rotations and direct sends.

    ring = Ring(group)
    ex = ring.send_recv(kv, kv_next)        # post: send kv to rank+1, receive from rank-1 into kv_next
    ex.commit()
    ... compute on kv ...                   # overlaps the transfer
    ex.wait(); kv, kv_next = kv_next, kv    # swap the double buffer
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import link as _link

__all__ = ["Exchange", "Ring"]


class Exchange:
    """A batch of P2P sends/receives on one group, posted together by ``commit``, completed by ``wait``."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []
        self._posted = False

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def send(self, tensor: torch.Tensor, peer: int) -> Exchange:
        """Queue a send of ``tensor`` to group rank ``peer``."""
        self._ops.append(dist.P2POp(dist.isend, tensor, self._global(peer), self.group))
        return self

    def recv(self, tensor: torch.Tensor, peer: int) -> Exchange:
        """Queue a receive into ``tensor`` from group rank ``peer``."""
        self._ops.append(dist.P2POp(dist.irecv, tensor, self._global(peer), self.group))
        return self

    @property
    def committed(self) -> bool:
        return self._posted

    def commit(self) -> Exchange:
        """Post every queued operation (one batched launch)."""
        if self._posted:
            raise RuntimeError("this exchange was already committed")
        self._posted = True
        if self._ops:
            self._reqs = dist.batch_isend_irecv(self._ops)
            if _link.installed() is not None:           # Note [Modelled link]: the bytes this rank receives
                got = sum(op.tensor.nbytes for op in self._ops if op.op is dist.irecv)
                size = dist.get_world_size(self.group)
                held = _link.delay(None, "ring", got, size, self._ops[0].tensor.device)
                if held is not None:
                    self._reqs.append(held)
        return self

    def wait(self) -> None:
        """Complete the exchange (a stream dependency on NCCL, a blocking wait on gloo)."""
        if not self._posted:
            raise RuntimeError("wait() before commit()")
        for r in self._reqs:
            r.wait()
        self._reqs = []


class Ring:
    """The ring over ``group`` in group-rank order: ``next = rank + 1``, ``prev = rank - 1`` (mod W).

    Holds the group by weak reference (planned calls keep rings; a cache must not keep a group alive).
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self._group = None if group is None else weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    @property
    def group(self) -> dist.ProcessGroup | None:
        if self._group is None:
            return None
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this ring was destroyed")
        return group

    def peer(self, offset: int) -> int:
        """The group rank ``offset`` hops downstream (negative: upstream)."""
        return (self.rank + offset) % self.world

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, hops: int = 1,
                  exchange: Exchange | None = None) -> Exchange:
        """Queue: send ``send`` ``hops`` ranks downstream, receive ``recv`` from ``hops`` ranks upstream.

        Pass ``exchange`` to add to an existing batch (e.g. KV and dK/dV rotations posted together).
        """
        ex = exchange or Exchange(self.group)
        if self.world == 1 or hops % self.world == 0:
            recv.copy_(send)
            return ex
        return ex.send(send, self.peer(hops)).recv(recv, self.peer(-hops))
