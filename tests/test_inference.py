"""Long-context inference: the sharded KV cache against the dense fp64 oracle, and generate against one process.

Multi-process (gloo, W = 1, 2, 3, 4, 8; one pool call per world size, every case looped inside the workers):

- the cache driven directly (``seqpar.inference``): prompts that the layout does not divide, filled by every
  method that can fill a cache (ring, allgather, ulysses, usp, tokenring, tasp, double_ring); extension
  chunks by pass-KV, pass-Q and the bytes rule; decode steps; the static (graph-capturable) decode step;
  sliding windows with eviction; left-padded batch rows; attention sinks; MLA head dims (Dv != D) through
  pass-Q, pass-KV and the static step. Every output row of every layer
  equals dense causal attention over the whole sequence in fp64 (within 1e-10: the inputs are fp64).
- ``seqpar.integrations.huggingface.generate`` on tiny Llama, Qwen3 (q/k norms, one sliding layer), Mistral
  (sliding window) and gpt-oss (attention sinks, a sliding layer, experts) models: batch 1 and 2 (left
  padding), prompt lengths the layout divides and does not, chunked prefill, a second turn extending the
  cache, greedy and seeded sampling. Tokens equal ``model.generate`` on one process on every rank; every
  step's logits are within 1e-5 of the same model in fp64 (the fp32 oracle rule).
- misuses raise "X must Y, got Z (rank r of W)" on every rank (W = 2): decoding an empty cache, wrong
  shapes, a chunk left open, a window that changes, a full static cache, beam search, right padding, bad
  options.
- ``seqpar.bench.inference`` on CPU (W = 1 with the transformers baseline, W = 2): the eager and the static
  (graph-capturable) decode steps give the same greedy tokens as transformers.

Single-process: the positions bookkeeping, the planner on cache slices against dense visibility, the pass rule
and the device-masked local step.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("transformers")

from _workers_inference import (
    bench_run,
    build,
    cache_errors,
    cache_inputs,
    cache_run,
    dead_layer_prefill,
    generate_run,
    prefill_timing,
    prompt,
)

from seqpar.inference import choose_extend_pass, plan_inference
from seqpar.inference._local import SlotMask, attend_block
from seqpar.inference.plans import RowGroup, pair_tasks
from seqpar.inference.rows import RankRows
from seqpar.layouts.blocks import Rule, Run, Segments, visible_dense
from seqpar.masks import Band
from seqpar.testing import dense_attention, rel_error

CACHE_TOL = 1e-10       # fp64 inputs
LOGIT_TOL = 1e-5        # fp32 models against the fp64 model

# -- cases -------------------------------------------------------------------------------------------------


def _fill(method: str = "ring", layout: str | None = "zigzag", **options) -> dict:
    return {"method": method, "layout": layout, **options}


def _cache_specs(world: int) -> list[dict]:
    """Oracle cases of the cache at ``world`` ranks (every spec is prefill / decode / static chunks)."""
    zig = _fill()
    specs = [
        {"label": "ring zigzag, decode, pass-KV extension, window, left padding",
         "chunks": [("prefill", 13, zig), ("decode", 2), ("prefill", 7, zig), ("decode", 1)], "passes": "kv",
         "windows": {1: 5}, "batch": 2, "starts": (0, 3)},
        {"label": "stripe then contiguous chunks, pass-Q, sinks, MLA head dims (Dv 12, D 8)",
         "chunks": [("prefill", 11, _fill(layout="stripe")), ("decode", 3), ("prefill", 9, _fill(layout="contiguous")),
                    ("decode", 1)], "passes": "q", "sinks": True, "value_head_dim": 12},
        {"label": "chunked prefill by the bytes rule (a small chunk after a long prompt)",
         "chunks": [("prefill", 29, zig), ("prefill", 3, zig), ("prefill", 9, zig), ("decode", 2)],
         "windows": {0: 6}},
        {"label": "static cache: graph-capturable steps, then eager decode and pass-KV extension, MLA head dims",
         "chunks": [("prefill", 12, zig), ("static", 5), ("decode", 1), ("prefill", 6, zig), ("static", 2)],
         "max_len": 48, "windows": {0: 4}, "batch": 2, "starts": (2, 0), "sinks": True, "value_head_dim": 4,
         "passes": "kv"},
    ]
    if world == 2:
        specs.append({"label": "sliding windows evict: live rows stay at the window, storage stops growing",
                      "chunks": [("prefill", 40, zig)] + [("decode", 1)] * 160, "windows": {0: 4, 1: 4},
                      "evicts": 4})
    if world == 4:
        fills = [_fill("allgather"), _fill("ulysses", "contiguous"), _fill("usp", "zigzag"), _fill("tokenring"),
                 _fill("tasp"), _fill("double_ring", node_size=2)]
        for f in fills:
            specs.append({"label": f"{f['method']} fills, then decode and pass-Q extension",
                          "chunks": [("prefill", 14, f), ("decode", 2), ("prefill", 5, f), ("decode", 1)],
                          "passes": "q", "windows": {1: 7}, "batch": 2, "starts": (0, 2),
                          "ulysses": 2 if f["method"] == "usp" else None})
    return specs


def _generate_specs(world: int) -> list[dict]:
    """Generation cases at ``world`` ranks (together: every family, batch 1 and 2 with left padding, prefills
    the layout divides (S - 1 = 16 at W = 4, 8; 24 at W = 3) and does not, chunked prefill, second turns by
    pass-KV, pass-Q and the bytes rule, greedy and seeded sampling, 1D and 2D meshes)."""
    return {
        1: [{"family": "llama", "seq": 13},
            {"family": "mistral", "seq": 23, "batch": 2, "pad": (0, 4), "chunk": 7, "sample": True, "sample_seed": 3}],
        2: [{"family": "qwen3", "seq": 17, "chunk": 6, "passes": "q", "turns": (5,)},
            {"family": "llama", "seq": 19, "sample": True, "turns": (4,), "passes": "kv", "batch": 2, "pad": (3, 0)},
            {"family": "gpt_oss", "seq": 15, "chunk": 8, "oracle": "float32"}],   # its experts have no fp64 path
        3: [{"family": "mistral", "seq": 25, "batch": 2, "pad": (0, 4), "new": 7},
            {"family": "llama", "seq": 14, "chunk": 5, "turns": (6,)}],
        4: [{"family": "qwen3", "seq": 17, "method": "usp", "layout": "zigzag", "ulysses": 2, "batch": 2,
             "pad": (0, 5)},
            {"family": "llama", "seq": 15, "method": "ulysses", "layout": "contiguous", "turns": (3,)}],
        8: [{"family": "llama", "seq": 21, "chunk": 9, "sample": True, "batch": 2, "pad": (2, 0)},
            {"family": "mistral", "seq": 17, "turns": (6,)}],
    }[world]


# -- parent-side oracles -------------------------------------------------------------------------------------


def _cache_truth(spec: dict) -> list[torch.Tensor]:
    """Per layer, dense causal attention over the whole sequence, fp64, per row with its start and the sinks."""
    total = sum(n for _, n, *_ in spec["chunks"])
    starts = spec.get("starts") or (0,) * spec.get("batch", 1)
    truth = []
    for layer, d in enumerate(cache_inputs(spec, total)):
        w = spec.get("windows", {}).get(layer, -1)
        rows = []
        for b, s in enumerate(starts):
            r = dense_attention(d["q"][b:b + 1], d["k"][b:b + 1], d["v"][b:b + 1], causal=True,
                                window=(w, 0) if w >= 0 else (-1, -1), cu_seqlens=(0, s, total) if s else None)
            out, lse = r["out"], r["lse"]
            if spec.get("sinks"):
                both = torch.logaddexp(lse, d["sinks"].double().view(1, -1, 1))
                out = out * torch.exp(lse - both).transpose(1, 2).unsqueeze(-1)
            rows.append(out)
        truth.append(torch.cat(rows))
    return truth


def _check_cache(spec: dict, per_rank: list[dict]) -> list[str]:
    """Every rank's rows of every layer against the oracle; replicated rows must agree bitwise across ranks."""
    problems = []
    for layer, want in enumerate(_cache_truth(spec)):
        got = torch.full_like(want, float("nan"))
        for res in per_rank:
            pos, out = res["out"][layer]
            got[:, pos] = out.double()
        err = rel_error(got, want)
        if not err <= CACHE_TOL:
            problems.append(f"{spec['label']} (W={len(per_rank)}): layer {layer} error {err:.2e}")
    if "evicts" in spec:                 # every layer keeps exactly the last w positions, over all ranks
        live = sum(res["memory"]["rows"] for res in per_rank)
        row_bytes = 2 * spec.get("kv_heads", 2) * spec.get("head_dim", 8) * 8 * spec.get("layers", 2)
        unevicted = max(res["appended"] for res in per_rank) * row_bytes
        if live != spec.get("layers", 2) * spec["evicts"] or any(res["memory"]["allocated"] >= unevicted
                                                                 for res in per_rank):
            problems.append(f"{spec['label']}: {live} live rows, allocated "
                            f"{[res['memory']['allocated'] for res in per_rank]} B against {unevicted} B unevicted")
    return problems


