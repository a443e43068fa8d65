"""``examples/train_long_context.py --preset cpu-tiny``, spawned on 4 gloo ranks, equals one process.

The script trains a Llama-architecture transformers model with attn_implementation="seqpar" (activation
checkpointing, the tiled sequence-parallel loss, FSDP2 over the mesh) and, with ``--check``, the same model on
one process next to it. Its JSON lines must show, at each of 3 AdamW steps, the same loss and every parameter
gradient equal to the single-process one (fp64: normalised error <= 1e-10); and the plot must be drawn.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_long_context.py"


def _run(tmp_path: pathlib.Path, *args: str) -> list[dict]:
    out = tmp_path / "run.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--preset", "cpu-tiny", "--spawn", "4", "--check",
                           "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _check(records: list[dict], steps: int = 3) -> None:
    head, *rest = records
    assert head["world"] == 4 and head["check"] and head["config"]["checkpointing"]
    step_recs = [r for r in rest if "step" in r]
    assert [r["step"] for r in step_recs] == list(range(steps))
    for r in step_recs:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-10 * abs(r["ref_loss"]), r
        assert r["grad_error"] <= 1e-10, r
        assert len(r["peak_mem_gib"]) == 4 and r["tokens_per_s"] > 0
    assert step_recs[-1]["loss"] < step_recs[0]["loss"]          # it trains
    assert rest[-1].get("summary") and rest[-1]["final_loss"] == step_recs[-1]["loss"]


def test_usp_zigzag_matches_single_process_and_plots(tmp_path):
    """USP 2 x 2, zigzag, FSDP2 over the 4 ranks; then --plot draws the loss curve."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "loss.png"
    records = _run(tmp_path, "--plot", str(png))
    _check(records)
    assert records[0]["config"]["method"] == "usp" and records[0]["config"]["fsdp"]
    assert png.stat().st_size > 1000


def test_data_by_sequence_mesh_ring(tmp_path):
    """2 data-parallel replicas x 2 sequence-parallel ranks (ring, zigzag), FSDP2 over the 2D mesh: the loss
    and gradients of the mean over replicas equal one process's on both replicas' batches."""
    records = _run(tmp_path, "--dp", "2", "--method", "ring")
    _check(records)
    assert records[0]["config"]["dp"] == 2
