"""Shared fixtures: process pools reused per world size by every module of the session.

Pools fork their workers from one preloaded server (``start_method="forkserver"``): a spawned worker pays
torch's import, seconds of CPU each on 2 cores, and the suite starts pools of 1 to 16 ranks many times.
Idle pools hold memory, not CPU; at most ``MAX_IDLE_RANKS`` ranks stay up (least recently used closed).
"""

from __future__ import annotations

import os
import re

import pytest

from seqpar.pool import PRELOAD
from seqpar.testing import ProcessPool

os.environ.setdefault("OMP_NUM_THREADS", "1")

MAX_IDLE_RANKS = 24
# what test workers import besides the harness's default (an ImportError here is skipped by the server)
TEST_PRELOAD = (*PRELOAD, "seqpar.methods", "transformers", "seqpar.integrations.huggingface")


def new_pool(world: int, **kwargs) -> ProcessPool:
    """A pool as the tests start them: forked from the preloaded server."""
    return ProcessPool(world, start_method="forkserver", preload=TEST_PRELOAD, **kwargs)


FUZZ_EXAMPLES = 40


def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=FUZZ_EXAMPLES, metavar="N",
                     help=f"examples per world size of the default (derandomized) fuzz tests in tests/test_fuzz.py "
                          f"(default {FUZZ_EXAMPLES}; the linear ones draw 3/5 of it). The long random run is "
                          f"'-m slow' with SEQPAR_FUZZ_EXAMPLES.")


@pytest.fixture(scope="session")
def fuzz_examples(request) -> int:
    """``--fuzz-examples``: how deep the default fuzz tests go."""
    n = request.config.getoption("--fuzz-examples")
    if n < 1:
        raise pytest.UsageError(f"--fuzz-examples must be >= 1, got {n}")
    return n


class _Pools:
    def __init__(self, max_ranks: int = MAX_IDLE_RANKS):
        self.max_ranks = max_ranks
        self.pools: dict[int, ProcessPool] = {}

    def __call__(self, world: int) -> ProcessPool:
        if world not in self.pools:
            while self.pools and sum(self.pools) + world > self.max_ranks:
                oldest = next(iter(self.pools))
                self.pools.pop(oldest).close()
            self.pools[world] = new_pool(world, timeout=900, pg_timeout=300)
        else:                                    # most recently used last
            self.pools[world] = self.pools.pop(world)
        return self.pools[world]

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools.clear()


@pytest.fixture(scope="session")
def pools():
    """``pools(W)`` -> a live ProcessPool of W gloo ranks."""
    p = _Pools()
    yield p
    p.close()


def run_cases(pool: ProcessPool, cases) -> list:
    """Run each case on the pool and judge it; returns the reports (callers assert)."""
    from seqpar.testing import check_case, run_case

    return [check_case(c, pool.run(run_case, c)) for c in cases]


def run_cases_batched(pool: ProcessPool, cases, timeout: float = 900) -> list:
    """Every case in ONE pool call (a worker runs them in turn), each judged; returns the reports."""
    from seqpar.testing import check_case
    from seqpar.testing.cases import run_cases as run_in_worker

    per_rank = pool.run(run_in_worker, cases, timeout=timeout)
    return [check_case(c, [r[i] for r in per_rank]) for i, c in enumerate(cases)]


@pytest.fixture(scope="module")
def nccl_group():
    """A NCCL process group of this process alone (file rendezvous): seqpar.attention at W = 1 on the GPU."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    fd, path = tempfile.mkstemp(prefix="seqpar_gpu_")
    os.close(fd)
    os.unlink(path)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def assert_all_ok(reports) -> None:
    bad = [str(r) for r in reports if not r.ok]
    assert not bad, f"{len(bad)} of {len(reports)} cases failed:\n" + "\n".join(bad)


def strip_rank(msg: str) -> str:
    """An error message without its " (rank r of W)" suffix, to compare what every rank raised."""
    return re.sub(r" \(rank \d+ of \d+\)", "", msg)


def assert_same_error_on_every_rank(results: list, etype: str, fragments) -> None:
    """Every rank raised ``etype`` with each fragment, named its own rank, and the messages agree otherwise.

    ``results[r]`` is rank r's ``(type name, message)`` (``_workers_ulysses.call_error``), None if it accepted.
    """
    world = len(results)
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} accepted the call"
        name, msg = res
        assert name == etype, f"rank {r}: {name}: {msg}"
        assert f"(rank {r} of {world})" in msg, msg
        for frag in fragments:
            assert frag in msg, f"{frag!r} not in {msg!r}"
    assert len({strip_rank(m) for _, m in results}) == 1, results

