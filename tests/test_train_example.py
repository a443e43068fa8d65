"""``examples/train_long_context.py --preset cpu-tiny``, spawned on 4 gloo ranks, equals one process.

The script trains a Llama-architecture transformers model with attn_implementation="seqpar" (activation
checkpointing, the tiled sequence-parallel loss, FSDP2 over the mesh) and, with ``--check``, the same model on
one process next to it. Its JSON lines must show, at each of 3 AdamW steps, the same loss and every parameter
gradient equal to the single-process one (fp64: normalised error <= 1e-10); and the plot must be drawn. The same
holds with the tiled MLP and activation offload on.

The recipe (Note [Rank 0 of W on one GPU]): ``--world 4 --emulate`` runs rank 0 of 4 on a fake group on CPU and
writes the recipe's record (``--json``); ``--search`` tries lengths in fresh processes (one real search, capped
at two tries; the doubling / bisection / bound logic on scripted outcomes in process).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

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


def test_data_by_sequence_mesh_ring_tiled_mlp_offload(tmp_path):
    """2 data-parallel replicas x 2 sequence-parallel ranks (ring, zigzag), FSDP2 over the 2D mesh, with every
    MLP and RMSNorm in 16-token chunks and the offload context (a pass-through on CPU): the loss and gradients of
    the mean over replicas equal one process's (plain MLP) on both replicas' batches."""
    records = _run(tmp_path, "--dp", "2", "--method", "ring", "--tile-mlp", "16", "--tile-norms", "16", "--offload")
    _check(records)
    assert records[0]["config"]["dp"] == 2
    assert records[0]["config"]["tile_mlp"] == 16 and records[0]["config"]["tile_norms"] == 16
    assert records[0]["config"]["offload"]


RECIPE_KEYS = {"model", "seq_len", "world", "emulated", "fits", "peak_gib", "step_s", "mfu"}


def _emulate(tmp_path: pathlib.Path, *args: str, timeout: float = 300) -> list[dict]:
    out = tmp_path / "recipe.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--world", "4", "--emulate", "--method", "ring",
                           "--json", str(out), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_emulated_rank_0_of_4_recipe_record(tmp_path):
    """Rank 0 of 4 on a fake group (CPU), tiled MLP + offload + checkpointing + tiled loss, 2 AdamW steps:
    one record with the recipe's keys; step time and MFU from the second step."""
    (rec,) = _emulate(tmp_path, "--tile-mlp", "16", "--tile-norms", "16", "--offload", "--steps", "2", "--seq-len",
                      "256")
    assert RECIPE_KEYS <= set(rec)
    assert (rec["model"], rec["seq_len"], rec["world"], rec["emulated"], rec["fits"]) == ("tiny", 256, 4, True, True)
    assert rec["peak_gib"] > 0 and rec["step_s"] > 0 and 0 < rec["mfu"] < 1 and rec["steps_timed"] == 1
    assert rec["tile_mlp"] == 16 and rec["tile_norms"] == 16 and rec["offload"] and rec["probe"] is None
    assert rec["offload_stats"]["offloaded_bytes"] == 0          # CPU tensors stay where they are


def test_search_two_tries(tmp_path):
    """``--search`` from 128 tokens capped at 256: two tries in fresh processes (window probe), both fit."""
    recs = _emulate(tmp_path, "--steps", "1", "--search", "--seq-len", "128", "--search-max", "256",
                    "--fit-probe", "16", "--budget-s", "240")
    tries, (summary,) = recs[:-1], recs[-1:]
    assert [t["seq_len"] for t in tries] == [128, 256] and all(t["fits"] and t["search_try"] for t in tries)
    assert all(t["probe"] == "window 16" and t["mfu"] is None for t in tries)
    assert RECIPE_KEYS | {"max_seq_len", "bound"} <= set(summary)
    assert summary["search"] and summary["max_seq_len"] == 256 and summary["bound"] == "search max"
    assert summary["budget_model"]["from_seq_lens"] == [128, 256]


def _example():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_long_context
    finally:
        sys.path.pop(0)
    return train_long_context


@pytest.mark.parametrize("limit", [700, 350, 100, 50, 3])
def test_search_doubles_then_bisects(monkeypatch, limit):
    """Scripted outcomes (a length fits when <= limit): doubling from 100 until the first failure, then
    bisection on multiples of 2W = 8 until the bracket is at most 8 wide (1/16 of the start, at least 2W); the
    failing try's reason is the bound; nothing fits when even the shortest multiple fails."""
    ex = _example()
    tried = []

    def one_try(argv, seq_len, timeout):
        tried.append(seq_len)
        fits = seq_len <= limit
        return {"model": "m", "seq_len": seq_len, "world": 4, "emulated": True, "fits": fits, "peak_gib": 1.0,
                "step_s": None, "mfu": None, "wall_s": 0.0, **({} if fits else {"bound": "gpu memory"})}

    monkeypatch.setattr(ex, "_one_try", one_try)
    monkeypatch.setattr(ex, "_emit", lambda rec, path: None)
    args = ex.argparse.Namespace(world=4, budget_s=60.0, search_max=None, json=None)
    summary = ex.search(ex.replace(ex.PRESETS["cpu-tiny"], seq_len=100), [], args)
    doubling = [100 * 2 ** i for i in range(len(tried)) if 100 * 2 ** (i - 1) <= limit][:len(tried)]
    assert tried[:len(doubling)] == doubling and len(set(tried)) == len(tried)
    assert summary["bound"] == "gpu memory" and summary["failed_seq_len"] > limit
    if limit >= 8:
        assert summary["max_seq_len"] <= limit and summary["failed_seq_len"] - summary["max_seq_len"] <= 8
    else:
        assert summary["max_seq_len"] is None and min(tried) == 8


