"""Workers for tests/test_copy_engine.py (importable by the pool's processes)."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from seqpar.comm.ring import Exchange


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
