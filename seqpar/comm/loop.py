"""The one schedule runtime every multi-step engine runs on: post, compute, wait - gradients one step behind.

    run_steps(n, compute=..., post=..., accumulate=..., post_after=..., land=...)

Step s of a schedule, on every rank::

    handles = post(s)              # transfers this step needs later (next KV block, returns) - posted first
    compute(s)                     # kernels; overlaps every transfer in flight
    wait(carried); accumulate(s)   # what post_after(s - 1) sent arrived (the running dK/dV): add step s to it
    carried = post_after(s)        # what this step produced and sends on (gradients travel one step behind)
    wait(handles); land(s)         # swap double buffers, merge what arrived

and after the last step ``wait(carried)``. A handle is anything with ``wait()`` (``comm.ring.Exchange``
- committed here - or a posted collective). Which process group each transfer uses is the engine's choice
(double ring's inner and outer rings are separate groups, so an inter-node hop never queues in front of an
intra-node one on NCCL).

Note [Faults in a schedule]
    An exception raised while a schedule runs (a kernel that cannot serve a block, an out-of-memory) first
    completes every transfer this rank has posted and not yet awaited, then propagates; a failed transfer
    (a peer that aborted or timed out) propagates at once - the group is broken, waiting on it is moot.
    When every rank fails the same way the group is left clean for the next call (a dropped in-flight
    transfer breaks a gloo pair: the next collective hangs). When one rank fails alone, its
    neighbours posted the matching transfers of the same step, so the completion is short; they stop at
    their next wait, bounded by the process-group timeout (docs/RELIABILITY.md). Every engine runs through
    ``run_steps`` or holds its transfers in a ``Loop``, so this holds for every method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from .ring import Exchange

__all__ = ["Double", "Loop", "run_steps"]


class Waitable(Protocol):
    def wait(self) -> Any: ...


class Loop:
    """The transfers one schedule has in flight; ``with Loop() as loop`` completes them on an exception."""

    def __init__(self) -> None:
        self._live: list[Waitable] = []
        self._broken = False

    def post(self, handles: Iterable[Waitable | None] | Waitable | None) -> list[Waitable]:
        """Commit (exchanges) and track ``handles``; returns them for a later ``wait``."""
        if handles is None:
            return []
        items = [handles] if hasattr(handles, "wait") else [h for h in handles if h is not None]
        for h in items:
            if isinstance(h, Exchange) and not h.committed:
                h.commit()
            self._live.append(h)
        return items

    def wait(self, handles: Iterable[Waitable]) -> None:
        for h in handles:
            try:
                h.wait()
            except BaseException:
                self._broken = True           # a failed transfer: the group is broken, completing others is moot
                raise
            with contextlib.suppress(ValueError):
                self._live.remove(h)

    def __enter__(self) -> Loop:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and not self._broken:     # Note [Faults in a schedule]
            for h in self._live:
                with contextlib.suppress(Exception):
                    h.wait()
        self._live.clear()
        return False


Step = Callable[[int], Any]


def run_steps(n: int, *, compute: Step, post: Step | None = None, accumulate: Step | None = None,
              post_after: Step | None = None, land: Step | None = None, loop: Loop | None = None) -> None:
    """Run ``n`` steps of a schedule (module docstring). Each hook takes the step index; ``post`` and
    ``post_after`` return handles (or None / a list). ``loop``: run inside an enclosing schedule's Loop."""
    with contextlib.ExitStack() as stack:
        lp = loop if loop is not None else stack.enter_context(Loop())
        carried: list[Waitable] = []
        for s in range(n):
            pre = lp.post(post(s)) if post is not None else []
            compute(s)
            lp.wait(carried)
            if accumulate is not None:
                accumulate(s)
            carried = lp.post(post_after(s)) if post_after is not None else []
            lp.wait(pre)
            if land is not None:
                land(s)
        lp.wait(carried)


class Double:
    """A double buffer: ``cur`` is computed on while ``nxt`` receives; ``swap()`` after the wait.

    ``borrowed``: ``first`` is the caller's tensor, sent as it lies and never received into - the first swap gives
    ``nxt`` a buffer of its own (``third``, else a new one; a travelling tensor needs no copy to start: Note [K and V
    apart] in ``seqpar.methods.allgather``).
    """

    def __init__(self, first: torch.Tensor, spare: torch.Tensor | None = None, *, borrowed: bool = False,
                 third: torch.Tensor | None = None):
        self.cur = first
        self.nxt = torch.empty_like(first) if spare is None else spare
        self.borrowed = borrowed
        self._third = third

    @staticmethod
    def starting(first: torch.Tensor, spares: list[torch.Tensor] | None = None) -> Double:
        """A double buffer whose first send is ``first`` itself when it is contiguous (borrowed: never received
        into), else a contiguous copy of its own. ``spares``: the two buffers it receives into (a copy-engine
        ring's, Note [Copy-engine ring] in ``seqpar.comm.symmetric``); then ``first`` is only ever sent."""
        own = first.contiguous()
        if spares is not None:
            return Double(own, spares[0], borrowed=True, third=spares[1])
        return Double(own, borrowed=own is first)

    def swap(self) -> None:
        if self.borrowed:
            nxt = self._third if self._third is not None else torch.empty_like(self.nxt)
            self.cur, self.nxt, self.borrowed, self._third = self.nxt, nxt, False, None
        else:
            self.cur, self.nxt = self.nxt, self.cur
