"""The multi-process harness reports failures on every rank and never hangs."""

import os
import time

import pytest
from conftest import new_pool

from seqpar.testing import ProcessPool, WorkerError
from seqpar.testing.probes import hang_on, raise_on, rank_sum


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_results_come_back_by_rank_and_workers_are_reused(start_method):
    with ProcessPool(3, start_method=start_method) as pool:
        assert pool.run(rank_sum) == [3.0, 3.0, 3.0]
        first = pool.run(os.getpid)
        assert pool.run(rank_sum) == [3.0, 3.0, 3.0]
        assert pool.run(os.getpid) == first and len(set(first)) == 3


def test_forkserver_workers_see_the_callers_path(tmp_path, monkeypatch):
    """A module on a path added after the fork server started still resolves in its workers."""
    with ProcessPool(2, start_method="forkserver") as pool:
        pool.run(rank_sum)                                 # the server is up
        (tmp_path / "late_module_for_harness.py").write_text("def f():\n    return 7\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        from late_module_for_harness import f
        with ProcessPool(2, start_method="forkserver") as late:
            assert late.run(f) == [7, 7]


def test_start_method_is_checked():
    with pytest.raises(ValueError, match="start_method must be one of"):
        ProcessPool(2, start_method="fork")


def test_one_rank_raising_kills_all_and_reports_it_quickly():
    pool = new_pool(3, timeout=120)
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
    pool = new_pool(2, timeout=120)
    with pytest.raises(WorkerError, match=r"timed out[\s\S]*rank 0: no result"):
        pool.run(hang_on, 0, 60.0, timeout=3)
    pool.close()


def _fails_on_last_rank(rank_to_fail: int) -> str:
    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail:
        raise ValueError("boom on the last rank")
    return "ok"


def test_a_failure_reported_last_raises_not_returns():
    """A rank whose failure is the last result to arrive makes ``run`` raise (it returned the traceback text as
    that rank's result, so a test reading rank 0 alone could pass)."""
    from seqpar.testing import ProcessPool, WorkerError

    with ProcessPool(1) as pool, pytest.raises(WorkerError, match="boom on the last rank"):
        pool.run(_fails_on_last_rank, 0)
