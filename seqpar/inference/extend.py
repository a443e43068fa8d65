"""A sharded chunk attending to the whole cache: pass-KV (the slices travel) or pass-Q (the queries travel).

Both run the plans of ``plans.Pairs`` (the block planner on cache positions, so windows, left padding and any
mix of layouts come for free) through ``_local.attend_block`` and merge partials in fp32 with
``seqpar.kernels.merge``. Transfers are posted before the step's compute and completed after it
(``send_recv -> commit -> wait``, Note [Sequence-major wire buffers] in ``seqpar.methods._shared``: every
message is a contiguous row range), on the runtime's one loop (``seqpar.comm.loop.run_steps``), so an exception
in a step's compute first completes what this rank posted, then propagates (Note [Faults in a schedule]).

Note [Pass-KV over a cache]
    At step s rank r holds the live slice of rank ``(r - s) mod W`` (slices differ in length: round-robin
    decode tokens, eviction, padding; every rank knows every length) and computes its own queries against
    it. Two receive buffers of the longest slice alternate; a rank's own slice is sent straight from its
    cache buffer. The pass ends after the last step at which any rank has work (``Pairs.n_steps``): a window
    shorter than the cache ends it early.

Note [Pass-Q over a cache]
    At step s rank r hosts the queries of owner ``i = (r + s) mod W`` (they move one hop towards r - 1 per
    step, sequence-major) and computes them against its own slice; the partial (out in q's dtype, lse in
    fp32) goes straight back to i at step s + 1, overlapped with the next step's compute, and i merges it
    in fp32. Partials of pairs with no work are neither computed nor sent; every rank agrees on which.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm.loop import Double, Loop, run_steps
from ..comm.ring import Exchange
from ..kernels.merge import Accumulator
from ..layouts.blocks import Task
from ._local import attend_block
from .cache import host_to_device
from .plans import Pairs, RowGroup

__all__ = ["Partials", "Peers", "pass_kv", "pass_q", "run_tasks"]


class Peers:
    """Point-to-point partners by sequence-parallel index: group ranks on a 1D group, global ranks (on the
    default group) for a 2D mesh, whose axes have no single group."""

    def __init__(self, group, ranks: Sequence[int], index: int):
        self.group, self.ranks, self.index, self.world = group, tuple(ranks), index, len(ranks)

    def exchange(self) -> Exchange:
        return Exchange(self.group)

    def peer(self, offset: int) -> int:
        """The partner ``offset`` places after this rank (mod W)."""
        j = (self.index + offset) % self.world
        return j if self.group is not None else self.ranks[j]


class Partials:
    """fp32 accumulators of query rows, one per row group (``seqpar.kernels.merge.Accumulator``).

    ``like`` has the output's shape ``(B, L, H, Dv)`` and q's dtype; only its metadata is used.
    """

    def __init__(self, like_BSHD: torch.Tensor, groups: Sequence[RowGroup]):
        self.groups = tuple(groups)
        self.like = like_BSHD
        _, L, H, Dv = like_BSHD.shape
        self.likes = [like_BSHD if g.rows is None else like_BSHD.new_empty(1).expand(len(g.rows), L, H, Dv)
                      for g in self.groups]
        self.accs = [Accumulator(like) for like in self.likes]

    @staticmethod
    def _rows(x: torch.Tensor, g: RowGroup, dim: int = 0) -> torch.Tensor:
        if g.rows is None:
            return x
        return x.index_select(dim, _row_index(g, x.device))

    def add(self, gi: int, rows: slice, out_BSHD: torch.Tensor, lse_BHS: torch.Tensor) -> None:
        self.accs[gi].add(rows, out_BSHD, lse_BHS)

    def add_copy(self, out_BSHD: torch.Tensor, lse_BHS: torch.Tensor) -> None:
        """Merge a partial of all rows that lives in a buffer about to be reused (never adopted)."""
        for g, acc, like in zip(self.groups, self.accs, self.likes):
            if acc.out is None:                                  # allocate, so the view is copied, not kept
                B, _, H, Dv = like.shape
                acc.add(slice(0, 0), out_BSHD.new_zeros(B, 0, H, Dv),
                        torch.zeros(B, H, 0, dtype=acc.acc_dtype, device=out_BSHD.device))
            acc.add(slice(0, out_BSHD.shape[1]), self._rows(out_BSHD, g), self._rows(lse_BHS, g))

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out (B, L, H, Dv) in dtype, lse (B, H, L))``; rows nothing reached are (0, -inf)."""
        if len(self.groups) == 1:
            return self.accs[0].result(dtype)
        B, L, H, Dv = self.like.shape
        out = torch.empty(B, L, H, Dv, dtype=dtype, device=self.like.device)
        lse = torch.empty(B, H, L, dtype=self.accs[0].acc_dtype, device=self.like.device)
        for g, acc in zip(self.groups, self.accs):
            o, l_ = acc.result(dtype)
            idx = _row_index(g, out.device)
            out.index_copy_(0, idx, o)
            lse.index_copy_(0, idx, l_)
        return out, lse


