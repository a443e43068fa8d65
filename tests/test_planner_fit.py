"""The planner's fixed-cost fit (``seqpar.planner.fit``, Note [Fixed-cost fit]) and the profile fields it fills."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seqpar.cost.profile import Profile
from seqpar.planner import fit as fitmod
from seqpar.planner import load_profile
from seqpar.planner.measured import (
    CALL_US,
    EMULATED_CALL_US,
    EMULATED_FIT_PRESETS,
    EMULATED_HOST_OVERLAP_LOSS,
    EMULATED_STEP_US,
    FIT_FILES,
    FIT_PRESETS,
    FIT_PROFILE,
    HOST_OVERLAP_LOSS,
    STEP_US,
    emulated_sources,
    fit_sources,
)
from seqpar.planner.validate import check, predict_record, results
from seqpar.planner.validate import main as validate_main

ROOT = Path(__file__).resolve().parents[1]
H200 = load_profile("h200-nvswitch")
#: known fixed costs (µs) and κ the synthetic measurements are generated from
TRUE = {"call/fwd": 400.0, "call/bwd": 250.0, "step/ring/fwd": 120.0, "step/ring/bwd": 300.0,
        "step/ulysses/fwd": 900.0, "step/ulysses/bwd": 1300.0}
TRUE_KAPPA = 0.25


def _records(theta: dict[str, float], kappa: float) -> list[tuple[str, dict, bool]]:
    """Synthetic benchmark records timed by the model itself under ``theta`` and ``kappa``: ring and Ulysses,
    forward and forward+backward, 2 and 4 ranks, host-bound (8K) to device-bound (256K). The 16K and 64K
    presets form the fit set; the others are checks."""
    truth = fitmod.profile_with(H200, theta, kappa)
    out = []
    for S in (8192, 16384, 32768, 65536, 262144):
        for W in (2, 4):
            for method in ("ring/zigzag", "ulysses"):
                for mode in ("fwd", "fwd+bwd"):
                    rec = {"preset": f"s{S}", "method": method, "mode": mode, "world_size": W, "heads": 32,
                           "kv_heads": 32, "seq_len": S, "causal": True, "head_dim": 128, "gpu": "NVIDIA H200"}
                    rec["time_ms"] = predict_record(rec, truth).time_ms(mode)
                    out.append(("synthetic.jsonl", rec, S in (16384, 65536, 262144)))
    return out


def test_fit_recovers_known_fixed_costs():
    recs = _records(TRUE, TRUE_KAPPA)
    f = fitmod.fit(recs, H200, kappas=(0.0, 0.25, 0.5, 1.0))
    assert f.kappa == TRUE_KAPPA
    assert set(f.theta_us) == set(TRUE)                      # only costs the fit rows pay are reported
    for k, v in TRUE.items():
        assert f.theta_us[k] == pytest.approx(v, rel=0.02, abs=2.0), (k, f.theta_us)
    assert max(abs(f.error(r)) for r in f.rows) < 0.005      # checks included: same θ generated them
    text = fitmod.render(f)
    assert "| fit | synthetic.jsonl | s16384 |" in text and "| check | synthetic.jsonl | s8192 |" in text


def test_fit_never_reads_check_rows():
    recs = _records(TRUE, TRUE_KAPPA)
    disturbed = [(src, dict(rec, time_ms=rec["time_ms"] * (1 if in_fit else 3.0)), in_fit)
                 for src, rec, in_fit in recs]
    a = fitmod.fit(recs, H200, kappas=(0.25, 0.5))
    b = fitmod.fit(disturbed, H200, kappas=(0.25, 0.5))
    assert (a.theta_us, a.kappa) == (b.theta_us, b.kappa)
    assert b.summary(True).startswith("fit: 24/24") and b.summary(False).startswith("check: 0/16")
    with pytest.raises(ValueError, match="at least one row"):
        fitmod.fit([(s, r, False) for s, r, _ in recs], H200, kappas=(0.5,))


def test_split_marks_fit_files_and_presets(tmp_path):
    a, b = tmp_path / "probe.jsonl", tmp_path / "table.jsonl"
    row = {"method": "ring/zigzag", "mode": "fwd", "world_size": 4, "time_ms": 1.0}
    a.write_text(json.dumps(dict(row, preset="x")) + "\n")
    b.write_text("\n".join(json.dumps(dict(row, preset=p)) for p in ("x", "y"))
                 + "\n" + json.dumps(dict(row, preset="y", method="auto"))
                 + "\n" + json.dumps(dict(row, preset="y", method="limit/1gpu")) + "\n")
    got = [(src, r["preset"], fit_) for src, r, fit_ in fitmod.split([a, b], [a], ["y"])]
    assert got == [("probe.jsonl", "x", True), ("table.jsonl", "x", False), ("table.jsonl", "y", True)]


def test_profile_fixed_cost_fields_roundtrip_and_defaults():
    p = H200.replace(call_us=(("bwd", 1.0), ("fwd", 2.0)), step_us=(("ring/fwd", 3.0),),
                     latency_us=(("a2a", 4.0),), permute_gelems=5.0, host_overlap_loss=0.5)
    d = json.loads(p.to_json())
    assert d["call_us"] == {"bwd": 1.0, "fwd": 2.0} and d["host_overlap_loss"] == 0.5
    assert Profile.from_dict(d) == p
    assert p.step_cost_us("ring", "fwd") == 3.0 and p.step_cost_us("ring", "bwd") == p.alpha_us
    assert p.call_cost_us("fwd") == 2.0 and p.latency("a2a") == 4.0 and p.latency("allpairs") == 4.0
    for k in ("call_us", "step_us", "latency_us", "permute_gelems", "host_overlap_loss"):
        del d[k]
    old = Profile.from_dict(d)                                 # a profile written before the fields existed
    assert old.host_overlap_loss == 1.0 and old.call_cost_us("fwd") == 0.0
    assert old.step_cost_us("ring", "fwd") == old.alpha_us and old.latency("p2p") == old.alpha_us
    for bad, match in ((dict(call_us=(("side", 1.0),)), "call_us keys"), (dict(step_us=(("ring", 1.0),)), "step_us"),
                       (dict(host_overlap_loss=1.5), "host_overlap_loss"), (dict(call_us=(("fwd", -1.0),)), ">= 0")):
        with pytest.raises(ValueError, match=match):
            H200.replace(**bad)


def test_builtin_fixed_costs_are_the_committed_fit():
    """FIT_COMMAND (at the profile's κ) reproduces the built-in profile's call_us and step_us."""
    paths = fit_sources(ROOT)
    if not all(p.exists() for p in paths):
        pytest.skip("benchmark results not in this checkout")
    recs = fitmod.split(paths, [p for p in paths if p.name in FIT_FILES], FIT_PRESETS)
    f = fitmod.fit(recs, FIT_PROFILE, kappas=(HOST_OVERLAP_LOSS,))
    want = {f"call/{k}": v for k, v in CALL_US.items()} | {f"step/{k}": v for k, v in STEP_US.items()}
    assert f.theta_us.keys() == want.keys()
    for k, v in want.items():
        assert f.theta_us[k] == pytest.approx(v, abs=max(2.0, 0.01 * v)), k
    assert dict(H200.call_us) == CALL_US and dict(H200.step_us) == STEP_US
    assert H200.host_overlap_loss == HOST_OVERLAP_LOSS
    h100 = load_profile("h100-nvswitch")
    assert dict(h100.step_us) == STEP_US and h100.host_overlap_loss == HOST_OVERLAP_LOSS


def test_emulated_fixed_costs_are_the_committed_fit():
    """EMULATED_FIT_COMMAND (back-to-back times, at the profile's κ) reproduces the emulated profile's fixed costs;
    its links are free."""
    paths = emulated_sources(ROOT)
    if not all(p.exists() for p in paths):
        pytest.skip("benchmark results not in this checkout")
    recs = fitmod.split(paths, [], EMULATED_FIT_PRESETS, steady=True)
    f = fitmod.fit(recs, "h100-emulated", kappas=(EMULATED_HOST_OVERLAP_LOSS,))
    want = {f"call/{k}": v for k, v in EMULATED_CALL_US.items()} | {f"step/{k}": v for k, v in EMULATED_STEP_US.items()}
    assert f.theta_us.keys() == want.keys()
    for k, v in want.items():
        assert f.theta_us[k] == pytest.approx(v, abs=max(2.0, 0.01 * v)), k
    emu = load_profile("h100-emulated")
    assert dict(emu.step_us) == EMULATED_STEP_US and emu.host_overlap_loss == EMULATED_HOST_OVERLAP_LOSS
    assert emu.link_ms("p2p", 1 << 30) < 1e-3 and emu.latency("a2a") == 0.0
    assert emu.kernels == load_profile("h100-nvswitch").kernels


def test_emulated_profile_picks_the_emulated_best():
    """On every row of the committed emulated table (fit and check presets, W = 4 and 8, forward and
    forward+backward), the emulated profile's pick runs within 5% of the fastest measured configuration."""
    paths = emulated_sources(ROOT)
    if not all(p.exists() for p in paths):
        pytest.skip("benchmark results not in this checkout")
    recs = [r for p in paths for r in results(p, steady=True)]
    _, autos, _ = check(recs, load_profile("h100-emulated"), sources=[p.name for p in paths for _ in results(p)])
    assert len(autos) == 12
    assert all(a["ratio"] <= 1.05 for a in autos), autos


def test_validate_labels_fit_and_check(tmp_path, capsys):
    fixture = Path(__file__).parent / "data" / "bench_sample.jsonl"
    out, js = tmp_path / "v.md", tmp_path / "v.json"
    validate_main([str(fixture), "--fit-presets", "mha-causal-16k", "--out", str(out), "--json", str(js)])
    text = out.read_text()
    assert "| FIT | bench_sample.jsonl | mha-causal-16k |" in text
    assert "| CHECK | bench_sample.jsonl | mha-causal-128k |" in text
    assert "\nFIT W=4: " in text and "\nCHECK W=4: " in text
    rows = json.loads(js.read_text())["rows"]
    assert {r["set"] for r in rows if r["preset"] == "mha-causal-16k"} == {"fit"}
    assert {r["set"] for r in rows if r["preset"] == "mha-causal-128k"} == {"check"}
