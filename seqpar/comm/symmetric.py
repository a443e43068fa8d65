"""Ring hops on copy engines: receive buffers in torch's symmetric memory, written by the upstream rank's ``copy_``.

    ring = Ring(group, transport="copy_engine")
    a, b = ring.buffers([(k.shape, k.dtype)] * 2, k.device, "kv")   # the first call makes the lane: a collective
    ring.send_recv(k, a).commit().wait()              # k lands in rank + 1's ``a``: a copy engine, no NCCL kernel

Note [Copy-engine ring]
    At 1-4K tokens per GPU the real ring is bound by its transfers, not by its compute path: on four H100s (NV18)
    NCCL moved a ring step's block to the neighbour at 111 GB/s (64 MiB; 66 GB/s at 16 MiB, 17 at 4 MiB), while a
    peer-to-peer ``copy_`` between two of torch's symmetric-memory barriers moved it at 300 GB/s (187 at 16 MiB, 58
    at 4 MiB; ``benchmarks/results/2026-11-27-4xh100-p2p-knobs/``, ``benchmarks/gpu/p2p_lanes.py``). None of
    NCCL's settings tried came near (registered buffers, 32 channels, the Simple protocol, NCCL's own copy-engine
    P2P: 96-239 GB/s at 64-256 MiB). The copy also runs on a copy engine, not on SMs, so the attention beside it
    keeps the whole GPU.

    ``transport="copy_engine"`` (a ring option) runs the ring's K/V hops that way:

    * A ``Lane`` is one allocation of torch's symmetric memory per (group, device, use), rendezvoused once (a
      collective: every rank reaches it at the same call, the plan's first) and grown only when a call needs more
      (Note [Lanes are shared]): a plan's receive buffers are views into it, at the same offsets on every rank.
    * A hop *pushes*: rank r copies its block (any local tensor - the caller's own K on the first hop) into rank
      r + 1's copy of the receive buffer. Only receive buffers must be symmetric, so the first hop still sends
      the caller's tensor as it lies (Note [K and V apart] in ``seqpar.methods.allgather``).
    * On a stream of the lane's own, after the posting stream's work so far: a barrier of the group (every rank
      has finished what it posted before this hop - the compute that read the buffers now written), the copies,
      a second barrier (every rank's copies have landed). ``wait()`` makes the waiting stream wait for it. The
      barriers are GPU-side (the symmetric memory's signal pads), so nothing blocks the host, and a planned call
      captured as a CUDA graph replays them (Note [Graphed calls]).
    * Every rank of the group posts the same hops in the same order (a ring's hops are lockstep), which is what
      the barriers need: a rank with nothing to push at a hop still posts the lane (``Ring.skip``), else its
      peers' barriers wait for it forever (a backward over documents, whose rank had no partial at a step, hung
      so on four H100s). Each lane posts on its own stream, so two lanes' pushes of one exchange run side by side.
    * The backward's dK/dV partials that go straight home (Note [Partials home] in ``seqpar.methods._passkv``) are
      pushed too, into a lane of their own (``tag="home"``): per step a byte region of the whole block in the wider
      dtype, since each rank's receipt has its own rows, and the regions must lie at the same offsets everywhere;
      the receiver reads its receipt's shape from the front (``region_view``). They are held until the backward's
      one sum, so a region is written once per call. Past ``COPY_HOME_BYTES`` of regions, and on the running-sums
      path (long chunks), dK/dV travel on NCCL in the same exchange.

    Measured on four H100s, calls back to back (``benchmarks/results/2026-11-27-4xh100-copy-engine/``): the ring's
    forward 1.3-2.1x faster than on NCCL at 1-4K tokens per GPU (MHA 16K 0.36 -> 0.76, GQA 8K 0.46 -> 0.70), its
    forward+backward 1.04-1.3x (MHA 16K 0.49 -> 0.61 with K/V pushed, 0.65 with the partials pushed too). Results
    are bitwise those of the NCCL ring with deterministic kernels (``tests/test_gpu_copy_engine.py``). On CPU the
    whole schedule runs with each lane's pushes delivered over gloo, every post paired across ranks as the barriers
    pair them (``tests/test_copy_engine.py``): bitwise the gloo ring's, and the dense oracle's.

    What it needs, checked before any collective (``check``): CUDA tensors, an NCCL group, torch's symmetric
    memory, and - checked when the lane is made, on every rank alike - every rank of the group on one host. It is
    never chosen silently: ``transport="nccl"`` is the default; ``method="auto", transport="copy_engine"`` lets the
    planner rank it (the profile's ``p2p_copy`` curve, ``seqpar.planner.calibrate`` measures it; one host only).
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..errors import rank_suffix
from ..memo import Same

__all__ = ["ALIGN", "COPY_A2A_BYTES", "TRANSPORTS", "Lane", "Pulls", "check", "lane", "region_view", "span", "usable"]

TRANSPORTS = ("nccl", "copy_engine")
"""A ring's ``transport=`` values (Note [Copy-engine ring])."""

