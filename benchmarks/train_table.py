"""How long can I train: the training recipe's records as tables, a memory plot, and a memory budget model.

    python benchmarks/train_table.py                                  # every train*.jsonl under benchmarks/results
    python benchmarks/train_table.py r8b.jsonl --svg mem.svg          # given files; the plot where asked
    python benchmarks/train_table.py --json model.json                # the budget model's numbers as JSON

Reads what ``examples/train_long_context.py`` writes: its recipe records (``--json``: one per run, per search try
and per search) and its run logs (``--out``: a header with the config, one line per step, a summary). Prints one
markdown table per model and GPU count (rank 0 of W on one GPU is labelled "emulated"), then the budget model
(Note [Memory budget model]). ``--svg`` draws peak GPU memory against sequence length, measured points and the
model's lines, as SVG text written here (no plotting package). README.md's "How long can I train" is made
from it; ``tests/test_train_table.py`` runs it on the committed records.

Note [Memory budget model]
    Inputs, all read from records of one model at one W (default Llama-3-8B, rank 0 of 8 emulated, a
    memory-lean recipe: tiled MLP, offloaded layer inputs, tiled loss, FSDP2, AdamW, no kept attention outputs;
    one model per recipe, newest first: with tiled norms and the states on the host, with tiled norms, plain;
    runs whose offload ran out of host budget are left out, since they kept tensors on the GPU):
    peak GPU memory (max allocated) and host peak (max RSS) at two or more lengths, a full step and/or a
    sliding-window probe (the same tensors; the probe's attention kernel differs, FA2 for windows against cuDNN
    for causal, so its working set may too). A least-squares line through them gives, per rank:
        gpu(S) = gpu_fixed + gpu_per_token x L        host(S) = host_fixed + host_per_token x L,  L = S / W
    (L: local tokens). What the lines do not see, added from the model's shape (P parameters):
      - AdamW's states, 8 bytes per parameter per rank (2 x fp32, P / W each): allocated at the first optimizer
        step, after that step's backward peak, so a one-step peak leaves them out; every later step holds them
        ("steady"; ``--warmup`` records include them);
      - kept attention outputs (``--keep-attention``): layers x (heads x head_dim x 2 + heads x 4) bytes per local
        token (bf16 out, fp32 lse), held from each layer's forward to its backward;
      - another W: FSDP2 shards fp32 parameters and gradients (8 bytes per parameter) over W, so
        gpu_fixed(W) = (gpu_fixed(W0) - 8 P / W0) + 8 P / W; the per-token slopes are per local token and kept.
        At W = 1 an 8B's 16 bytes per parameter of fp32 state (120 GiB) cannot sit on an 80 GiB GPU: the model
        puts fp32 parameters, gradients and AdamW on the host (ZeRO-Offload style, ALST's setting) and bf16
        parameters and gradients (4 bytes per parameter) on the GPU. A recipe measured with the states on the
        host (``--offload-states``: FSDP2's CPUOffloadPolicy, Note [States on the host] in the example) needs no
        such guess: its GPU line holds the layers in use at any W, and only the host's 16 bytes per parameter / W
        move with W.
    A length fits when both lines stay under 95% of the device's memory (GPU total, host total): the projected
    maximum is the smaller of the two crossings, and the bound says which. It is a line through few points, not a
    simulation: the kernels' workspaces, the allocator's fragmentation (reserved above allocated) and what a
    different W changes in attention's buffers (a ring's peer buffers vanish at W = 1) are not in it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GIB = 2**30
HEADROOM = 0.95
"""Fraction of a device's memory the model lets a run use (the example's ``budget_model`` uses the same)."""
PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100 SXM (and H200) for MFU where a record does not say."""


@dataclass(frozen=True)
class Shape:
    """What the budget model needs of a model's architecture."""

    name: str
    params: int
    layers: int
    heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    def kept_bytes_per_token(self) -> int:
        """Kept attention output and lse per local token over all layers (bf16 out, fp32 lse)."""
        return self.layers * (self.heads * self.head_dim * 2 + self.heads * 4)


