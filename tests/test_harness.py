"""The multi-process harness reports failures on every rank and never hangs."""

import time

import pytest

from seqpar.testing import ProcessPool, WorkerError
from seqpar.testing.probes import hang_on, raise_on, rank_sum


def test_results_come_back_by_rank_and_workers_are_reused():
    with ProcessPool(3) as pool:
        assert pool.run(rank_sum) == [3.0, 3.0, 3.0]
        assert pool.run(rank_sum) == [3.0, 3.0, 3.0]


def test_one_rank_raising_kills_all_and_reports_it_quickly():
    pool = ProcessPool(3, timeout=120)
    t = time.monotonic()
    with pytest.raises(WorkerError) as e:
        pool.run(raise_on, 1)
    msg = str(e.value)
    assert "rank 1: raised" in msg and "injected failure on rank 1" in msg
    assert "rank 0:" in msg and "rank 2:" in msg
    assert time.monotonic() - t < 60
    assert pool.run(rank_sum) == [3.0, 3.0, 3.0]          # a fresh pool after the failure
    pool.close()


def test_a_hang_is_killed_at_the_timeout():
    pool = ProcessPool(2, timeout=120)
    with pytest.raises(WorkerError, match=r"timed out[\s\S]*rank 0: no result"):
        pool.run(hang_on, 0, 60.0, timeout=3)
    pool.close()