def _row_index(g: RowGroup, device: torch.device) -> torch.Tensor:
    """The group's batch rows as an int64 index on ``device`` (pinned and non-blocking to a GPU)."""
    assert g.rows is not None
    return host_to_device(torch.tensor(g.rows, dtype=torch.long), device)


def out_like(q: torch.Tensor, value_head_dim: int) -> torch.Tensor:
    """A metadata-only ``(B, L, H, Dv)`` tensor in q's dtype and device (no memory)."""
    B, L, H, _ = q.shape
    return q.new_empty(1).expand(B, L, H, value_head_dim)


def run_tasks(acc: Partials, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              tasks: Sequence[tuple[Task, ...]], scale: float, kernel: str) -> None:
    """Every row group's tasks of queries ``q (B, L, H, D)`` against keys ``k, v (B, n, Hkv, D|Dv)`` into ``acc``."""
    for gi, (g, ts) in enumerate(zip(acc.groups, tasks)):
        if not ts:
            continue
        qg, kg, vg = (Partials._rows(x, g) for x in (q, k, v))
        for t in ts:
            acc.add(gi, t.q, *attend_block(qg[:, t.q], kg[:, t.k], vg[:, t.k], t.mask, scale, kernel))


def pass_kv(q: torch.Tensor, k_SBHD: torch.Tensor, v_SBHD: torch.Tensor, lengths: Sequence[int], pairs: Pairs,
            peers: Peers, acc: Partials, scale: float, kernel: str) -> None:
    """Note [Pass-KV over a cache]: this rank's queries ``q (B, L, H, D)`` against every rank's live slice.

    ``k_SBHD, v_SBHD``: this rank's live slice ``(n, B, Hkv, D|Dv)``; ``lengths[j]``: rank j's live rows.
    """
    me, W, n = peers.index, peers.world, pairs.n_steps
    held = [k_SBHD, v_SBHD]
    longest = max(lengths[(me - s) % W] for s in range(1, n)) if n > 1 else 0
    bufs = [(k_SBHD.new_empty(longest, *k_SBHD.shape[1:]), v_SBHD.new_empty(longest, *v_SBHD.shape[1:]))
            for _ in range(2 if n > 2 else 1)]

    def post(s: int) -> Exchange | None:
        if s + 1 >= n:
            return None
        j, nxt = (me - s) % W, (me - s - 1) % W
        ex = peers.exchange()
        into_k, into_v = bufs[s % len(bufs)]
        if lengths[j]:
            ex.send(held[0], peers.peer(1)).send(held[1], peers.peer(1))
        if lengths[nxt]:
            ex.recv(into_k[:lengths[nxt]], peers.peer(-1)).recv(into_v[:lengths[nxt]], peers.peer(-1))
        return ex

    def compute(s: int) -> None:
        run_tasks(acc, q, held[0].transpose(0, 1), held[1].transpose(0, 1), pairs.tasks[me][(me - s) % W], scale,
                  kernel)

    def land(s: int) -> None:
        if s + 1 < n:
            nxt, (into_k, into_v) = (me - s - 1) % W, bufs[s % len(bufs)]
            held[:] = [into_k[:lengths[nxt]], into_v[:lengths[nxt]]]

    run_steps(n, post=post, compute=compute, land=land)


