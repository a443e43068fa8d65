"""A small multi-process harness: W spawned workers, reused across calls, killed together on failure.

    with ProcessPool(4) as pool:
        results = pool.run(fn, arg)        # fn(arg) on every rank; a list ordered by rank

Workers join a process group through a ``file://`` rendezvous (no ports), on gloo (CPU) by default, and
stay up between ``run`` calls so many cases share one start-up. ``fn`` must be importable by name (a
module-level function). If any rank raises, or the call outlives ``timeout``, every worker is killed and
``WorkerError`` reports each rank's traceback, exit code, or silence; the next ``run`` starts a fresh pool.

Workers are fresh interpreters (never a fork of the caller). ``start_method="spawn"`` (the default) starts
each one from scratch, so each pays torch's import (seconds of CPU, and a full interpreter shutdown when
it stops). ``start_method="forkserver"`` forks each worker from one server process that imported
``preload`` once (torch and seqpar by default) and never ran a torch op: a pool of 8 starts in a fraction
of the time, which is what a test session that starts many pools wants. Either way a worker gets the
caller's ``sys.path`` as it is when the pool starts (multiprocessing sends it), so ``fn`` resolves the same.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["ProcessPool", "WorkerError"]

PRELOAD = ("torch", "torch.distributed", "seqpar", "seqpar.testing")
START_METHODS = ("spawn", "forkserver")


class WorkerError(RuntimeError):
    """A distributed call failed; the message has every rank's story."""


def _worker(rank: int, world: int, init_file: str, backend: str, threads: int, pg_timeout: float,
            tasks: Any, results: Any) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            call_id, fn, args, kwargs = item
            try:
                results.put((call_id, rank, True, fn(*args, **kwargs)))
            except BaseException:  # report everything, including KeyboardInterrupt in a worker
                results.put((call_id, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class ProcessPool:
    """``world_size`` workers on ``backend`` ("gloo" or "nccl"), started lazily, reused, killed on failure.

    ``start_method`` is "spawn" or "forkserver" (module docstring); ``preload`` names the modules the fork
    server imports once. The fork server is one per process: the preload of the first forkserver pool wins.
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout: float = 300.0, threads: int = 1,
                 pg_timeout: float = 120.0, start_method: str = "spawn", preload: tuple[str, ...] = PRELOAD):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.threads, self.pg_timeout = threads, pg_timeout
        self.start_method, self.preload = start_method, tuple(preload)
        self._procs: list[Any] = []
        self._calls = 0

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(list(self.preload))    # read when the server starts (once)
        fd, init_file = tempfile.mkstemp(prefix="seqpar_rdzv_")
        os.close(fd)
        os.unlink(init_file)       # the file:// store creates it
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, init_file, self.backend, self.threads,
                                         self.pg_timeout, self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; results ordered by rank. Raises ``WorkerError``."""
        if not self._procs:
            self._start()
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs))
        deadline = time.monotonic() + (timeout or self.timeout)
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
            if left <= 0 or dead or any(not ok for ok, _ in got.values()):
                # give the others a moment to report their own failure, then kill everyone
                grace = time.monotonic() + (2.0 if left > 0 else 0.0)
                while len(got) < self.world_size and time.monotonic() < grace:
                    self._collect(call_id, got, 0.2)
                self._fail(fn, got, timed_out=left <= 0)
            self._collect(call_id, got, min(0.5, max(left, 0.01)))
        if any(not ok for ok, _ in got.values()):    # the last rank to report failed: never a traceback as a result
            self._fail(fn, got, timed_out=False)
        return [got[r][1] for r in range(self.world_size)]

    def _collect(self, call_id: int, got: dict, wait: float) -> None:
        try:
            cid, rank, ok, payload = self._results.get(timeout=wait)
        except queue.Empty:
            return
        if cid == call_id:
            got[rank] = (ok, payload)

    def _fail(self, fn: Callable, got: dict, timed_out: bool) -> None:
        self.close(kill=True)
        lines = [f"{getattr(fn, '__qualname__', fn)} failed on {self.world_size} ranks"
                 + (" (timed out)" if timed_out else "") + ":"]
        for r in range(self.world_size):
            if r in got:
                ok, payload = got[r]
                lines.append(f"--- rank {r}: " + ("ok" if ok else "raised\n" + payload.rstrip()))
            else:
                code = self._codes.get(r)
                lines.append(f"--- rank {r}: no result" + (f" (exit code {code})" if code is not None else
                                                            " (killed while waiting)"))
        raise WorkerError("\n".join(lines))

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely unless ``kill``)."""
        self._codes = {r: p.exitcode for r, p in enumerate(self._procs)}
        if not kill:
            for q in getattr(self, "_tasks", []):
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
