"""The static (graph-capturable) decode step refuses the step past its buffer before writing anything.

Note [Static decode step] in ``seqpar.inference.decode``: the bound is counted on the host (eager ``begin()``
calls and ``replay(graph)`` calls), so the step that would write past a rank's rows raises before its first
``index_copy_`` - on a GPU an out-of-range write would poison the CUDA context - with no device read per step.
"""

from __future__ import annotations

import pytest
from _workers_inference import static_overrun


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("replay", [False, True], ids=["eager", "replay"])
def test_static_decode_refuses_the_step_past_its_buffer(pools, world, replay):
    """max_len 8, no spare rows, a 4-token prompt: the bound is 4 steps at W = 1 and 2; the 5th raises an error
    naming the bound on every rank, the k/v buffers (scratch row included), the slot positions, the fill
    counters and the position are unchanged, and close() records the 4 steps taken."""
    results = pools(world).run(static_overrun, {"max_len": 8, "prompt": 4, "replay": replay})
    for r, res in enumerate(results):
        assert isinstance(res, dict), f"rank {r} raised: {res}"
        assert res["limit"] == 4 and res["left"] == 0, res
        assert res["error"] is not None, f"rank {r}: the step past the bound ran"
        for fragment in ("may take 4 steps", "max_len=8", "got step 5", "refused before writing",
                         "give a larger max_len", f"(rank {r} of {world})"):
            assert fragment in res["error"], (fragment, res["error"])
        assert res["untouched"], f"rank {r}: the refused step wrote into the cache"
        assert res["closed"] == 4 and res["length"] == 8, res
        assert res["replays"] == (4 if replay else 0), res
