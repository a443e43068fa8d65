"""Workers for tests/test_copy_engine.py (importable by the pool's processes)."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from seqpar.comm.ring import Exchange
from seqpar.comm.symmetric import Lane


class _StubLane:
    """Stands in for a ``seqpar.comm.symmetric.Lane`` on CPU: copies at once, counts the waits on its posts."""

    def __init__(self) -> None:
        self.posted = self.waited = 0

    def post(self, pushes, side_by_side=False):
        self.posted += 1
        for src, dst in pushes:
            dst.copy_(src)
        lane = self

        class Handle:
            def wait(self) -> None:
                lane.waited += 1
        return Handle()


def mixed_exchange() -> dict:
    """One exchange with a push and an NCCL-style send/recv pair (as the pass-KV backward posts K/V hops beside
    dK/dV partials): ``wait()`` must wait for both."""
    rank = dist.get_rank()
    lane, landed, got = _StubLane(), torch.zeros(3), torch.zeros(2)
    ex = Exchange(None).push(torch.full((3,), 7.0), landed, lane)
    ex.send(torch.full((2,), float(rank)), 1 - rank).recv(got, 1 - rank)
    ex.commit().wait()
    return {"posted": lane.posted, "waited": lane.waited, "got": got.tolist(), "landed": landed.tolist()}


class _FakeSymm:
    """Stands in for torch's symmetric memory module: the allocation fails on ``bad_rank``; no rendezvous allowed."""

    def __init__(self, bad_rank: int):
        self.bad_rank = bad_rank

    def is_symm_mem_enabled_for_group(self, name: str) -> bool:
        return True

    def empty(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if dist.get_rank() == self.bad_rank:
            raise RuntimeError("CUDA driver error: operation not permitted (no IPC in this container)")
        return torch.empty(n, dtype=dtype, device=device)

    def rendezvous(self, *args) -> None:
        raise AssertionError("the rendezvous ran although a rank's allocation failed")


def lane_error(case: str) -> tuple[str, str]:
    """Make a lane on CPU with torch's symmetric memory stood in for: ``case`` "alloc" (rank 1's allocation fails)
    or "hosts" (each rank on a host of its own). The error this rank raised: ``(type name, message)``."""
    from seqpar.comm import symmetric

    host = f"host{dist.get_rank()}" if case == "hosts" else "one-host"
    with mock.patch.object(symmetric, "_symm", lambda: _FakeSymm(1 if case == "alloc" else -1)), \
            mock.patch.object(symmetric.socket, "gethostname", lambda: host):
        try:
            symmetric.Lane(None, torch.device("cpu"), 1024)
        except Exception as e:
            return type(e).__name__, str(e)
    return "", ""


class _CountingLane:
    """Stands in for a ``Lane`` of one use on CPU: carves a plain buffer, counts its posts and moves nothing (a
    peer's copy of a buffer is this rank's own), so only the schedule of posts is observed, not values."""

    def __init__(self, nbytes: int):
        self.buf, self.nbytes, self.posts, self.pulled = torch.zeros(nbytes, dtype=torch.uint8), nbytes, 0, 0

    carve = Lane.carve

    def holds(self, t: torch.Tensor) -> bool:
        base = self.buf.data_ptr()
        return base <= t.data_ptr() < base + self.nbytes

    def remote(self, t: torch.Tensor, peer: int, like: torch.Tensor | None = None) -> torch.Tensor:
        like = t if like is None else like
        return t.view(-1).view(torch.uint8)[:like.nbytes].view(like.dtype).view(like.shape)

    def post(self, pushes, side_by_side=False):
        self.posts += 1
        return _StubLane().post([])


def lane_posts(cu: list[int]) -> dict[str, int]:
    """A ring's forward+backward over documents ``cu`` (W ranks, zigzag, causal) with ``transport="copy_engine"``
    and its lanes stood in for (``_CountingLane``): how often each use's lane was posted on this rank. A lane's
    barriers pair up across ranks, so every rank must post each lane equally often."""
    import seqpar
    from seqpar.comm import symmetric

    lanes: dict[str, _CountingLane] = {}

    def lane(group, device, specs, tag):
        lanes[tag] = lanes.get(tag) or _CountingLane(max(symmetric.span(specs), 1 << 16))
        return lanes[tag]

    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, cu[-1], 2, 8, generator=g) for _ in range(4)]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    q, k, v, do = (seqpar.shard(t, method="ring", layout="zigzag", cu_seqlens=cu_t).requires_grad_() for t in full)
    with mock.patch.object(symmetric, "check", lambda *a: None), mock.patch.object(symmetric, "lane", lane):
        out = seqpar.attention(q, k, v, method="ring", layout="zigzag", cu_seqlens=cu_t, transport="copy_engine",
                               check_ranks=False)
        torch.autograd.grad(out, (q, k, v), do)
    return {tag: lane.posts for tag, lane in lanes.items()}


