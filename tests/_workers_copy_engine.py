"""Workers for tests/test_copy_engine.py (importable by the pool's processes)."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from seqpar.comm.ring import Exchange
from seqpar.testing.cases import Case, run_case


class _StubLane:
    """Stands in for a ``seqpar.comm.symmetric.Lane`` on CPU: copies at once, counts the waits on its posts."""

    def __init__(self) -> None:
        self.posted = self.waited = 0

    def post(self, pushes):
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


def run_calls(short: bool, case: Case, calls: int) -> list[dict]:
    """``calls`` calls of ``case`` on one planned call (a plan's first call runs eagerly, with ``graphs=True`` its
    second is captured and its third replays), the pass-KV backward's partials home forced on (``short``) or off
    (Note [Partials home] in ``seqpar.methods._passkv``); planned calls are dropped first."""
    from seqpar.runtime import call as _call

    _call.cache_clear()
    with mock.patch("seqpar.methods._passkv.HOME_BYTES", 1 << 62 if short else 0):
        return [run_case(case) for _ in range(calls)]