def pass_q(q: torch.Tensor, k_SBHD: torch.Tensor, v_SBHD: torch.Tensor, pairs: Pairs, peers: Peers,
           acc: Partials, scale: float, kernel: str) -> None:
    """Note [Pass-Q over a cache]: every rank's queries (``q (B, L, H, D)`` here) visit this rank's slice."""
    me, W, n = peers.index, peers.world, pairs.n_steps
    k, v = k_SBHD.transpose(0, 1), v_SBHD.transpose(0, 1)
    L, Dv = q.shape[1], v_SBHD.shape[-1]
    hosted = Double(q.transpose(0, 1).clone(memory_format=torch.contiguous_format))     # (L, B, H, D), a copy
    lse_dt = acc.accs[0].acc_dtype
    cur = hosted.cur
    res = [(cur.new_empty(L, *cur.shape[1:3], Dv), torch.empty(*cur.shape[:3], dtype=lse_dt, device=q.device))
           for _ in range(2)]
    got = (res[0][0].new_empty(res[0][0].shape), torch.empty_like(res[0][1]))
    mine = [False] * (n + 1)          # whether the partial returned at step s is this rank's

    def post_return(ex: Exchange, t: int) -> bool:
        """Step t's partial to its owner, and mine from the rank that computed it; True if mine comes."""
        if pairs.busy((me + t) % W, me):
            ex.send(res[t % 2][0], peers.peer(t)).send(res[t % 2][1], peers.peer(t))
        if pairs.busy(me, (me - t) % W):
            ex.recv(got[0], peers.peer(-t)).recv(got[1], peers.peer(-t))
            return True
        return False

    def merge_got(s: int) -> None:
        if mine[s]:
            acc.add_copy(got[0].transpose(0, 1), got[1].permute(1, 2, 0))

    def post(s: int) -> Exchange:
        """The hop of the hosted queries and the return of step s - 1's partial: one batched exchange."""
        ex = peers.exchange()
        if s + 1 < n:
            ex.send(hosted.cur, peers.peer(-1)).recv(hosted.nxt, peers.peer(1))
        mine[s] = post_return(ex, s - 1) if s >= 2 else False
        return ex

    def compute(s: int) -> None:
        if s == 0:
            run_tasks(acc, q, k, v, pairs.tasks[me][me], scale, kernel)
        elif pairs.busy((me + s) % W, me):
            _guest(hosted.cur, k, v, pairs.tasks[(me + s) % W][me], acc.groups, res[s % 2], scale, kernel)

    def land(s: int) -> None:
        merge_got(s)
        hosted.swap()

    with Loop() as loop:
        run_steps(n, post=post, compute=compute, land=land, loop=loop)
        if n > 1:                       # the last step's partial goes home
            ex = peers.exchange()
            mine[n] = post_return(ex, n - 1)
            loop.wait(loop.post(ex))
            merge_got(n)


def _guest(q_SBHD: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tasks: Sequence[tuple[Task, ...]],
           groups: Sequence[RowGroup], res: tuple[torch.Tensor, torch.Tensor], scale: float, kernel: str) -> None:
    """A visiting owner's partial against this rank's slice, into the wire buffers ``res`` (out, lse)."""
    q = q_SBHD.transpose(0, 1)
    part = Partials(out_like(q, v.shape[-1]), groups)
    run_tasks(part, q, k, v, tasks, scale, kernel)
    out, lse = part.result(q.dtype)
    res[0].copy_(out.transpose(0, 1))
    res[1].copy_(lse.permute(2, 0, 1))
