"""The pass-KV ring engine shared by ``ring`` and ``usp`` (ALGORITHMS.md §3).

Private: methods never import each other, so what two methods share lives here. Q, O and lse stay on
their rank; K and V travel one hop per step in one packed message ``kv (2, B, L, Hkv, D)``; at step s rank
r holds the KV that started on rank ``(r - s) mod W``. Which part of that block rank r computes is the
block planner's answer (Note [Block planning] in ``seqpar.layouts.blocks``), so every layout, causal or
not, windows, documents and padding run through one loop.

Note [Ring truncation]
    A step at which no rank has work (a sliding window shorter than the ring) ends the ring early for
    everyone: ``n_steps`` is the last step any rank needs, plus one, computed identically on every rank
    from the layout. In backward the dK/dV accumulator of block j then sits on rank ``j + n_steps - 1``
    and goes home in one direct transfer (one hop on NVSwitch).

Note [Faults in the ring]
    An exception raised by this rank's compute (a kernel that cannot serve the block, an out-of-memory)
    first completes the transfers this rank has posted and not yet awaited, then propagates. When every rank
    fails the same way the group is then left clean for the next call (a dropped in-flight transfer breaks a
    gloo pair: the next collective hangs). When one rank fails alone its neighbours posted the matching
    transfers of the same step, so the wait is short; they stop at their next step's wait, bounded by the
    process-group timeout (docs: fault handling).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..comm.ring import Exchange, Ring
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator
from ..layouts.base import Layout
from ..layouts.blocks import Rule, Task, plan

__all__ = ["Schedule", "backward", "forward", "schedule"]


@dataclass(frozen=True)
class Schedule:
    """Per-step tasks of one rank, and the number of ring steps every rank runs."""

    steps: tuple[tuple[Task, ...], ...]
    n_steps: int


@functools.lru_cache(maxsize=256)
def schedule(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
             valid_len: int | None) -> Schedule:
    """Rank ``rank``'s tasks at every step of a pass-KV ring over ``layout`` (Note [Ring truncation])."""
    W = layout.world
    segs = [layout.segments(j, seq_len).cut(doc_bounds, valid_len) for j in range(W)]
    mine = tuple(plan(segs[rank], segs[(rank - s) % W], rule) for s in range(W))
    last = max((s for r in range(W) for s in range(W) if plan(segs[r], segs[(r - s) % W], rule)), default=0)
    return Schedule(mine[: last + 1], last + 1)


@contextlib.contextmanager
def _settled(*posted: Exchange | None) -> Iterator[None]:
    """On an exception, complete the posted exchanges before it propagates (Note [Faults in the ring])."""
    try:
        yield
    except BaseException:
        for ex in posted:
            if ex is not None:
                with contextlib.suppress(Exception):
                    ex.wait()
        raise


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, sched: Schedule,
            runner: TaskRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring forward: ``(out (B, L, H, D) in q.dtype, lse (B, H, L) fp32)``."""
    acc = Accumulator(q)
    if sched.n_steps == 1:                     # one rank, or a window that needs no other rank's keys
        for t in runner.prepare(sched.steps[0], q, k):
            acc.add(t.q, *runner.forward(q, k, v, t))
        return acc.result(q.dtype)
    kv = torch.stack((k, v))
    nxt = torch.empty_like(kv)
    for s in range(sched.n_steps):
        more = s + 1 < sched.n_steps
        if more:
            ex = ring.send_recv(kv, nxt)
            ex.commit()
        with _settled(ex if more else None):
            for t in runner.prepare(sched.steps[s], q, kv[0]):
                acc.add(t.q, *runner.forward(q, kv[0], kv[1], t))
        if more:
            ex.wait()
            kv, nxt = nxt, kv
    return acc.result(q.dtype)


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, ring: Ring, sched: Schedule, runner: TaskRunner, grad_dtype: torch.dtype,
             delta: torch.Tensor | None = None, result_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring backward (ALGORITHMS.md §3.2): dK/dV travel one step behind their KV, accumulated in fp32.

    ``delta`` (B, H, L) replaces ``rowsum(dO * O)`` when the caller has one (gradient through lse).
    ``result_dtype`` is the dtype of the returned gradients (default: the inputs'); USP asks for fp32 when
    it still has to sum replicated KV heads' partials.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = sched.n_steps
    dtypes = (result_dtype or q.dtype, result_dtype or k.dtype, result_dtype or v.dtype)
    if n == 1:
        return _local_backward(do, q, k, v, out, lse, sched.steps[0], runner, delta, dtypes)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack((k, v))
    nxt = torch.empty_like(kv)
    wire = acc if grad_dtype == torch.float32 else grad_dtype
    dkv = torch.zeros(kv.shape, dtype=wire, device=q.device)
    dkv_in = torch.empty_like(dkv)
    dex = None
    for s in range(n):
        more = s + 1 < n
        if more:
            ex = ring.send_recv(kv, nxt)
            ex.commit()
        with _settled(ex if more else None, dex):
            tasks = runner.prepare(sched.steps[s], q, kv[0])
            grads = [runner.backward(do, q, kv[0], kv[1], out, lse, t, delta) for t in tasks]
            for t, (gq, _, _) in zip(tasks, grads):
                dq[:, t.q] += gq
        if dex is not None:                 # computed first, so the dK/dV hop hid behind this step's kernels
            dex.wait()                      # the running dK/dV of the block now held, from rank - 1
            dkv, dkv_in = dkv_in, dkv
        for t, (_, gk, gv) in zip(tasks, grads):
            dkv[0][:, t.k] += gk
            dkv[1][:, t.k] += gv
        del grads
        if more:
            dex = ring.send_recv(dkv, dkv_in)
            dex.commit()
            ex.wait()
            kv, nxt = nxt, kv
    home = ring.send_recv(dkv, dkv_in, hops=1 - n)     # block (r - n + 1)'s total goes to its owner
    home.commit()
    home.wait()
    return dq.to(dtypes[0]), dkv_in[0].to(dtypes[1]), dkv_in[1].to(dtypes[2])


def _local_backward(do, q, k, v, out, lse, tasks, runner, delta, dtypes):
    """Backward of a single-step schedule: no ring."""
    g = runner.backward_all(do, q, k, v, out, lse, tasks, delta)
    return tuple(x.to(d) for x, d in zip(g, dtypes))