SHAPES = {
    "llama3-8b": Shape("Llama-3-8B", 8_030_261_248, 32, 32, 128, 4096, 14336, 128256),
    "llama-323m": Shape("323M Llama", 323_494_912, 4, 8, 128, 1024, 4096, 128256),
    "tiny": Shape("tiny Llama", 24_736, 2, 4, 8, 32, 64, 96),
}
"""The example's model shapes (``examples/train_long_context.py`` MODELS), by the name records carry."""


@dataclass(frozen=True)
class Row:
    """One measured run (or probe) at one length."""

    model: str
    world: int
    emulated: bool
    seq_len: int
    fits: bool
    peak_gib: float | None
    host_gib: float | None = None
    step_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    steady: bool = False
    """Timed after the first step, or after ``--warmup``: no pinning, optimizer states in the peak."""
    keep_gib: float | None = None
    """Kept attention outputs: GiB held by the step (None: the option was off)."""
    probe: str | None = None
    device: str = ""
    source: str = ""
    bound: str | None = None
    gpu_total_gib: float | None = None
    host_total_gib: float | None = None
    tile_norms: bool = False
    """The recipe tiled its RMSNorms (``--tile-norms``, Note [Tiled norms]): a smaller working set per token."""
    host_refused: bool = False
    """The offload's host budget was spent: some saved tensors stayed on the GPU (not a point of the lines)."""
    offload_states: bool = False
    """fp32 parameter shards, gradients and AdamW's states in host memory (``--offload-states``)."""
    offload_state_layers: int | None = None
    """With offload_states: only the root's and this many decoder layers' states on the host (None: all); such a
    split recipe is in the tables but not in the budget model's lines."""


# --------------------------------------------------------------------------------------------------------------
# reading records


def train_files(root: Path = RESULTS) -> list[Path]:
    """The committed training records: every ``train*.jsonl`` under ``root``."""
    return sorted(root.rglob("train*.jsonl"))


def load_rows(paths: Iterable[Path]) -> list[Row]:
    """Rows of every recipe record and every run log in ``paths`` (searches' summaries repeat their best try and
    are skipped; a run log without steps is skipped)."""
    rows: list[Row] = []
    for path in paths:
        recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        source = _short(Path(path))
        rows += [_recipe_row(r, source) for r in recs if _is_recipe(r) and not r.get("search")]
        rows += _run_rows(recs, source)
    seen, unique = set(), []
    for r in rows:
        key = (r.model, r.world, r.emulated, r.seq_len, r.peak_gib, r.step_s, r.probe, r.source)
        if key not in seen:
            seen.add(key)
            unique.append(r)
    return unique


def _is_recipe(rec: dict[str, Any]) -> bool:
    return {"model", "seq_len", "world", "emulated", "fits", "peak_gib"} <= set(rec)


def _recipe_row(rec: dict[str, Any], source: str) -> Row:
    keep = rec.get("keep_stats") or {}
    return Row(model=rec["model"], world=rec["world"], emulated=bool(rec["emulated"]), seq_len=rec["seq_len"],
               fits=bool(rec["fits"]), peak_gib=rec["peak_gib"], host_gib=rec.get("host_peak_gib"),
               step_s=rec.get("step_s"), tokens_per_s_per_gpu=rec.get("tokens_per_s_per_gpu"), mfu=rec.get("mfu"),
               steady=bool(rec.get("steady_state", not rec.get("first_step_only", True))),
               keep_gib=keep.get("kept_bytes", 0) / GIB if rec.get("keep_attention") else None,
               probe=rec.get("probe"), device=rec.get("device", ""), source=source, bound=rec.get("bound"),
               gpu_total_gib=rec.get("gpu_total_gib"), host_total_gib=rec.get("host_total_gib"),
               tile_norms=bool(rec.get("tile_norms")),
               host_refused=bool((rec.get("offload_stats") or {}).get("host_refused_bytes")),
               offload_states=bool(rec.get("offload_states")), offload_state_layers=rec.get("offload_state_layers"))


