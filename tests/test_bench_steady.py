"""``--steady`` on a real group: the bench also times calls issued back to back, and the report reads them.

A real run's time is one call from an idle GPU, every rank entering it at once after a barrier; a training step
issues its layers' calls back to back. ``--steady`` records both (``steady_ms``, ``steady_efficiency``), for
seqpar's configurations and the peers alike, and ``python -m seqpar.bench.report --steady`` builds the table from
the back-to-back times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from seqpar.bench.report import readme_table, steady_rows

ROOT = Path(__file__).resolve().parents[1]


def test_bench_steady_on_gloo(tmp_path):
    """Two gloo processes (torchrun): every configuration's record carries its back-to-back time, the efficiency
    against the same limit, and the run's table has the back-to-back table beside the cold one. ``--methods`` may
    name a configuration the methods' ``bench_specs`` do not list (Ulysses in two head groups)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "seqpar.bench", "--preset", "tiny-causal", "--device", "cpu", "--methods",
           "ring/zigzag,ulysses,ulysses/head_chunks2",
           "--steady", "--warmup", "0", "--iters", "1", "--graphs", "off", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    ours = [r for r in recs if not r["method"].startswith("limit")]
    assert {(r["method"], r["mode"]) for r in ours} == {(m, mode) for m in ("ring/zigzag", "ulysses",
                                                                           "ulysses/head_chunks2")
                                                        for mode in ("fwd", "fwd+bwd")}
    for r in ours:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and "emulated_world" not in r
        assert r["steady_ms"] > 0 and r["steady_efficiency"] == pytest.approx(r["limit_ms"] / r["steady_ms"])
    md = next(tmp_path.glob("*.md")).read_text()
    assert "Calls issued back to back (--steady):" in md
    assert "Calls issued back to back" in res.stdout


def test_steady_rows_read_back_to_back_times():
    """The report's ``--steady`` on real records: times and efficiencies from the ``steady_*`` fields, the limit
    rows kept, records without a back-to-back time (a run without ``--steady``, a failed one) dropped."""
    limit = {"preset": "p", "method": "limit:cudnn-1gpu", "mode": "fwd", "world_size": 1, "time_ms": 4.0}
    ring = {"preset": "p", "method": "ring/zigzag", "mode": "fwd", "world_size": 4, "time_ms": 2.0, "limit_ms": 1.0,
            "efficiency": 0.5, "steady_ms": 1.25, "steady_efficiency": 0.8, "peak_mem_gib": 1.0}
    cold_only = {**ring, "method": "ulysses", "steady_ms": None, "steady_efficiency": None}
    failed = {**ring, "method": "tasp/zigzag", "error": "boom"}
    rows = steady_rows([limit, ring, cold_only, failed])
    assert [r["method"] for r in rows] == ["limit:cudnn-1gpu", "ring/zigzag"]
    assert rows[1]["time_ms"] == 1.25 and rows[1]["efficiency"] == 0.8 and ring["time_ms"] == 2.0
    assert "| p | fwd | 4 | 1.00 | 1.25 ms (ring/zigzag) | **0.800** |" in readme_table(rows)


@pytest.mark.parametrize("suite", ["overhead", "inference"])
def test_steady_refused_where_a_suite_times_itself(suite):
    """An option is never accepted and ignored: the suites that time their own calls refuse ``--steady``."""
    from seqpar.bench.__main__ import main

    with pytest.raises(SystemExit, match=f"--steady .*{suite}"):
        main(["--preset", suite, "--steady", "--device", "cpu"])


def test_method_labels_read_back():
    """``--methods`` labels outside ``bench_specs`` are read as the planner's validation reads records; a label
    whose options are out of order, or that names no option, is refused by name."""
    from seqpar.bench.presets import MethodSpec

    for label in ("ulysses/head_chunks2/transportcopy_engine", "usp/u2/zigzag/transportcopy_engine",
                  "allgather/zigzag/heads_k_stride2", "double_ring/zigzag/node_size2"):
        assert MethodSpec.parse(label, 4).label == label
    assert MethodSpec.parse("ulysses/head_chunks2", 4).options == (("head_chunks", 2),)
    with pytest.raises(ValueError, match="reads back as 'ulysses/head_chunks2/transportcopy_engine'"):
        MethodSpec.parse("ulysses/transportcopy_engine/head_chunks2", 4)
    with pytest.raises(ValueError, match="cannot read 'foo1'"):
        MethodSpec.parse("ulysses/foo1", 4)