class _Remote:
    """A peer's copy of a lane buffer, as ``_GlooLane.remote`` names it: (group rank, byte offset, shape, dtype)."""

    def __init__(self, peer: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.peer, self.offset, self.shape, self.dtype = peer, offset, shape, dtype


class _GlooLane(_CountingLane):
    """A ``Lane`` on CPU over gloo, for the copy-engine ring's schedule end to end: a plain buffer per rank, and each
    post one ``all_gather_object`` of every rank's pushes, whose receiver writes them into its buffer - where a real
    lane's barriers would pair posts up, this pairs them too, and checks that every rank is at the same post of the
    same lane (a rank that skipped one makes every rank raise, where GPUs would wait forever)."""

    made = 0
    live: list[_GlooLane] = []

    def __init__(self, group, device: torch.device, nbytes: int):
        super().__init__(nbytes)
        self.group, self.device = group if group is not None else dist.group.WORLD, device   # bound, as a Lane is
        self.buf.fill_(255)                                         # NaN bytes: a read of unwritten bytes shows
        _GlooLane.made += 1
        self.name = f"lane{_GlooLane.made}"
        _GlooLane.live.append(self)

    def remote(self, t: torch.Tensor, peer: int, like: torch.Tensor | None = None) -> _Remote:
        like = t if like is None else like
        assert like.nbytes <= t.nbytes, (tuple(like.shape), like.dtype, t.nbytes)
        return _Remote(peer, t.data_ptr() - self.buf.data_ptr(), tuple(like.shape), like.dtype)

    def post(self, pushes, side_by_side=False):
        """Pushes (a local source into a peer's buffer) and pulls (a peer's buffer into a local tensor) alike: every
        rank's buffer as it stood at the post, and its pushes, gathered; then each rank applies its own."""
        self.posts += 1
        mine, pulls = [], []
        for src, dst in pushes:
            assert (tuple(src.shape), src.dtype) == (tuple(dst.shape), dst.dtype), (src.shape, src.dtype, dst.shape)
            if isinstance(src, _Remote):
                pulls.append((src, dst))
            elif not isinstance(dst, _Remote):            # a rank's own slot
                dst.copy_(src)
            else:
                mine.append((dst.peer, dst.offset, src.contiguous().view(-1).view(torch.uint8).clone()))
        self.pulled += len(pulls)
        got: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(got, (self.name, self.posts, mine, self.buf.clone()), group=self.group)
        if len({(name, n) for name, n, _, _ in got}) != 1:
            raise AssertionError(f"ranks at different lane posts: {[(name, n) for name, n, _, _ in got]}")
        for src, dst in pulls:
            n = dst.numel() * dst.element_size()
            dst.copy_(got[src.peer][3][src.offset:src.offset + n].view(src.dtype).view(src.shape))
        me = dist.get_rank(self.group)
        for _, _, items, _ in got:
            for peer, offset, data in items:
                if peer == me:
                    self.buf[offset:offset + data.numel()].copy_(data)
        return _StubLane().post([])


def gloo_lane_calls(short: bool, case, calls: int) -> list[dict]:
    """``run_calls`` of ``case`` with its copy-engine lanes on gloo (``_GlooLane``; fresh lanes for the call), each
    result with ``lane_posts``: how many posts its lanes took (none would mean the hops went over gloo P2P), and
    ``lane_pulls``: how many of their copies were pulls (all-to-all slots)."""
    from _workers_ulysses import run_calls

    from seqpar.comm import symmetric

    _GlooLane.live.clear()
    with mock.patch.object(symmetric, "check", lambda *a: None), mock.patch.object(symmetric, "Lane", _GlooLane), \
            mock.patch.object(symmetric, "_LANES", {}):
        results = run_calls(short, case, calls)
    return [{**r, "lane_posts": sum(lane.posts for lane in _GlooLane.live),
             "lane_pulls": sum(lane.pulled for lane in _GlooLane.live)} for r in results]


def across_a_new_default_group(path: str) -> list[list[torch.Tensor]]:
    """The same two calls - the ring on gloo, and on copy engines through gloo lanes - before and after this rank's
    default group is destroyed and made again (``file://`` rendezvous under ``path``): the second group's calls must
    plan anew and make lanes of their own, never reuse the destroyed group's rings or lanes. Per round, each call's
    out and dq."""
    import seqpar
    from seqpar.comm import symmetric

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 16 * world, 2, 8, generator=g) for _ in range(4)]
    rounds = []
    with mock.patch.object(symmetric, "check", lambda *a: None), mock.patch.object(symmetric, "Lane", _GlooLane), \
            mock.patch.object(symmetric, "_LANES", {}):
        for i in range(2):
            got = []
            for transport in ("nccl", "copy_engine"):
                q, k, v, do = (seqpar.shard(t, method="ring", layout="zigzag").requires_grad_() for t in full)
                out = seqpar.attention(q, k, v, method="ring", layout="zigzag", transport=transport)
                got += [out.detach(), *torch.autograd.grad(out, (q,), do)]
            rounds.append(got)
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"file://{path}/group{i}", rank=rank, world_size=world)
    return rounds