def _run_rows(recs: list[dict[str, Any]], source: str) -> list[Row]:
    """Rows of run logs (``--out``): a header with ``config``, its steps, its summary; one row per header."""
    rows, i = [], 0
    while i < len(recs):
        head = recs[i]
        i += 1
        if "config" not in head:
            continue
        steps = []
        while i < len(recs) and "config" not in recs[i]:
            if "step" in recs[i]:
                steps.append(recs[i])
            i += 1
        if not steps or "step_time_s" not in steps[0]:
            continue
        cfg = head["config"]
        timed = steps[1:] or steps
        step_s = sorted(s["step_time_s"] for s in timed)[len(timed) // 2]
        world = head["world"]
        tokens = cfg["seq_len"] * cfg.get("batch", 1) * cfg.get("dp", 1)
        rows.append(Row(model=cfg.get("model") or _model_name(cfg), world=world, emulated=False,
                        seq_len=cfg["seq_len"], fits=True, peak_gib=max(max(s["peak_mem_gib"]) for s in steps),
                        step_s=step_s, tokens_per_s_per_gpu=tokens / step_s / world,
                        mfu=model_flops(cfg, world) / step_s / (PEAK_TFLOPS * 1e12), steady=len(steps) > 1,
                        device=head.get("device", ""), source=source))
    return rows


def _model_name(cfg: dict[str, Any]) -> str:
    for name, s in SHAPES.items():
        if (s.hidden, s.layers, s.intermediate) == (cfg["hidden"], cfg["layers"], cfg["intermediate"]):
            return name
    return f"hidden {cfg['hidden']} x {cfg['layers']} layers"


def model_flops(cfg: dict[str, Any], world: int) -> float:
    """Model FLOPs of one step on one rank, as ``examples/train_long_context.py`` counts them (6 x matmul
    parameters x local tokens, plus causal attention; no recompute)."""
    qo = 2 * cfg["hidden"] * cfg["heads"] * cfg["head_dim"]
    kv = 2 * cfg["hidden"] * cfg["kv_heads"] * cfg["head_dim"]
    matmul = cfg["layers"] * (qo + kv + 3 * cfg["hidden"] * cfg["intermediate"]) + cfg["vocab"] * cfg["hidden"]
    sp = world // cfg.get("dp", 1)
    B, S = cfg.get("batch", 1), cfg["seq_len"]
    return 6 * matmul * S * B / sp + 6 * B * S**2 * cfg["heads"] * cfg["head_dim"] * cfg["layers"] / sp


def _short(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(RESULTS))
    except ValueError:
        return path.name


# --------------------------------------------------------------------------------------------------------------
# tables


def tables(rows: Sequence[Row]) -> str:
    """One markdown table per (model, W, emulated), longest models first, rows by length."""
    out = []
    groups: dict[tuple[str, int, bool], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.world, r.emulated), []).append(r)
    order = sorted(groups, key=lambda k: (-_params(k[0]), k[1], k[2]))
    for model, world, emulated in order:
        group = sorted(groups[(model, world, emulated)], key=lambda r: (r.seq_len, r.probe is not None))
        shape = SHAPES.get(model)
        title = shape.name if shape else model
        params = f", {shape.params / 1e9:.2f}B parameters" if shape and shape.params else ""
        where = (f"one {_gpu(group)}: a fake group of one, nothing emulated" if emulated and world == 1
                 else f"**emulated**: rank 0 of {world} on one {_gpu(group)}" if emulated
                 else f"{world} x {_gpu(group)}")
        out.append(f"### {title}{params}, W = {world} ({where})\n")
        out.append("| tokens | per GPU | fits | peak GPU GiB | host peak GiB | step s | tokens/s/GPU | MFU | "
                   "timed | kept attention | recipe | source |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in group:
            what = r.probe and f"probe ({r.probe})"
            timed = "-" if r.step_s is None else ("steady state" if r.steady else "first step")
            keep = "-" if r.keep_gib is None else f"{r.keep_gib:.1f} GiB"
            step_digits = 2 if r.step_s is not None and r.step_s < 10 else 1
            fits = "yes" if r.fits else f"no ({r.bound or '?'})"
            out.append(f"| {tokens_text(r.seq_len)}{' ' + what if what else ''} | {tokens_text(r.seq_len // world)} | "
                       f"{fits} | {_num(r.peak_gib, 1)} | {_num(r.host_gib, 1)} | {_num(r.step_s, step_digits)} | "
                       f"{_num(r.tokens_per_s_per_gpu, 0)} | {_pct(r.mfu)} | {timed} | {keep} | "
                       f"{_recipe(r)} | `{r.source}` |")
        out.append("")
    return "\n".join(out)


def _recipe(r: Row) -> str:
    parts = ["tiled norms"] * r.tile_norms + ["states on host"] * r.offload_states
    if r.offload_states and r.offload_state_layers is not None:
        parts[-1] += f" (root + {r.offload_state_layers} of {SHAPES[r.model].layers} layers)"
    return ", ".join(parts) or "-"


def _params(model: str) -> int:
    return SHAPES[model].params if model in SHAPES else 0


def _gpu(group: Sequence[Row]) -> str:
    dev = next((r.device for r in group if r.device), "GPU")
    return dev.replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def tokens_text(n: int) -> str:
    """1048576 -> 1M, 131072 -> 128K, 1572864 -> 1.5M (binary units)."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size:
            v = n / size
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return str(n)


# --------------------------------------------------------------------------------------------------------------
# the budget model (Note [Memory budget model])


@dataclass(frozen=True)
class Fit:
    """The lines through the measured points of one model at one W (per rank, GiB and GiB per local token)."""

    model: str
    world: int
    seq_lens: tuple[int, ...]
    gpu_fixed: float
    gpu_per_token: float
    host_fixed: float
    host_per_token: float
    gpu_total: float
    host_total: float
    tile_norms: bool = False
    offload_states: bool = False


@dataclass(frozen=True)
class Machine:
    name: str
    gpu_gib: float
    host_gib: float


@dataclass(frozen=True)
class Scenario:
    """One projection: a machine, a W, where the optimizer's states live, what is kept."""

    label: str
    world: int
    machine: Machine
    steady: bool = True
    """AdamW's states exist (every step after the first)."""
    keep_attention: bool = False
    """Attention outputs kept (``--keep-attention``), up to ``keep_gib``."""
    keep_gib: float = math.inf
    """The kept outputs' budget (``--keep-attention-gib``; inf: every layer's)."""
    states_on_host: bool = False
    """fp32 parameters, gradients and AdamW on the host; bf16 parameters and gradients on the GPU."""
    plot: str = ""
    """The plot legend's label (drawn when set)."""


def recipes(rows: Sequence[Row], model: str = "llama3-8b", world: int = 8) -> list[tuple[bool, bool]]:
    """The memory-lean recipes of ``model`` at ``world`` with records, newest first, as ``(tile_norms,
    offload_states)``."""
    have = {(r.tile_norms, r.offload_states) for r in rows
            if r.model == model and r.world == world and r.offload_state_layers is None}
    return [k for k in ((True, True), (True, False), (False, True), (False, False)) if k in have]


def fit(rows: Sequence[Row], model: str = "llama3-8b", world: int = 8, tile_norms: bool | None = None,
        offload_states: bool | None = None) -> Fit:
    """Least-squares lines of peak GPU and host memory per local token, from the memory-lean recipe's fitting
    records of ``model`` at ``world`` (one per length: the full step over a probe; a steady-state record less its
    AdamW states, so the line is a first step's, as measured first; not a run whose offload ran out of host budget,
    which kept tensors on the GPU). ``tile_norms``, ``offload_states``: which recipe (None: the newest with
    records, ``recipes``). With the states on the host the GPU line is the steady state's as measured."""
    if model not in SHAPES:
        raise ValueError(f"the budget model knows the shapes {sorted(SHAPES)}, got model={model!r}")
    have = recipes(rows, model, world)
    newest = have[0] if have else (False, False)
    tile_norms = newest[0] if tile_norms is None else tile_norms
    offload_states = newest[1] if offload_states is None else offload_states
    pts: dict[int, Row] = {}
    for r in rows:
        if (r.model == model and r.world == world and r.fits and r.peak_gib is not None and r.keep_gib is None
                and r.tile_norms == tile_norms and r.offload_states == offload_states and not r.host_refused
                and r.offload_state_layers is None):
            if r.seq_len not in pts or (pts[r.seq_len].probe is not None and r.probe is None):
                pts[r.seq_len] = r
    if len(pts) < 2:
        raise ValueError(f"the budget model needs fitting records of {model} at W = {world} at two lengths at "
                         f"least, got {sorted(pts)}")
    lens = sorted(pts)
    xs = [n / world for n in lens]
    states = 8 * SHAPES[model].params / GIB / world          # a steady row's AdamW states: the line is one step's
    if offload_states:
        states = 0.0                                          # ... unless they live on the host
    g0, g1 = _line(xs, [pts[n].peak_gib - (states if pts[n].steady else 0.0) for n in lens])
    hosts = [pts[n].host_gib for n in lens]
    h0, h1 = _line(xs, hosts) if None not in hosts else (math.nan, math.nan)
    host_total = next((pts[n].host_total_gib for n in lens if pts[n].host_total_gib), None)
    gpu_total = next((pts[n].gpu_total_gib for n in lens if pts[n].gpu_total_gib), host_total)   # CPU: RSS
    if gpu_total is None or host_total is None:
        raise ValueError(f"the budget model needs the device totals (gpu_total_gib, host_total_gib) in the records "
                         f"of {model} at W = {world}")
    return Fit(model, world, tuple(lens), g0, g1, h0, h1, gpu_total=gpu_total, host_total=host_total,
               tile_norms=tile_norms, offload_states=offload_states)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def project(f: Fit, s: Scenario) -> dict[str, Any]:
    """The lines of scenario ``s`` (fixed GiB and GiB per 1M global tokens, GPU and host) and the longest sequence
    that fits, with the bound."""
    shape = SHAPES[f.model]
    state = shape.params / GIB                                   # GiB per byte per parameter
    gpu_fixed = f.gpu_fixed - 8 * state / f.world                # the fp32 parameter and gradient shards out ...
    host_fixed = f.host_fixed
    if f.offload_states:                                         # measured so: the GPU holds the layers in use
        gpu_fixed = f.gpu_fixed
        host_fixed = f.host_fixed - 16 * state / f.world + 16 * state / s.world
    elif s.states_on_host:
        gpu_fixed += 4 * state                                   # ... bf16 parameters and gradients in, whole
        host_fixed += 16 * state                                 # fp32 parameters, gradients, AdamW
    else:
        gpu_fixed += 8 * state / s.world + (8 * state / s.world if s.steady else 0.0)
    keep_tok = shape.kept_bytes_per_token() / GIB if s.keep_attention else 0.0
    per_m = 2**20 / s.world                                      # local tokens per 1M global tokens
    res = {"label": s.label, "world": s.world, "machine": s.machine.name,
           "gpu_fixed_gib": gpu_fixed, "gpu_gib_per_mtok": f.gpu_per_token * per_m,
           "kept_gib_per_mtok": keep_tok * per_m, "kept_cap_gib": None if math.isinf(s.keep_gib) else s.keep_gib,
           "host_fixed_gib": host_fixed, "host_gib_per_mtok": f.host_per_token * per_m}
    by_gpu = _crossing(lambda n: gpu_at(res, n), HEADROOM * s.machine.gpu_gib)
    by_host = _crossing(lambda n: host_fixed + f.host_per_token * n / s.world, HEADROOM * s.machine.host_gib)
    res.update(max_by_gpu=by_gpu, max_by_host=by_host, max_seq_len=min(by_gpu, by_host),
               bound="gpu memory" if by_gpu <= by_host else "host memory")
    return res


def gpu_at(p: dict[str, Any], seq_len: float) -> float:
    """A projection's peak GPU GiB at ``seq_len`` global tokens (kept outputs up to their budget)."""
    m = seq_len / 2**20
    kept = p["kept_gib_per_mtok"] * m
    if p["kept_cap_gib"] is not None:
        kept = min(kept, p["kept_cap_gib"])
    return p["gpu_fixed_gib"] + p["gpu_gib_per_mtok"] * m + kept


def _crossing(g: Any, cap: float) -> int:
    """The largest token count n with g(n) <= cap (g increasing), 0 when even g(0) is over."""
    if g(0.0) > cap:
        return 0
    lo, hi = 0.0, float(2**40)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if g(mid) <= cap else (lo, mid)
    return int(lo)


H100_GIB = 79.18
"""An H100's memory as torch reports it: the GPU the projections are for (peaks measured on an H200 are the same
allocations)."""


def scenarios(f: Fit) -> list[Scenario]:
    """The projections of the README: this host and a 2 TB host, W = 8 and W = 1."""
    gpu = min(f.gpu_total, H100_GIB)
    here = Machine(f"{gpu:.0f} GiB GPU, {f.host_total:.0f} GiB host (measured)", gpu, f.host_total)
    big = replace(here, name=f"{gpu:.0f} GiB GPU, 2 TB host", host_gib=2000e9 / GIB)
    w = f.world
    if f.offload_states:
        return [
            Scenario(f"W = {w}, states on the host (as measured)", w, here, plot=f"W = {w}, states on host"),
            Scenario(f"W = {w}, states on the host, 2 TB host", w, big),
            Scenario("W = 1, states on the host", 1, here, plot="W = 1, states on host"),
            Scenario("W = 1, states on the host, 2 TB host", 1, big),
        ]
    return [
        Scenario(f"W = {w}, one step (as measured)", w, here, steady=False, plot=f"W = {w}, one step"),
        Scenario(f"W = {w}, steady state", w, here, plot=f"W = {w}, steady state"),
        Scenario(f"W = {w}, steady state, 28 GiB of kept attention outputs", w, here, keep_attention=True,
                 keep_gib=28.0, plot=f"W = {w}, steady, 28 GiB kept"),
        Scenario(f"W = {w}, steady state, every layer's attention output kept", w, here, keep_attention=True,
                 plot=f"W = {w}, steady, all kept"),
        Scenario(f"W = {w}, steady state, 2 TB host", w, big),
        Scenario("W = 1, states on the GPU", 1, here),
        Scenario("W = 1, fp32 states and AdamW on the host", 1, here, states_on_host=True,
                 plot="W = 1, states on host"),
        Scenario("W = 1, fp32 states and AdamW on the host, 2 TB host", 1, big, states_on_host=True),
    ]


def budget_report(f: Fit) -> tuple[str, list[dict[str, Any]]]:
    """The model's inputs and projections as markdown, and the projections."""
    shape = SHAPES[f.model]
    per_m = 2**20 / f.world
    lines = [f"### Memory budget model: {shape.name} (Note [Memory budget model] in `benchmarks/train_table.py`)\n",
             f"Fitted at W = {f.world} from {', '.join(tokens_text(n) for n in f.seq_lens)} tokens "
             f"({'tiled norms' if f.tile_norms else 'plain norms'}, "
             f"{'states on the host' if f.offload_states else 'states on the GPU'}): GPU "
             f"{f.gpu_fixed:.2f} GiB + {f.gpu_per_token * per_m:.2f} GiB per 1M tokens "
             f"({f.gpu_per_token * GIB / 1024:.0f} KiB per local token); host {f.host_fixed:.2f} GiB + "
             f"{f.host_per_token * per_m:.2f} GiB per 1M tokens ({f.host_per_token * GIB / 1024:.0f} KiB per local "
             + (f"token). Added from the shape: the host's fp32 shards, gradients and AdamW states, "
                f"{16 * shape.params / GIB / f.world:.2f} GiB per rank at W = {f.world}, are in the measured host "
                f"line; another W moves them (16 bytes per parameter / W); the GPU line holds no state to move."
                if f.offload_states else
                f"token). Added from the shape: AdamW's states {8 * shape.params / GIB / f.world:.2f} GiB per rank "
                f"at W = {f.world} (steady state), kept attention outputs {shape.kept_bytes_per_token() / 1024:.0f} "
                f"KiB per local token.")
             + f" A length fits under {HEADROOM:.0%} of each memory (the GPU: an H100's {H100_GIB} GiB).\n",
             "| scenario | machine | GPU GiB: fixed + per 1M tokens | host GiB: fixed + per 1M tokens | "
             "longest by GPU | longest by host | **longest** | bound |",
             "|---|---|---|---|---|---|---|---|"]
    res = [project(f, s) for s in scenarios(f)]
    for p in res:
        kept = ""
        if p["kept_gib_per_mtok"]:
            cap = p["kept_cap_gib"]
            kept = (f" + {p['kept_gib_per_mtok']:.1f} kept" if cap is None else
                    f" + min({cap:.0f}, {p['kept_gib_per_mtok']:.1f} x M) kept")
        gpu = f"{p['gpu_fixed_gib']:.1f} + {p['gpu_gib_per_mtok']:.1f}{kept}"
        lines.append(f"| {p['label']} | {p['machine']} | {gpu} | "
                     f"{p['host_fixed_gib']:.1f} + {p['host_gib_per_mtok']:.1f} | {_len(p['max_by_gpu'])} | "
                     f"{_len(p['max_by_host'])} | **{_len(p['max_seq_len'])}** | {p['bound']} |")
    lines.append("")
    return "\n".join(lines), res


def _len(n: int) -> str:
    if n <= 0:
        return "does not fit"
    return tokens_text(n) if n < 2**20 else f"{n / 2**20:.2f}M"


# --------------------------------------------------------------------------------------------------------------
# the plot (SVG text)

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#17becf", "#bcbd22"]
"""Measured series."""
LINE_COLORS = ["#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"]
"""The model's lines."""


def svg(rows: Sequence[Row], f: Fit | None, width: int = 900, height: int = 440) -> str:
    """Peak GPU memory (GiB) against sequence length (log2 axis): every measured row (filled: a full step;
    hollow: a probe), and the budget model's lines for W = f.world and W = 1 (dashed), the GPU's memory dotted."""
    left, right, top, bottom = 64, 330, 40, 56
    pw, ph = width - left - right, height - top - bottom
    pts = [r for r in rows if r.peak_gib is not None and r.seq_len > 0]
    lo = min([2**16, *(r.seq_len for r in pts)])
    hi = max([2**23, *(r.seq_len for r in pts)])
    x0, x1 = math.log2(lo), math.log2(hi)
    ymax = 10 * math.ceil(max([80.0, (f.gpu_total + 5) if f else 0.0, *(r.peak_gib for r in pts)]) / 10)

    def X(n: float) -> float:
        return left + pw * (math.log2(n) - x0) / (x1 - x0)

    def Y(g: float) -> float:
        return top + ph * (1 - g / ymax)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<clipPath id="plot"><rect x="{left}" y="{top}" width="{pw}" height="{ph}"/></clipPath>',
           f'<text x="{left + pw / 2}" y="22" text-anchor="middle" font-size="14">Peak GPU memory per rank against '
           f'sequence length</text>']
    for e in range(math.ceil(x0), math.floor(x1) + 1):                 # x grid and ticks: powers of two
        x = X(2**e)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{tokens_text(2**e)}</text>')
    for g in range(0, int(ymax) + 1, 10):
        y = Y(g)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e6e6e6"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{g}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 14}" text-anchor="middle">sequence length (tokens, global)'
               f'</text>')
    out.append(f'<text transform="translate(18 {top + ph / 2}) rotate(-90)" text-anchor="middle">peak GPU memory '
               f'(GiB, max allocated)</text>')
    legend: list[tuple[str, str, str]] = []                            # (kind, colour, label)
    if f is not None:
        cap = f.gpu_total
        out.append(f'<line x1="{left}" y1="{Y(cap):.1f}" x2="{left + pw}" y2="{Y(cap):.1f}" stroke="#555" '
                   f'stroke-dasharray="2 3"/>')
        legend.append(("dots", "#555", f"GPU memory ({cap:.1f} GiB)"))
        for i, s in enumerate(s for s in scenarios(f) if s.plot):
            p = project(f, s)
            colour = LINE_COLORS[i % len(LINE_COLORS)]
            poly = []
            for k in range(129):
                n = 2 ** (x0 + (x1 - x0) * k / 128)
                poly.append(f"{X(n):.1f},{Y(gpu_at(p, n)):.1f}")
            out.append(f'<polyline points="{" ".join(poly)}" fill="none" stroke="{colour}" stroke-width="1.5" '
                       f'stroke-dasharray="6 4" clip-path="url(#plot)"/>')
            legend.append(("dash", colour, f"{SHAPES[f.model].name} model: {s.plot}"))
    series: dict[tuple[str, int, bool], list[Row]] = {}
    for r in pts:
        series.setdefault((r.model, r.world, r.emulated), []).append(r)
    for i, ((model, world, emulated), group) in enumerate(sorted(series.items(), key=lambda kv: -_params(kv[0][0]))):
        colour = COLORS[i % len(COLORS)]
        for r in sorted(group, key=lambda r: r.seq_len):
            fill = "white" if r.probe else colour
            mark = "" if r.fits else ' stroke-dasharray="1 1"'
            out.append(f'<circle cx="{X(r.seq_len):.1f}" cy="{Y(r.peak_gib):.1f}" r="4.5" fill="{fill}" '
                       f'stroke="{colour}" stroke-width="1.5"{mark}><title>{_esc(_point_title(r))}</title></circle>')
        name = SHAPES[model].name if model in SHAPES else model
        legend.append(("dot", colour, f"{name}, W = {world}{' emulated' if emulated else ''}"))
    legend.append(("hollow", "#333", "hollow: sliding-window probe"))
    lx, ly = left + pw + 14, top + 6
    for j, (kind, colour, label) in enumerate(legend):
        y = ly + 18 * j
        if kind in ("dash", "dots"):
            dash = "6 4" if kind == "dash" else "2 3"
            out.append(f'<line x1="{lx}" y1="{y}" x2="{lx + 22}" y2="{y}" stroke="{colour}" stroke-width="1.5" '
                       f'stroke-dasharray="{dash}"/>')
        else:
            fill = "white" if kind == "hollow" else colour
            out.append(f'<circle cx="{lx + 11}" cy="{y}" r="4.5" fill="{fill}" stroke="{colour}" stroke-width="1.5"/>')
        out.append(f'<text x="{lx + 28}" y="{y + 4}">{_esc(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _point_title(r: Row) -> str:
    return (f"{r.model} W={r.world}{' emulated' if r.emulated else ''} {tokens_text(r.seq_len)}: "
            f"{r.peak_gib:.1f} GiB{' (' + r.probe + ')' if r.probe else ''} [{r.source}]")


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


# --------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="JSON-lines files (default: train*.jsonl under "
                    "benchmarks/results)")
    ap.add_argument("--svg", type=Path, help="write the peak-memory plot here")
    ap.add_argument("--json", type=Path, help="write the budget model (fit and projections) here")
    ap.add_argument("--model", default="llama3-8b", help="the budget model's model (records' name)")
    ap.add_argument("--world", type=int, default=8, help="the budget model's W (its records)")
    args = ap.parse_args(argv)
    rows = load_rows(args.paths or train_files())
    print("## How long can I train\n")
    print(tables(rows))
    report: dict[str, Any] = {"rows": [asdict(r) for r in rows], "fits": []}
    f: Fit | None = None
    for norms, states in recipes(rows, args.model, args.world) or [(None, None)]:
        try:
            one = fit(rows, args.model, args.world, norms, states)
        except ValueError as e:
            print(f"(no budget model: {e})\n")
            continue
        text, projections = budget_report(one)
        print(text)
        report["fits"].append({"fit": asdict(one), "projections": projections})
        if f is None:                                # the newest recipe: the plot's lines and "fit"
            f = one
            report.update(fit=asdict(one), projections=projections)
    if args.svg:
        args.svg.write_text(svg(rows, f))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
