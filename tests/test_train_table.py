"""``benchmarks/train_table.py``: the training recipe's records as tables, the memory plot and the budget model.

On the committed records: the tables (Llama-3-8B at 1M tokens labelled emulated, its probes, the 323M runs on 4
H200s), the budget model of each recipe (Note [Memory budget model]: plain norms from the 8B's 1M step and 2M
probe, tiled norms, tiled norms with the states on the host; slopes, the projected longest sequences at W = 8 and
W = 1 on this host and a 2 TB one) and the SVG. Then end to end on CPU:
``examples/train_long_context.py`` emulated (rank 0 of 4) with ``--warmup`` and ``--keep-attention`` writes a
steady-state record the table reads (and the model does not fit: it is not the memory-lean recipe), and the
recipe's refusals.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN3 = ROOT / "benchmarks" / "results" / "2026-11-25-h100-hardening" / "run3-train8b" / "train8b.jsonl"
SVG = "{http://www.w3.org/2000/svg}"


def _import(name: str, where: pathlib.Path):
    sys.path.insert(0, str(where))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="module")
def table():
    return _import("train_table", ROOT / "benchmarks")


def test_committed_records_make_the_tables(table, capsys, tmp_path):
    """Every committed train*.jsonl: the 8B's 1M step (emulated, first step, 37.8% MFU) and 2M probe, the 323M
    runs (real, 4 GPUs); the report, the JSON and the plot are written."""
    report = table.main(["--svg", str(tmp_path / "m.svg"), "--json", str(tmp_path / "m.json")])
    text = capsys.readouterr().out
    rows = [table.Row(**r) for r in report["rows"]]
    step = next(r for r in rows if r.model == "llama3-8b" and r.seq_len == 2**20)
    assert (step.world, step.emulated, step.fits, step.steady) == (8, True, True, False)
    assert step.peak_gib == pytest.approx(32.32) and step.mfu == pytest.approx(0.3778, abs=1e-4)
    probe = next(r for r in rows if r.model == "llama3-8b" and r.seq_len == 2**21)
    assert probe.probe == "window 4096" and probe.step_s is None
    small = sorted(r.seq_len for r in rows if r.model == "llama-323m")
    assert small == [2**17, 2**20] and all(not r.emulated and r.world == 4 for r in rows if r.model == "llama-323m")
    assert "### Llama-3-8B, 8.03B parameters, W = 8 (**emulated**: rank 0 of 8 on one H100)" in text
    assert "| 1M | 128K | yes | 32.3 | 37.7 | 305.1 | 430 | 37.8% | first step |" in text
    assert "### 323M Llama, 0.32B parameters, W = 4 (4 x H200)" in text
    assert "### Memory budget model: Llama-3-8B" in text
    fits = json.loads((tmp_path / "m.json").read_text())["fits"]
    assert [(f["fit"]["tile_norms"], f["fit"]["offload_states"]) for f in fits] == [(True, True), (True, False),
                                                                                   (False, False)]
    assert fits[2]["fit"]["seq_lens"] == [2**20, 2**21]           # the plain-norm recipe: run3's step and probe
    assert "(tiled norms, states on the host)" in text and "(plain norms, states on the GPU)" in text
    svg = ET.parse(tmp_path / "m.svg").getroot()
    assert svg.tag == f"{SVG}svg"
    titles = [c.find(f"{SVG}title").text for c in svg.iter(f"{SVG}circle") if c.find(f"{SVG}title") is not None]
    assert len(titles) == len(rows) and any("llama3-8b W=8 emulated 1M: 32.3 GiB" in t for t in titles)
    assert len(list(svg.iter(f"{SVG}polyline"))) == sum(1 for s in table.scenarios(report_fit(table, report)) if s.plot)


def report_fit(table, report):
    return table.Fit(**{**report["fit"], "seq_lens": tuple(report["fit"]["seq_lens"])})


def test_budget_model_on_the_8b_records(table):
    """The lines through the 1M step and the 2M probe (run3) and what they project (Note [Memory budget model])."""
    f = table.fit(table.load_rows([RUN3]))
    per_m = 2**20 / 8
    assert f.gpu_per_token * per_m == pytest.approx(54.801 - 32.32, rel=1e-6)
    assert f.gpu_fixed == pytest.approx(32.32 - (54.801 - 32.32), rel=1e-6)
    assert f.host_per_token * per_m == pytest.approx(73.673 - 37.68, rel=1e-6)
    assert (f.gpu_total, f.host_total) == (79.18, 125.9)
    proj = {p["label"]: p for p in (table.project(f, s) for s in table.scenarios(f))}
    one = proj["W = 8, one step (as measured)"]
    assert one["max_seq_len"] == one["max_by_gpu"] and one["bound"] == "gpu memory"
    assert one["max_seq_len"] / 2**20 == pytest.approx((0.95 * 79.18 - f.gpu_fixed) / (f.gpu_per_token * per_m))
    steady = proj["W = 8, steady state"]
    states = 8 * 8_030_261_248 / 2**30 / 8
    assert steady["gpu_fixed_gib"] == pytest.approx(f.gpu_fixed + states)
    assert 2.5 < steady["max_seq_len"] / 2**20 < 2.7 and steady["bound"] == "gpu memory"
    kept = proj["W = 8, steady state, 28 GiB of kept attention outputs"]
    at_1m = table.gpu_at(kept, 2**20)
    assert at_1m == pytest.approx(f.gpu_fixed + states + f.gpu_per_token * per_m + 28.0)
    assert 79.18 - at_1m > 10                                     # the recipe's 1M step keeps 10 GiB spare
    assert proj["W = 8, steady state, every layer's attention output kept"]["kept_gib_per_mtok"] == pytest.approx(
        32 * (32 * 128 * 2 + 32 * 4) * per_m / 2**30)
    assert proj["W = 8, steady state, 2 TB host"]["max_seq_len"] == steady["max_seq_len"]    # the GPU bounds it
    assert proj["W = 1, states on the GPU"]["max_by_gpu"] == 0
    host = proj["W = 1, fp32 states and AdamW on the host"]
    assert host["max_seq_len"] == 0 and host["bound"] == "host memory"          # 120 GiB of states on 126
    big = proj["W = 1, fp32 states and AdamW on the host, 2 TB host"]
    assert big["bound"] == "gpu memory" and 200_000 < big["max_seq_len"] < 300_000


STATES = ROOT / "benchmarks" / "results" / "2026-11-26-h100-train-memory"


def test_budget_model_of_the_lean_recipes(table):
    """Tiled norms (2M, 3M probes; the 3.75M try kept tensors on the GPU when the host budget ran out, so it is no
    point of the lines) and, on top, the states on the host (1M, 2M probes): the slopes fall from run3's 180 KiB
    per local token to 84 and 70, and the 2 TB host projections pass 6M tokens at W = 8 and ~1M at W = 1."""
    rows = table.load_rows(table.train_files(STATES))
    lean = table.fit(rows, tile_norms=True, offload_states=False)
    assert lean.seq_lens == (2 * 2**20, 3 * 2**20)
    assert 80 < lean.gpu_per_token * 2**30 / 1024 < 90
    proj = {p["label"]: p for p in (table.project(lean, s) for s in table.scenarios(lean))}
    assert proj["W = 8, steady state"]["bound"] == "host memory"       # this host: the offloaded layer inputs
    states = table.fit(rows)                                             # the newest recipe
    assert (states.tile_norms, states.offload_states, states.seq_lens) == (True, True, (2**20, 2 * 2**20))
    assert 65 < states.gpu_per_token * 2**30 / 1024 < 75
    proj = {p["label"]: p for p in (table.project(states, s) for s in table.scenarios(states))}
    assert proj["W = 8, states on the host (as measured)"]["gpu_fixed_gib"] == pytest.approx(states.gpu_fixed)
    big8 = proj["W = 8, states on the host, 2 TB host"]
    assert big8["bound"] == "gpu memory" and big8["max_seq_len"] >= 6 * 2**20
    assert big8["max_seq_len"] / 2**20 == pytest.approx((0.95 * 79.18 - states.gpu_fixed)
                                                        / (states.gpu_per_token * 2**20 / 8))
    one = proj["W = 1, states on the host"]
    assert one["bound"] == "host memory" and one["max_seq_len"] == 0      # 120 GiB of states on a 126 GiB host
    assert one["host_fixed_gib"] == pytest.approx(states.host_fixed - 16 * 8_030_261_248 / 2**30 * (1 / 8 - 1))
    big1 = proj["W = 1, states on the host, 2 TB host"]
    assert big1["bound"] == "gpu memory" and big1["max_seq_len"] >= 500_000          # ALST's 500K on one H100


def test_a_split_of_the_states_is_tabled_but_not_fitted(table):
    """A run with only the root's and some layers' states on the host (``--offload-state-layers``: an 8B at
    W = 1 on this host) is a row of the tables, named so, and no point of any recipe's lines."""
    rec = {"model": "llama3-8b", "seq_len": 160 * 1024, "world": 1, "emulated": True, "fits": True,
           "peak_gib": 70.0, "host_peak_gib": 110.0, "step_s": 100.0, "tile_norms": 8192, "offload_states": True,
           "offload_state_layers": 16, "steady_state": True}
    row = table._recipe_row(rec, "x")
    assert table._recipe(row) == "tiled norms, states on host (root + 16 of 32 layers)"
    rows = [row, table._recipe_row({**rec, "seq_len": 2 * rec["seq_len"]}, "x")]
    assert table.recipes(rows, world=1) == []
    with pytest.raises(ValueError, match="two lengths at least"):
        table.fit(rows, world=1, tile_norms=True, offload_states=True)


