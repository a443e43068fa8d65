"""Planned calls from many threads at once (Note [Threads and the plan cache] in ``seqpar.runtime.call``).

Eight threads call ``seqpar.attention`` at W = 1 on distinct signatures - plain ones that churn a plan cache cut
to a few entries, and packed batches - with a tiny GIL switch interval so the threads interleave inside the
cache: every result equals the one-thread result, no thread raises or hangs (a timeout), the caches stay within
their bounds. A mesh's finalizer that runs during a garbage collection inside the locked section must not
deadlock, and the torch.compile key table holds meshes weakly and does not grow with the calls.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import traceback
import tracemalloc
import weakref
from typing import Any

import torch

import seqpar
from seqpar.runtime import call

THREADS = 8
ITERS = 24
TIMEOUT = 120              # seconds for every thread to finish: a deadlock fails instead of stalling the suite


def _inputs(t: int, i: int) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """Thread t's i-th call: its own length and heads; three scales (plain signatures) or a packed batch."""
    g = torch.Generator().manual_seed(1000 * t + i)
    L, H = 6 + 2 * t, 1 + t % 3
    q, k, v = (torch.randn(1, L, H, 8, generator=g, requires_grad=True) for _ in range(3))
    kw: dict[str, Any] = {"causal": t % 2 == 0}
    if i % 4 == 3:
        cut = 1 + i % (L - 1)
        kw["cu_seqlens"] = (0, cut, L)
    else:
        kw["softmax_scale"] = (0.2, 0.3, 0.4)[i % 3]
    return (q, k, v), kw


def _run(t: int, i: int) -> list[torch.Tensor]:
    (q, k, v), kw = _inputs(t, i)
    out = seqpar.attention(q, k, v, **kw)
    out.square().sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def threaded_calls(threads: int, iters: int, timeout: float) -> dict[str, Any]:
    """Every thread's calls at once, against the same calls made one at a time; what went wrong, if anything."""
    expected = {(t, i): _run(t, i) for t in range(threads) for i in range(iters)}
    errors: list[str] = []
    mismatched: list[tuple[int, int]] = []

    def work(t: int) -> None:
        try:
            for i in range(iters):
                got = _run(t, i)
                if not all(torch.equal(a, b) for a, b in zip(got, expected[(t, i)])):
                    mismatched.append((t, i))
        except Exception:   # reported to the test, which fails on it
            errors.append(traceback.format_exc())

    sizes, interval = (call.CACHE_SIZE, call.BATCH_CACHE_SIZE), sys.getswitchinterval()
    call.CACHE_SIZE, call.BATCH_CACHE_SIZE = 4, 2          # every few calls evict: the threads race on it
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join(timeout)
        hung = sum(th.is_alive() for th in pool)
    finally:
        sys.setswitchinterval(interval)
        call.CACHE_SIZE, call.BATCH_CACHE_SIZE = sizes
    return {"errors": errors, "mismatched": mismatched, "hung": hung, "info": call.cache_info()}


def test_planned_calls_from_eight_threads(pools):
    res = pools(1).run(threaded_calls, THREADS, ITERS, TIMEOUT, timeout=TIMEOUT + 300)[0]
    assert res["hung"] == 0, f"{res['hung']} threads still running after {TIMEOUT} s (deadlock)"
    assert not res["errors"], "\n".join(res["errors"])
    assert not res["mismatched"], f"results differ from the one-thread run: {res['mismatched']}"
    info = res["info"]
    assert info["plans"] <= 4 and info["batch_plans"] <= 2, info


GC_IN_LOCK = """
import gc, threading
from seqpar.runtime import call

class Mesh:                              # a weakly referenceable stand-in: only the finalizer matters here
    pass

m = Mesh()
call._tracker(m)                         # registers the mesh's finalizer
m.cycle = m                              # dies only in a garbage collection
del m
done = threading.Event()

def locked_collection():
    with call._LOCK:                     # an allocation inside the locked section runs the collector
        gc.collect()
    done.set()

threading.Thread(target=locked_collection, daemon=True).start()
assert done.wait(20), "the finalizer blocked on the cache lock"
assert call.cache_info()["trackers"] == 0, call.cache_info()
"""


def test_a_finalizer_during_a_locked_section_does_not_deadlock():
    done = subprocess.run([sys.executable, "-c", GC_IN_LOCK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _key(mesh: Any, seq_len: int | None = None) -> str:
    return call.traced_key(mesh, "ring", "zigzag", True, None, "auto", (-1, -1), seq_len, False, torch.float32, 0.0,
                           True, ())


def test_compile_keys_hold_meshes_weakly_and_do_not_grow():
    class Mesh:
        pass

    mesh = Mesh()
    key = _key(mesh)
    ref = weakref.ref(mesh)
    del mesh
    gc.collect()
    assert ref() is None, "the torch.compile key table keeps the mesh alive"
    assert _key(Mesh()) == key              # a dead mesh's tag goes to the next mesh with its description
    assert call._traced_args(key)["seq_len"] is None and call._traced_args(key)["grad_dtype"] is torch.float32
    tracemalloc.start()
    try:
        for n in range(1000):
            _key(None, n + 1)
        before = tracemalloc.get_traced_memory()[0]
        for n in range(1000, 4000):             # a padded batch per step: a new seq_len every call
            _key(None, n + 1)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 500_000, f"3000 more traced keys grew memory by {grown} bytes"     # a table: ~2.5 MB