@functools.cache
def _reference_of(key: str) -> list[dict]:
    return _reference(json.loads(key))


def _reference(spec: dict) -> list[dict]:
    """One process: ``model.generate`` in fp32 (tokens) and the fp64 model's logits along the same tokens (the
    fp32 model's where ``spec["oracle"]`` says so)."""
    model, model64 = build(spec["family"]), build(spec["family"], getattr(torch, spec.get("oracle", "float64")))
    ids, mask = prompt(spec)
    turns = []
    for t in range(1 + len(spec.get("turns", ()))):
        if t:
            extra = torch.randint(1, 64, (ids.shape[0], spec["turns"][t - 1]),
                                  generator=torch.Generator().manual_seed(100 + t))
            ids = torch.cat([turns[-1]["sequences"], extra], 1)
            mask = torch.cat([mask, torch.ones_like(ids[:, mask.shape[1]:])], 1)
        torch.manual_seed(spec.get("sample_seed", 0))
        res = model.generate(ids, attention_mask=mask, max_new_tokens=spec.get("new", 5),
                             do_sample=spec.get("sample", False), return_dict_in_generate=True, output_logits=True)
        turns.append({"sequences": res.sequences, "prompt": ids.shape[1], "mask": mask})
    for turn in turns:
        seq = turn["sequences"]
        full = torch.cat([turn["mask"], torch.ones_like(seq[:, turn["mask"].shape[1]:])], 1)
        pos = (full.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model64(input_ids=seq, attention_mask=full, position_ids=pos).logits
        turn["logits64"] = logits[:, turn["prompt"] - 1:-1]
    return turns


def _check_generate(spec: dict, per_rank: list[dict]) -> list[str]:
    problems = []
    label = f"{spec} (W={len(per_rank)})"
    for t, ref in enumerate(_reference_of(json.dumps(spec, sort_keys=True))):
        mine = per_rank[0]["turns"][t]
        if not all(torch.equal(r["turns"][t]["sequences"], mine["sequences"]) and
                   torch.equal(r["turns"][t]["logits"], mine["logits"]) for r in per_rank):
            problems.append(f"{label} turn {t}: ranks disagree")
        if not torch.equal(mine["sequences"], ref["sequences"]):
            problems.append(f"{label} turn {t}: tokens {mine['sequences'].tolist()} != {ref['sequences'].tolist()}")
            continue
        err = rel_error(mine["logits"], ref["logits64"])
        if not err <= LOGIT_TOL:
            problems.append(f"{label} turn {t}: logits error {err:.2e} against fp64")
    return problems


# -- multi-process -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_cache_and_generate_match_one_process(pools, world):
    """All cases of one world size in one pool call: the cache against the oracle, generate against one process."""
    cspecs, gspecs = _cache_specs(world), _generate_specs(world)
    results = pools(world).run(_run_all, cspecs, gspecs, world in (1, 2), world == 1, world == 2)
    problems = []
    for i, spec in enumerate(cspecs):
        problems += _check_cache(spec, [r[0][i] for r in results])
    for i, spec in enumerate(gspecs):
        problems += _check_generate(spec, [r[1][i] for r in results])
    if results[0][2]:                    # the benchmark's paths: eager and static decode give the same tokens
        runs = [rec for rec in results[0][2] if rec["kind"] == "seqpar"]
        if len({str(rec["tokens"]) for rec in runs}) != 1 or len(runs) != 2:
            problems.append(f"benchmark (W={world}): eager and static decode differ: {runs}")
    for r, res in enumerate(results):
        problems += _check_errors(res[3], r, world)
    assert not problems, "\n".join(problems)


def _run_all(cspecs: list[dict], gspecs: list[dict], bench: bool, baseline: bool, errors: bool
             ) -> tuple[list, list, list, list]:
    return (cache_run(cspecs), generate_run(gspecs), bench_run(baseline) if bench else [],
            cache_errors() if errors else [])


# what each misuse in ``cache_errors`` must raise, on every rank, naming the rank
ERRORS = [
    ("ValueError", ["must hold a prompt before decoding"]),
    ("ValueError", ["k must have batch 1 and", "tokens (this rank's rows of the chunk), got shape (1, 3, 2, 8)"]),
    ("RuntimeError", ["every layer must store and attend the open chunk", "layers [1] missing of 2"]),
    ("ValueError", ["window_size of layer 0 must stay (-1, 0)", "got (3, 0)"]),
    ("ValueError", ["a static cache holds 4 rows per rank", "give a larger max_len"]),
    ("NotImplementedError", ["beam search is not supported", "num_beams=2"]),
    ("NotImplementedError", ["attention_mask must be left padding", "row 0: [1, 1, 1, 1, 0, 0]"]),
    ("ValueError", ["passes must be 'auto', 'kv' or 'q', got 'x'"]),
    ("ValueError", ["starts must be 1 non-negative ints (one per batch row), got (0, 1)"]),
    ("ValueError", ["give the cache as past_key_values or as cache, not both"]),
    ("NotImplementedError", ["attention_mask must be the left padding the cache was filled with",
                             "rows start at (0,)", "shape (1, 6)"]),
]


def _check_errors(got: list[tuple[str, str]], rank: int, world: int) -> list[str]:
    problems = []
    for (etype, fragments), (name, msg) in zip(ERRORS, got):
        if name != etype or any(f not in msg for f in fragments) or f"(rank {rank} of {world})" not in msg:
            problems.append(f"rank {rank}: expected {etype} with {fragments}, got {name}: {msg}")
    return problems


# -- single process ------------------------------------------------------------------------------------------


def test_generate_prefills_at_the_first_forward(pools):
    """Note [Prefill at the first forward]: ``model.generate`` is entered with the prompt promised, not stored
    (transformers' set-up then syncs on an idle GPU); the model's first forward - its pre-hook registered after
    seqpar's - finds the prompt stored; the lengths transformers reads count the promise; the tokens are the
    model's own."""
    res = pools(1).run(prefill_timing)[0]
    assert res["entry"] == (0, 11, 11), res            # 12 prompt tokens: 11 promised, none stored yet
    assert res["forward"] == (11, 0), res
    assert res["after"] == (14, 0) and res["equal"], res


@pytest.mark.parametrize("world", [1, 2])
def test_prefill_skips_only_the_last_layers_attention(pools, world):
    """Note [The prefill's dead attention]: a 13-token prompt in chunks of 5 (3 prefill chunks: 12 tokens) then 3
    decode steps; the last layer skips its attention in each prefill chunk and computes it in every decode step;
    the cache's keys/values and the tokens equal those of a prefill that computes every layer's attention."""
    for res in pools(world).run(dead_layer_prefill):
        last = res["layers"] - 1
        assert res["kv_equal"] and res["tokens_equal"], res
        assert res["calls"][f"{last}:skipped"] == 3 and res["calls"][f"{last}:out"] == 3, res
        assert all(res["calls"][f"{i}:out"] == 6 and f"{i}:skipped" not in res["calls"] for i in range(last)), res


def test_rank_rows_bookkeeping():
    """Pieces grow by appending; lookups by position; groups of one stride each (Note [Pieces and segments])."""
    rows = RankRows()
    rows.append([0, 1, 2, 3, 12, 13, 14, 15])          # a zigzag prefill: two stride-1 runs
    rows.append([17])                                   # decode tokens, round-robin over W = 4
    rows.append([21])
    rows.append([25])
    rows.append([26, 27])                               # an extension chunk
    assert rows.positions() == [0, 1, 2, 3, 12, 13, 14, 15, 17, 21, 25, 26, 27]
    assert [rows.first_row_at(p) for p in (0, 3, 4, 12, 16, 18, 25, 28)] == [0, 3, 4, 4, 8, 9, 10, 13]
    groups = rows.segment_groups(2)
    assert [(off, seg.stride, seg.positions()) for off, seg in groups] == [
        (0, 1, [2, 3, 12, 13, 14, 15]), (6, 4, [17, 21, 25]), (9, 1, [26, 27])]
    with pytest.raises(ValueError, match="must follow"):
        rows.append([27])


@pytest.mark.parametrize("window", [-1, 3])
def test_pair_tasks_cover_dense_visibility(window):
    """Queries at stride 1 against a slice of mixed strides: the tasks show exactly the dense causal mask."""
    rows = RankRows()
    rows.append([0, 1, 2, 3, 8, 9])
    for p in (11, 15, 19):
        rows.append([p])
    q = Segments((Run(0, 4, 4), Run(4, 16, 6)), 1)
    rule = Rule(causal=True, window=(window, 0))
    for group in (RowGroup(0, None), RowGroup(2, (1,))):
        groups = rows.segment_groups(0)
        tasks = pair_tasks(q, groups, rule, group.bounds(22))
        k_pos = rows.positions()
        docs = [[1 if group.start and p >= group.start else 0 for p in ps] for ps in (q.positions(), k_pos)]
        want = visible_dense(q.positions(), k_pos, rule, *docs)
        got = [[False] * len(k_pos) for _ in q.positions()]
        for t in tasks:
            lo, hi = t.mask.lo, t.mask.hi
            for i in range(t.rows):
                for j in range(t.cols):
                    if (lo is None or j - i >= lo) and (hi is None or j - i <= hi):
                        assert not got[t.q_start + i][t.k_start + j], "a pair is covered twice"
                        got[t.q_start + i][t.k_start + j] = True
        assert got == want


def test_extend_pass_rule():
    """Pass-KV for a first long prompt, pass-Q for a short chunk after a long context; the reason says why."""
    long = choose_extend_pass(batch=1, new_tokens=131072, cached_tokens=131072, world=8, heads=32, kv_heads=8,
                              head_dim=128)
    short = choose_extend_pass(batch=1, new_tokens=4096, cached_tokens=135168, world=8, heads=32, kv_heads=8,
                               head_dim=128)
    assert long.choice == "kv" and short.choice == "q"
    assert "pass-KV" in long.reason and "100.0%" in long.reason and "above" in long.reason
    assert "pass-Q" in short.reason and "below" in short.reason and short.q_bytes < short.kv_bytes
    plan = plan_inference(context=1 << 20, new_tokens=4096, world=8, layers=32, heads=32, kv_heads=8, head_dim=128)
    assert plan.kv_bytes_per_rank == 2 * 32 * (1 << 17) * 8 * 128 * 2          # Llama-3-8B shape: 16 GiB / rank
    assert plan.decode_bytes_per_layer == 8 * 32 * 129 * 4 and plan.extend.choice == "q"
    assert "16.00 GiB per rank" in str(plan) and "pass-Q" in str(plan)


def test_slot_mask_step_equals_band_kernel():
    """The device-masked path (static decode) equals the registry's kernel on the visible rows, GQA, fp64."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 6, 8, generator=g, dtype=torch.float64)
    k_SBHD = torch.randn(10, 2, 2, 8, generator=g, dtype=torch.float64)
    v_SBHD = torch.randn(10, 2, 2, 5, generator=g, dtype=torch.float64)
    visible = torch.zeros(2, 10, dtype=torch.bool)
    visible[0, 2:7] = True
    visible[1, 4:9] = True
    out, lse = attend_block(q, k_SBHD.transpose(0, 1), v_SBHD.transpose(0, 1), SlotMask(visible), 0.3, "auto")
    for b, (a, z) in enumerate(((2, 7), (4, 9))):
        want = attend_block(q[b:b + 1], k_SBHD[a:z, b:b + 1].transpose(0, 1), v_SBHD[a:z, b:b + 1].transpose(0, 1),
                            Band(), 0.3, "reference")
        assert rel_error(out[b:b + 1], want.out) < 1e-14 and rel_error(lse[b:b + 1], want.lse) < 1e-14
    none = attend_block(q, k_SBHD.transpose(0, 1), v_SBHD.transpose(0, 1), SlotMask(visible & False), 0.3, "auto")
    assert torch.equal(none.out, torch.zeros_like(none.out)) and torch.isneginf(none.lse).all()
    with pytest.raises(ValueError, match="slot mask"):
        attend_block(q, k_SBHD.transpose(0, 1), v_SBHD.transpose(0, 1), SlotMask(visible), 0.3, "flash")


@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_split_keys_decode_equals_one_call(monkeypatch, kernel):
    """Note [Split keys for decode]: a long batch-1 slice in key chunks (a tail included) merges to one call's
    result; GQA, Dv != D, the cache's sequence-major views, fp64."""
    from seqpar.inference import _local

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 6, 8, generator=g, dtype=torch.float64)
    k_SBHD = torch.randn(19, 1, 2, 8, generator=g, dtype=torch.float64)
    v_SBHD = torch.randn(19, 1, 2, 5, generator=g, dtype=torch.float64)
    k, v = k_SBHD.transpose(0, 1), v_SBHD.transpose(0, 1)
    want = attend_block(q, k, v, Band(), 0.3, kernel)
    monkeypatch.setattr(_local, "SPLIT_KEYS", 4)                    # 4 chunks of 4 keys and a tail of 3
    got = attend_block(q, k, v, Band(), 0.3, kernel)
    assert rel_error(got.out, want.out) < 1e-14 and rel_error(got.lse, want.lse) < 1e-14
