"""``benchmarks/gpu/probe_train_memory.py``'s trace replay on a synthetic allocator trace (the GPU run itself is
in ``benchmarks/results/2026-11-26-h100-train-memory/``): the peak of live bytes, the event it is reached at, the
blocks live then, and the grouping by the innermost frame of our code."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _probe():
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import probe_train_memory
    finally:
        sys.path.pop(0)
    return probe_train_memory


def _ev(action, addr, size, where=None):
    frames = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}]
    if where:
        frames.append({"filename": f"/x/site-packages/transformers/{where}", "line": 7, "name": "forward"})
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_peak_is_replayed_from_allocs_and_free_requests():
    probe = _probe()
    trace = [_ev("segment_map", 0, 1 << 30), _ev("alloc", 1, 100, "a.py"), _ev("alloc", 2, 50, "b.py"),
             _ev("free_requested", 1, 100), _ev("alloc", 3, 120, "a.py"),          # peak 170 here (event 4)
             _ev("free_completed", 1, 100), _ev("free_requested", 3, 120), _ev("alloc", 4, 10, "c.py")]
    peak, at, live = probe.peak_blocks(trace)
    assert (peak, at) == (170, 4)
    assert sorted(live) == [2, 3] and sum(size for size, _ in live.values()) == 170
    assert probe._site(live[3][1]) == "transformers/a.py:7 forward"
    assert probe._site(_ev("alloc", 5, 1)["frames"]) == "(torch internals)"
