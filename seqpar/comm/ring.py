"""Point-to-point exchanges with visible asynchrony: ``send_recv() -> commit() -> wait()``.

An ``Exchange`` collects sends and receives on one process group and posts them together
(``dist.batch_isend_irecv``; NCCL runs them on its own stream, gloo on its threads). ``wait()`` orders the
current stream after them without synchronising the host on NCCL. Nothing here allocates: callers pass
preallocated double buffers and swap them after ``wait()``.

``Ring`` names a group's neighbours by group rank (never global rank, so nested groups - DP x CP,
Ulysses x ring in either placement - are correct) and builds exchanges for rotations and direct sends. A ring
with ``transport="copy_engine"`` moves a hop whose receive buffer is one of its ``buffers()`` on copy engines
instead (a push into the peer's symmetric memory: Note [Copy-engine ring] in ``seqpar.comm.symmetric``); every
other transfer, and every transfer of an NCCL ring, goes through ``batch_isend_irecv``.

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
from . import symmetric as _symmetric

__all__ = ["Exchange", "Ring"]


class Exchange:
    """A batch of P2P sends/receives on one group, posted together by ``commit``, completed by ``wait``."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._ops: list[dist.P2POp] = []
        self._pushes: dict[_symmetric.Lane, list[tuple[torch.Tensor, torch.Tensor]]] = {}
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

    def push(self, tensor: torch.Tensor, remote: torch.Tensor, lane: _symmetric.Lane) -> Exchange:
        """Queue a copy of ``tensor`` into ``remote``, a peer's buffer of ``lane`` (Note [Copy-engine ring]); each
        lane's pushes are posted together, on its own stream."""
        self._pushes.setdefault(lane, []).append((tensor, remote))
        return self

    def join(self, lane: _symmetric.Lane) -> Exchange:
        """Post ``lane`` in this exchange with nothing of this rank's to push: a lane's barriers pair up across ranks,
        so every rank must post it at the same exchanges (Note [Copy-engine ring])."""
        self._pushes.setdefault(lane, [])
        return self

    @property
    def committed(self) -> bool:
        return self._posted

    def commit(self) -> Exchange:
        """Post every queued operation (one batched launch; the pushes, one lane post)."""
        if self._posted:
            raise RuntimeError("this exchange was already committed")
        self._posted = True
        self._reqs += [lane.post(pushes) for lane, pushes in self._pushes.items()]
        if self._ops:
            self._reqs += dist.batch_isend_irecv(self._ops)
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

    def __init__(self, group: dist.ProcessGroup | None, transport: str = "nccl"):
        self._group = None if group is None else weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.transport = transport
        self._buffers: dict[tuple, tuple[_symmetric.Lane, list[torch.Tensor]]] = {}

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

    @property
    def copies(self) -> bool:
        """Whether hops into ``buffers()`` move on copy engines (``transport="copy_engine"`` and more than one rank);
        callers ask before building ``buffers()``' specs, so an NCCL ring's call pays nothing for them."""
        return self.transport == "copy_engine" and self.world > 1

    def buffers(self, specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device, tag: str
                ) -> list[torch.Tensor] | None:
        """Receive buffers of ``specs`` (shape, dtype) that hops reach on copy engines, or None unless ``copies``
        (callers allocate their own). ``tag`` names their use: the group's lane of that use, grown when these specs
        need more (Note [Lanes are shared] in ``seqpar.comm.symmetric``); this ring keeps the views it carved, so a
        plan's later calls look nothing up."""
        if not self.copies:
            return None
        key = (tag, tuple(specs), device)
        if key not in self._buffers:
            lane = _symmetric.lane(self.group, device, specs, tag)
            self._buffers[key] = (lane, lane.carve(specs))
        return self._buffers[key][1]

    def _lane_of(self, t: torch.Tensor) -> _symmetric.Lane | None:
        return next((lane for lane, _ in self._buffers.values() if lane.holds(t)), None)

    def push(self, send: torch.Tensor, region: torch.Tensor, hops: int, exchange: Exchange) -> Exchange:
        """Queue ``send`` into rank ``rank + hops``'s copy of ``region`` (one of ``buffers()``, its first bytes viewed
        as ``send``'s shape and dtype): a receipt whose shape the receiver plans itself (``symmetric.region_view``)."""
        lane = self._region_lane(region)
        return exchange.push(send, lane.remote(region, self.peer(hops), like=send), lane)

    def skip(self, region: torch.Tensor, exchange: Exchange) -> Exchange:
        """Take part in ``exchange``'s pushes into ``region``'s lane with nothing to send (this rank's step has no
        partial, a peer's may have one): every rank posts the lane's barriers alike (``Exchange.join``)."""
        return exchange.join(self._region_lane(region))

    def _region_lane(self, region: torch.Tensor) -> _symmetric.Lane:
        lane = self._lane_of(region)
        if lane is None:
            raise RuntimeError("Ring.push needs a region of this ring's buffers()")
        return lane

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, hops: int = 1,
                  exchange: Exchange | None = None) -> Exchange:
        """Queue: send ``send`` ``hops`` ranks downstream, receive ``recv`` from ``hops`` ranks upstream.

        Pass ``exchange`` to add to an existing batch (e.g. KV and dK/dV rotations posted together). When
        ``recv`` is one of ``buffers()``, every rank's ``send`` is pushed into its downstream peer's ``recv``.
        """
        ex = exchange or Exchange(self.group)
        if self.world == 1 or hops % self.world == 0:
            recv.copy_(send)
            return ex
        lane = self._lane_of(recv) if self._buffers else None
        if lane is not None:
            return ex.push(send, lane.remote(recv, self.peer(hops)), lane)
        return ex.send(send, self.peer(hops)).recv(recv, self.peer(-hops))