def test_fit_needs_two_lengths(table):
    rows = [r for r in table.load_rows([RUN3]) if r.seq_len == 2**20]
    with pytest.raises(ValueError, match=r"two lengths at least, got \[1048576\]"):
        table.fit(rows)


def _recipe(tmp_path: pathlib.Path, out: pathlib.Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_long_context.py"), "--world", "4",
                           "--emulate", "--method", "ring", "--tile-mlp", "16", "--offload", "--steps", "1",
                           "--json", str(out), *args], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_recipe_records_with_warmup_and_kept_attention(table, tmp_path):
    """The recipe on CPU, rank 0 of 4 emulated: with --warmup the one timed step is steady state (nothing pinned in
    it); with --keep-attention each layer's attention runs once (2 kept, 2 replayed); the table labels both."""
    out = tmp_path / "train_tiny.jsonl"
    _recipe(tmp_path, out, "--seq-len", "256", "--warmup", "--keep-attention")
    _recipe(tmp_path, out, "--seq-len", "512")
    kept, first = [json.loads(line) for line in out.read_text().splitlines()]
    assert kept["steady_state"] and kept["warmup"]["warmup_s"] > 0 and kept["pin_s_timed"] == 0.0
    assert kept["keep_attention"] and kept["keep_attention_gib"] is None
    assert kept["keep_stats"]["kept_calls"] == kept["keep_stats"]["replayed_calls"] == 2
    assert kept["keep_stats"]["recomputed_calls"] == 0 and kept["keep_stats"]["kept_bytes"] > 0
    assert not first["steady_state"] and first["first_step_only"] and first["warmup"] is None
    assert not first["keep_attention"] and first["keep_stats"] is None
    rows = table.load_rows([out])
    text = table.tables(rows)
    assert "### tiny Llama" in text and "**emulated**: rank 0 of 4" in text
    assert text.count("| steady state |") == 1 and text.count("| first step |") == 1
    assert [r.keep_gib is not None for r in sorted(rows, key=lambda r: r.seq_len)] == [True, False]
    with pytest.raises(ValueError, match="two lengths at least, got \\[512\\]"):
        table.fit(rows, "tiny", 4)                                # the kept record is not the lean recipe's


def test_recipe_refuses_what_cannot_go_together():
    ex = _import("train_long_context", ROOT / "examples")
    p = ex.PRESETS["cpu-tiny"]
    with pytest.raises(ValueError, match="needs checkpointing"):
        ex._check_options(ex.replace(p, keep_attention=True, checkpointing=False), False)
    with pytest.raises(ValueError, match=r"does not run under torch\.compile"):
        ex._check_options(ex.replace(p, keep_attention=True, compile=True), False)
    with pytest.raises(ValueError, match="run --check without --warmup"):
        ex._check_options(ex.replace(p, warmup=True), True)
    llama = ex.preset_from(ex.argparse.Namespace(preset="gpu-1m", model="llama3-8b"))
    assert llama.keep_attention and llama.keep_attention_gib == 28.0 and llama.tile_norms == 8192
    assert ex.gib_or_all("all") == float("inf") and ex.gib_or_all("2.5") == 2.5