def test_token_counts_and_model_flops():
    """``--seq-len`` takes 1M-style counts (binary); MFU's model FLOPs for llama3-8b at 1M over 8 ranks."""
    ex = _example()
    assert [ex.tokens(t) for t in ("131072", "128K", "512k", "1M", "1.5M")] == [131072, 131072, 524288, 1 << 20,
                                                                               3 << 19]
    p = ex.replace(ex.PRESETS["gpu-1m"], **ex.MODELS["llama3-8b"], seq_len=1 << 20)
    params = 8_030_261_248 - 128256 * 4096 - (2 * 32 + 1) * 4096    # Llama-3-8B less embedding table and norms
    matmul = 6 * params * (1 << 17)
    attention = 6 * (1 << 40) * 32 * 128 * 32 / 8
    assert ex.model_flops(p, 8) == pytest.approx(matmul + attention, rel=1e-12)


def test_options_refused_before_any_work():
    """``--offload-states`` needs FSDP2 on CUDA (CPUOffloadPolicy); ``--offload-prefetch`` is a count: refused by
    name with the value, before a model is built."""
    from dataclasses import replace

    ex = _example()
    tiny = ex.PRESETS["cpu-tiny"]
    with pytest.raises(ValueError, match=r"offload_states .* needs --fsdp on a CUDA device, got fsdp=True, "
                                         r"device='cpu'"):
        ex._check_options(replace(tiny, offload_states=True), False)
    with pytest.raises(ValueError, match=r"offload_states .* got fsdp=False"):
        ex._check_options(replace(tiny, offload_states=True, fsdp=False, device="cuda"), False)
    with pytest.raises(ValueError, match="offload_prefetch must be >= 0, got -1"):
        ex._check_options(replace(tiny, offload_prefetch=-1), False)
    ex._check_options(replace(tiny, offload_states=True, device="cuda"), False)     # accepted
    with pytest.raises(ValueError, match=r"offload_state_layers takes 0\.\.layers \(2\) with offload_states, got 3"):
        ex._check_options(replace(tiny, offload_states=True, device="cuda", offload_state_layers=3), False)
    with pytest.raises(ValueError, match=r"offload_state_layers .* got 1 \(offload_states=False\)"):
        ex._check_options(replace(tiny, offload_state_layers=1), False)
    ex._check_options(replace(tiny, offload_states=True, device="cuda", offload_state_layers=0), False)


def test_states_on_the_host_that_cannot_fit_are_refused_up_front():
    """Note [States on the host]: an 8B's fp32 states at W = 1 (120 GiB) on a 126 GiB host (124 available) are
    refused before any work with a "host out of memory" error (the recipe's record then says "host memory"); at
    W = 8 (15 GiB per rank) they pass, and eight ranks on one host count eight times."""
    from dataclasses import replace

    ex = _example()
    p = replace(ex.preset_from(ex.argparse.Namespace(preset="gpu-1m", model="llama3-8b")), offload_states=True)
    assert ex.parameter_count(p) == 8_030_261_248
    host = 124 * 2**30                         # MemAvailable of the 126 GiB GPU machine
    with pytest.raises(ex.HostMemoryShort, match=r"host out of memory: .* need 119\.7 GiB .* at W = 1 .* 124\.0 GiB"):
        ex._host_preflight(p, 1, available=host)
    ex._host_preflight(p, 8, available=host)
    with pytest.raises(ex.HostMemoryShort, match=r"need 119\.7 GiB"):
        ex._host_preflight(p, 8, local=8, available=host)
    ex._host_preflight(replace(p, offload_states=False), 1, available=host)       # the states stay on the GPU
    assert ex._which_memory(ex.HostMemoryShort("host out of memory: ..."), None) == "host memory"
    # a split for W = 1: the root's 1.05B parameters (15.7 GiB) and 15 of 32 layers' (48.7 GiB) on the host
    split = replace(p, offload_state_layers=15)
    assert ex.parameter_count(split, 15) == 2 * 128256 * 4096 + 4096 + 15 * 218_112_000
    ex._host_preflight(split, 1, available=host)
    with pytest.raises(ex.HostMemoryShort, match=r"states \(the root's and 15 layers'\) need 64\.4 GiB"):
        ex._host_preflight(split, 1, available=60 * 2**30)


def test_host_states_to_come_counts_pinned_gradients_and_moments():
    """What the offloaded states add on the host after sharding, which the offload's pinned pool leaves room for:
    each fp32 gradient in a power-of-two pinned block, and AdamW's two moments; parameters on the GPU count 0."""
    ex = _example()
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(4, 4, bias=False))
    sizes = [15 * 4, 5 * 4, 16 * 4]               # weight, bias, weight: bytes of fp32
    expected = sum((1 << (n - 1).bit_length()) + 2 * n for n in sizes)
    assert ex._host_states_to_come(model) == expected == 64 + 32 + 64 + 2 * 144
    assert ex._host_states_to_come(torch.nn.Sequential()) == 0
