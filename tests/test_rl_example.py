"""``examples/rl_shared_prefix.py``: a prompt shared by N responses as one packed prefix tree
(``seqpar.masks.shared_prefix``) gives the loss and every parameter gradient of the duplicated packing (a prompt
copy per response, documents), on one process and on 2 gloo ranks; the tree's attention work is the exact count
of visible pairs, and it saves >= 2x on 8 responses of 64 after a 512-token prompt.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from seqpar.layouts.blocks import Rule, visible_dense
from seqpar.masks import shared_prefix

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "rl_shared_prefix.py"


def _example():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import rl_shared_prefix
    finally:
        sys.path.pop(0)
    return rl_shared_prefix


def _run(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _agrees(s: dict, checks: set[str]) -> None:
    assert set(s["errors"]) == checks, s["errors"]
    for name, e in s["errors"].items():
        assert e["loss_error"] <= s["tolerance"] and e["grad_error"] <= s["tolerance"], (name, e)
    assert s["agree"] and s["planned_exact"]
    assert s["planned"]["packed"]["planned_pairs"] == s["pairs"]["packed"]
    assert s["time_s"]["packed"] > 0 and s["time_s"]["duplicated"] > 0 and s["speedup"] > 0


@pytest.mark.parametrize("prompt, lens", [(13, [5, 1, 7]), (8, [8]), (1, [3, 3]), (20, [1] * 6)])
def test_pair_counts_are_the_masks_visible_pairs(prompt, lens):
    """The closed form counts exactly the (query, key) pairs the masks show (dense truth)."""
    pairs = _example().pairs(prompt, lens)
    S = prompt + sum(lens)
    tree = visible_dense(range(S), range(S), Rule(mask=shared_prefix(prompt, lens)))
    assert sum(map(sum, tree)) == pairs["packed"]
    docs = [d for i, n in enumerate(lens) for d in [i] * (prompt + n)]
    pos = range(len(docs))
    dup = visible_dense(pos, pos, Rule(causal=True), docs, docs)
    assert sum(map(sum, dup)) == pairs["duplicated"]


def test_one_process_default_preset_saves_flops():
    """W = 1 at the default preset (prompt 512, 8 responses of 64): agreement, >= 2x fewer attention FLOPs."""
    s = _run("--repeats", "1")
    assert s["config"]["prompt"] == 512 and s["config"]["response_lens"] == [64] * 8
    _agrees(s, {"packed_vs_duplicated"})
    assert s["tokens"] == {"packed": 1024, "duplicated": 4608}
    assert s["attention_flops_ratio"] >= 2.0
    assert s["attention_flops_fwd"]["duplicated"] / s["attention_flops_fwd"]["packed"] >= 2.0


@pytest.mark.parametrize("layout, dtype", [("zigzag", "float32"), ("balanced", "float64")])
def test_two_ranks_match_each_other_and_one_process(layout, dtype):
    """W = 2, uneven responses, a length the layout pads (zigzag: 4 chunks), no advantages in fp64: both
    distributed packings agree with each other and with the duplicated packing on one process."""
    s = _run("--world", "2", "--layout", layout, "--dtype", dtype, "--prompt", "61", "--responses", "3",
             "--response-len", "9,30,1", "--repeats", "1", *(["--no-advantages"] if dtype == "float64" else []))
    assert s["config"]["world"] == 2 and s["config"]["layout"] == layout
    assert s["tokens"]["packed"] == 101 and s["tolerance"] <= (1e-10 if dtype == "float64" else 2e-5)
    _agrees(s, {"packed_vs_duplicated", "packed_vs_one_process", "duplicated_vs_one_process"})
    if dtype == "float64":
        assert s["loss"]["packed"] > 0                     # a plain mean NLL


def test_bad_response_lengths_are_refused():
    ex = _example()
    with pytest.raises(SystemExit):
        ex.config_from_args(["--responses", "3", "--response-len", "4,5"])
    with pytest.raises(SystemExit):
        ex.config_from_args(["--response-len", "0"])
    c, as_json = ex.config_from_args(["--responses", "2", "--response-len", "4,5", "--json"])
    assert c.response_lens == (4, 5) and as_json
