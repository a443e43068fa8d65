"""The bench's own steady-state timing, profiled: ``python -m seqpar.bench`` run in this process with each record's
back-to-back bursts (``steady_ms``) followed by probe_steady_gaps.py's profile of three back-to-back calls - the GPU's
idle gaps, its operations, the host's CUDA runtime calls - printed per record. For a record the bench times slower
than the same call alone (Ulysses under spans at 2K tokens per rank over 8: 1.15 ms in the bench, 0.70 alone).

    python3 benchmarks/gpu/probe_bench_steady.py [bench arguments]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_steady_gaps import gaps

import seqpar.bench.__main__ as bench_main

_burst = bench_main.burst_ms


def _profiled(fns, device, **kw):
    res = _burst(fns, device, **kw)
    for name, fn in fns.items():
        g = gaps(fn)
        print(f"steady {res[name]:.3f} ms, profiled:", {k: g[k] for k in ("gpu_op_ms_per_call", "idle_ms_per_call")},
              g["largest_gaps_us"][:3], flush=True)
        for op in g["api_us_per_call"]:
            print("    host CUDA API us/call, count/call:", op, flush=True)
        for op in g["slowest_api_calls"]:
            print("    slowest CUDA API call (us, name, its callers):", op, flush=True)
    return res


if __name__ == "__main__":
    bench_main.burst_ms = _profiled
    sys.exit(bench_main.main(sys.argv[1:]))
