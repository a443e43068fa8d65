"""``examples/generate_long_context.py --preset cpu-tiny --check``, spawned on 2 gloo ranks: the sharded
generate (chunked prefill, decode over the sharded cache) gives one process's tokens, and the script prints
tokens/s and the KV memory of every rank."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_generate_example_matches_one_process():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "generate_long_context.py"), "--preset", "cpu-tiny",
                           "--spawn", "2", "--check", "--context", "300", "--new-tokens", "4"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "same tokens as one process: True" in out, out
    assert "tokens/s" in out and "rank 0: KV" in out and "rank 1: KV" in out, out