ALIGN = 256
"""Byte alignment of each buffer carved from a lane (the copy engines' and the kernels' friendly boundary)."""

_LANES: dict[tuple, Lane] = {}   # (the group, weakly: memo.Same; device, use) -> its lane


def _symm():
    """torch's symmetric memory module, or None where this build has none."""
    try:
        import torch.distributed._symmetric_memory as symm
    except ImportError:
        return None
    return symm if hasattr(symm, "rendezvous") and hasattr(symm, "empty") else None


def usable(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (None: the default group) could run copy-engine hops: CUDA, an NCCL group, symmetric
    memory in this torch build (one host is checked when a lane is made)."""
    if not (torch.cuda.is_available() and dist.is_initialized() and _symm() is not None):
        return False
    return dist.get_backend(group) == "nccl"


def check(transport: Any, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise ``ValueError`` naming the value and the rank when ``transport`` cannot run on ``group``/``device``."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}{rank_suffix()}")
    if transport == "nccl":
        return
    why = ("its tensors are not on CUDA" if device.type != "cuda" else
           "this torch build has no symmetric memory" if _symm() is None else
           f"its group's backend is {dist.get_backend(group)!r}, not 'nccl'" if dist.get_backend(group) != "nccl"
           else None)
    if why is not None:
        raise ValueError(f"transport='copy_engine' needs CUDA tensors on an NCCL group with torch's symmetric "
                         f"memory, but {why}: pass transport='nccl'{rank_suffix()}")


class Lane:
    """One symmetric allocation of ``nbytes`` on ``group``: receive buffers carved from it, pushes posted on it."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, nbytes: int):
        """Allocate and map: a collective of ``group``. The allocation's outcome and each rank's host are gathered
        first, so a group that spans hosts, or a rank whose allocation failed, raises the same error on every rank
        before the rendezvous (which would otherwise wait for the failed rank's handle until the store times out)."""
        symm = _symm()
        group = group if group is not None else dist.group.WORLD
        name = group.group_name
        error = None
        try:
            if hasattr(symm, "is_symm_mem_enabled_for_group") and not symm.is_symm_mem_enabled_for_group(name):
                with warnings.catch_warnings():      # torch 2.11 needs it; later versions deprecate it
                    warnings.simplefilter("ignore", FutureWarning)
                    symm.enable_symm_mem_for_group(name)
            self.buf = symm.empty(nbytes, dtype=torch.uint8, device=device)
        except Exception as e:                       # reported on every rank below
            error = f"{type(e).__name__}: {str(e)[:300]}"
        infos: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(infos, (socket.gethostname(), error), group=group)
        hosts = sorted({h for h, _ in infos})
        if len(hosts) > 1:                           # every rank saw the same list: every rank raises
            raise ValueError(f"transport='copy_engine' needs every rank of the group on one host, got hosts "
                             f"{hosts}: pass transport='nccl'{rank_suffix()}")
        failed = [(r, e) for r, (_, e) in enumerate(infos) if e is not None]
        if failed:
            raise RuntimeError(f"transport='copy_engine' could not allocate {nbytes} bytes of symmetric memory on "
                               f"group rank(s) {[r for r, _ in failed]} ({failed[0][1]}): pass transport='nccl'"
                               f"{rank_suffix()}")
        self.device, self.nbytes = device, nbytes
        self.handle = symm.rendezvous(self.buf, name)
        self.stream = torch.cuda.Stream(device)
        self._sides: list[torch.cuda.Stream] = []  # posts' copies side by side (``post``)
        self._remote: dict[tuple, torch.Tensor] = {}

    def carve(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Contiguous tensors of ``specs`` at ``ALIGN``-aligned offsets, in order (the same on every rank)."""
        out, at = [], 0
        for shape, dtype in specs:
            n = _nbytes(shape, dtype)
            out.append(self.buf[at:at + n].view(dtype).view(shape))
            at += -(-n // ALIGN) * ALIGN
        return out

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in this lane's buffer (so its peers' copies of it can be written)."""
        base = self.buf.data_ptr()
        return t.device == self.device and base <= t.data_ptr() < base + self.nbytes

    def remote(self, t: torch.Tensor, peer: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """Group rank ``peer``'s copy of ``t`` (a tensor this lane holds), as ``like``'s shape and dtype (default
        ``t``'s) from ``t``'s first byte."""
        offset = t.data_ptr() - self.buf.data_ptr()
        like = t if like is None else like
        if like.numel() * like.element_size() > t.numel() * t.element_size():
            raise AssertionError(f"{tuple(like.shape)} {like.dtype} does not fit a lane buffer of "
                                 f"{t.numel() * t.element_size()} bytes")
        key = (peer, offset, tuple(like.shape), like.dtype)
        if key not in self._remote:
            if offset % like.element_size():
                raise AssertionError(f"a lane's buffer at byte {offset} is not aligned for {like.dtype}")
            self._remote[key] = self.handle.get_buffer(peer, tuple(like.shape), like.dtype,
                                                       offset // like.element_size())
        return self._remote[key]

    def post(self, pushes: list[tuple[torch.Tensor, torch.Tensor]], side_by_side: bool = False) -> _Pushed:
        """Run ``pushes`` (source, destination; one of the two a peer's buffer) between two barriers of the group,
        after the current stream's work so far (Note [Copy-engine ring]); the handle whose ``wait()`` orders the
        current stream after them. ``side_by_side``: each copy on a stream of its own, so copies over different
        peers' links overlap (an all-to-all's pulls) rather than queue on the lane's stream."""
        here = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(here)
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.handle.barrier(channel=0)
            if side_by_side and len(pushes) > 1:
                while len(self._sides) < len(pushes) - 1:
                    self._sides.append(torch.cuda.Stream(self.device))
                for side, (src, dst) in zip(self._sides, pushes[1:]):
                    side.wait_stream(self.stream)
                    with torch.cuda.stream(side):
                        dst.copy_(src)
                pushes[0][1].copy_(pushes[0][0])
                for side in self._sides[:len(pushes) - 1]:
                    self.stream.wait_stream(side)
            else:
                for src, dst in pushes:
                    dst.copy_(src)
            self.handle.barrier(channel=0)
            done.record(self.stream)
        return _Pushed(done)


class _Pushed:
    """Posted pushes: ``wait()`` makes the current stream wait for them (the host never blocks)."""

    def __init__(self, done: torch.cuda.Event):
        self._done = done

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self._done)
        return True


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def region_view(region: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of a byte ``region`` (a lane buffer of dtype uint8) as a contiguous ``shape`` of ``dtype``."""
    return region[:_nbytes(shape, dtype)].view(dtype).view(shape)


def span(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The bytes a lane needs to hold ``specs`` (each at an ``ALIGN``-aligned offset: ``Lane.carve``)."""
    return sum(-(-_nbytes(s, d) // ALIGN) * ALIGN for s, d in specs)


def lane(group: dist.ProcessGroup | None, device: torch.device,
         specs: list[tuple[tuple[int, ...], torch.dtype]], tag: str) -> Lane:
    """The lane of ``group`` on ``device`` for the use ``tag`` names, large enough for ``specs``: the group's current
    one, or - when it is too small, or there is none - a new one of their size (a collective; it replaces the
    smaller one, which the plans that carved it keep alive). Plans of every shape share one lane per use (Note
    [Lanes are shared]); buffers of two uses never share a lane, so they never overlap.

    Note [Lanes are shared]
        Every call's first push waits at a barrier for all ranks' work issued before it, so one call's buffers may
        overlap another call's: only buffers of one call must not. Keeping one lane per use, grown to the largest
        call seen, bounds the symmetric memory that calls of changing lengths hold (a lane per shape never freed
        would grow with every new length) to about the largest call's buffers per lane kept alive by a plan.
        Every rank makes the same calls in the same order, so every rank grows its lane at the same call.

        Lanes belong to the group object, not its name: a default group destroyed and made again keeps its name
        ("0") but not its peers' mappings, so it gets lanes of its own; a dead group's lanes are dropped when the
        next lane is made (never inside a captured call)."""
    nbytes = span(specs)
    key = (Same(group if group is not None else dist.group.WORLD), device, tag)
    have = _LANES.get(key)
    if have is None or have.nbytes < nbytes:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"transport='copy_engine' makes its buffers on a plan's first call, which must not be "
                               f"captured: run the call once before capturing it{rank_suffix()}")
        for dead in [k for k in _LANES if k[0].dead()]:
            del _LANES[dead]
        _LANES[key] = Lane(group, device, nbytes)
    return _LANES[key]



COPY_A2A_BYTES = 1 << 30
"""The most bytes of send buffers a copy-engine all-to-all keeps in its lane (``Pulls``: a call's sends, held for the
process); a call's sends past it travel on NCCL."""


class Pulls:
    """One planned call's all-to-alls over a group on copy engines, by pulls.

    Note [Copy-engine all-to-all]
        Ulysses' all-to-alls (``transport="copy_engine"``) move as pulls, not pushes: each send buffer is a region
        of a lane (``empty``), at the same offset on every rank, and each rank copies the slot every peer holds for
        it out of that peer's send buffer into a receive buffer of its own, between the lane's two barriers
        (``post``; the first: every rank has written its send buffer, the second: every peer has read it). A
        receive buffer is then ordinary memory, which the head-sharded q, k and v that the backward keeps may view
        (``seqpar.comm.all_to_all.post_packed_qkv``), and the send buffers are the packs the all-to-all makes
        anyway: nothing is copied twice.

        A call's sends take consecutive regions (``empty``), so the head groups in flight at once never share one;
        a region is written again only by a later pack on the writer's stream, after it waited for the post that
        read it (every ``Pending`` is waited inside its call), and the next post's barrier orders every peer's
        reads before that. The first call of a plan learns how many bytes its sends take and runs on NCCL; the
        lane (``tag="a2a"``, shared as Note [Lanes are shared] says) is made or grown when it ends, bounded by
        ``COPY_A2A_BYTES`` - sends past it travel on NCCL, the same on every rank (every rank makes the same
        sends). CUDA graphs capture and replay the later calls (Note [Copy-engine ring]).

        The pulls of one post run side by side, a stream per peer (rank r from r + 1 first), which gained up to
        0.04 over one stream; still, on four H100s (NV18) Ulysses ran 0.03-0.11 slower this way than on NCCL at 2-4K
        tokens per GPU - NCCL's all-to-all drives every link of the switch at once from SMs - so no cost model
        covers it (``Method.modelled_transports``) and auto never picks it
        (``benchmarks/results/2026-11-27-4xh100-copy-engine-a2a/``).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.group: dist.ProcessGroup | None = None
        self.lane: Lane | None = None
        self.at = 0
        self._sends: list[tuple[int, tuple[int, ...], torch.dtype]] = []   # the first call's, to map ahead

    def _map(self) -> None:
        """Look up every peer's copy of every send slot this rank pulls (``Lane.remote`` keeps them), so the calls a
        CUDA graph captures find them made - as the ring's first call makes its pushes' (Note [Copy-engine ring])."""
        me = dist.get_rank(self.group)
        for start, shape, dtype in self._sends:
            if start + _nbytes(shape, dtype) <= self.lane.nbytes:
                send = self.lane.buf[start:start + _nbytes(shape, dtype)].view(dtype).view(shape)
                for u in range(shape[0]):
                    if u != me:
                        self.lane.remote(send[me], u)

    @contextmanager
    def call(self, group: dist.ProcessGroup | None) -> Iterator[Pulls]:
        """One forward or backward over ``group``: its sends from the lane's first byte; when it ends, the lane made
        or grown to what its sends took (a collective, outside any capture: the plan's first call)."""
        self.group, self.at = group, 0
        yield self
        need = min(self.at, COPY_A2A_BYTES)
        if need and (self.lane is None or self.lane.nbytes < need):
            self.lane = lane(group, self.device, [((need,), torch.uint8)], "a2a")
            self._map()
        self._sends = []

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A send buffer: the lane's next region, or - past the lane (the plan's first call, or past
        ``COPY_A2A_BYTES``) - ordinary memory, which ``post`` sends on NCCL."""
        n, start = _nbytes(shape, dtype), self.at
        self.at += -(-n // ALIGN) * ALIGN
        if self.lane is not None and self.at <= self.lane.nbytes:
            return self.lane.buf[start:start + n].view(dtype).view(shape)
        self._sends.append((start, shape, dtype))
        return torch.empty(shape, dtype=dtype, device=self.device)

    def post(self, send: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """All-to-all of ``send`` ``(U, ...)`` (slot u for group rank u): ``(handle, receive buffer)``, slot u' of the
        receive buffer holding what rank u' sent this rank."""
        recv = torch.empty_like(send)
        if self.lane is None or not self.lane.holds(send):
            return dist.all_to_all_single(recv, send, group=self.group, async_op=True), recv
        me, n = dist.get_rank(self.group), send.shape[0]
        peers = [(me + i) % n for i in range(1, n)]   # rank r first pulls from r + 1: no peer's link serves all first
        pulls = [(self.lane.remote(send[me], u), recv[u]) for u in peers] + [(send[me], recv[me])]
        return self.lane.post(pulls, side_by_side=True), recv
