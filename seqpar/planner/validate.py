"""Predicted vs measured: check the cost model against benchmark results.

    python -m seqpar.planner.validate benchmarks/results/h200x4.jsonl [--out validation.md] [--strict]

Reads the JSON lines ``python -m seqpar.bench`` writes (one record per preset, method, mode and world
size: ``preset, method, mode, world_size, time_ms, heads, kv_heads, seq_len, causal, head_dim, gpu,
peak_mem_gib, ...``), predicts every seqpar row with the profile that matches its GPU (or ``--profile``)
and prints the table with the relative error. Two checks (the planner issue's acceptance criteria):

- every prediction within ``--tol`` (15%) of the measurement;
- for each (preset, mode, world size), the method the planner would pick among those measured runs
  within ``--auto-tol`` (5%) of the fastest measured one (and a measured ``method="auto"`` row, if the
  file has one, likewise).

With ``--fit-file`` / ``--fit-presets`` (the fit set of ``python -m seqpar.planner.fit``), every row is
labelled FIT (its time was used to fit the profile's fixed costs) or CHECK (held out), and the summary
counts the two sets separately. The auto check groups rows by (file, preset, mode, world size): runs of
different files are not compared with each other.

Peer rows (``"peer:..."``) are listed as not modelled, and so are a named mask's rows recorded without its spec
(``mask_spec``, written since 2026-11-28: before, the mask was dropped and its rows priced as the unmasked call).
Method names follow the benchmark: "ring/zigzag",
"usp/u2r2/zigzag", "allgather/zigzag[/stride4]", "ulysses", "tokenring/zigzag", "tasp/direct[/zigzag]",
"double_ring/n2[/zigzag]".
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import methods as _methods
from ..cost.model import Candidate, Machine, Prediction, Problem
from ..cost.profile import Profile, load_profile
from ..cost.topology import Network, get_topology
from ..layouts import ALL_LAYOUT_NAMES
from ..layouts.packing import SEED, packed_row
from ..masks import from_spec
from .search import DTYPE_BYTES, predict

__all__ = ["Row", "check", "in_fit_set", "is_auto", "main", "modelled", "parse_method", "predict_record", "profile_for",
           "read_jsonl", "results"]


def parse_method(name: str, world: int, causal: bool = True) -> Candidate:
    """A benchmark method name ("usp/u2r2/zigzag", "tasp/direct", ...) as a Candidate; without a layout part,
    the method's default layout (``Method.default_layout``)."""
    method, *parts = name.split("/")
    layout, ulysses, opts = None, 1, {}
    for part in parts:
        if part in ALL_LAYOUT_NAMES:
            layout = part
        elif m := re.fullmatch(r"u(\d+)(?:r(\d+))?", part):       # "u2r2" (planner) or "u2" (benchmark)
            ulysses = int(m.group(1))
            if world % ulysses or (m.group(2) and ulysses * int(m.group(2)) != world):
                raise ValueError(f"{name!r}: ulysses x ring must equal world_size {world}")
        elif m := re.fullmatch(r"head_chunks(\d+|auto)", part):
            opts["head_chunks"] = m.group(1) if m.group(1) == "auto" else int(m.group(1))
        elif m := re.fullmatch(r"transport(nccl|copy_engine)", part):
            opts["transport"] = m.group(1)
        elif part in ("direct", "cycles"):
            opts["schedule"] = part
        elif m := re.fullmatch(r"(?:n|node|node_size)(\d+)", part):
            opts["node_size"] = int(m.group(1))
        elif m := re.fullmatch(r"(?:stride|s|hks|heads_k_stride)(\d+)", part):
            opts["heads_k_stride"] = int(m.group(1))
        else:
            raise ValueError(f"cannot read {part!r} in method name {name!r}")
    return Candidate(method, layout or _methods.get(method).default_layout(), ulysses, tuple(sorted(opts.items())))


def profile_for(record: dict[str, Any], override: Profile | None = None) -> Profile:
    """``override``; else for an emulated record the profile auto plans it with (its modelled link's, else the
    emulated one: Note [Auto on an emulated world] in ``seqpar.comm.link``); else the built-in profile for the
    record's GPU (H100 or H200)."""
    if override is not None:
        return override
    if record.get("emulated_world"):
        from ..comm.link import EMULATED_PROFILE

        return load_profile(record.get("link") or EMULATED_PROFILE)
    gpu = str(record.get("gpu", ""))
    for tag, name in (("H200", "h200-nvswitch"), ("H100", "h100-nvswitch")):
        if tag in gpu:
            return load_profile(name)
    raise ValueError(f"no built-in profile for gpu {gpu!r}; pass --profile (a calibrated JSON)")


@dataclass(frozen=True)
class Row:
    preset: str
    mode: str
    world: int
    method: str
    measured_ms: float
    predicted_ms: float | None
    error: float | None
    measured_gib: float | None
    predicted_gib: float | None
    note: str = ""
    source: str = ""
    """The benchmark file the row comes from (its name)."""
    set: str = ""
    """"fit" or "check" when the run has a fit set (``--fit-file`` / ``--fit-presets``), else ""."""


def in_fit_set(source: str | Path, rec: dict[str, Any], fit_files: Sequence[str | Path] = (),
               fit_presets: Sequence[str] = ()) -> bool:
    """Whether a record of the file ``source`` is in the fit set: every row of ``fit_files``, and the
    ``fit_presets`` of any file."""
    return Path(source).name in {Path(f).name for f in fit_files} or str(rec.get("preset", "")) in fit_presets


def is_auto(method: str) -> bool:
    """Whether a benchmark record's method is a ``method="auto"`` row ("auto", or "auto/<layout>": Note [Auto rows]
    in ``seqpar.bench``)."""
    return method.partition("/")[0] == "auto"


def modelled(rec: dict[str, Any]) -> bool:
    """Whether a record is a seqpar method the cost model predicts (not a peer, not ``auto``, not on a transport
    its method's model does not predict: ``Method.modelled_transports``)."""
    method = str(rec["method"])
    if method.startswith("peer:") or is_auto(method) or (rec.get("mask") and not rec.get("mask_spec")):
        return False
    c = parse_method(method, int(rec["world_size"]), bool(rec.get("causal", True)))
    transport, m = c.option("transport"), _methods.get(c.method)
    if transport is None:
        return True
    # a transport the method's model predicts, in a configuration it predicts (USP with no ring: not)
    return transport in m.modelled_transports and not (m.why_not and m.why_not(_problem(rec), c))


PACKED_SUITE_SHAPE = {"heads": 32, "kv_heads": 8, "head_dim": 128, "causal": True}
"""The packed suite's shape (``seqpar.bench.suites._packed_at``), for its records written before they named it."""


def packed_documents(rec: dict[str, Any]) -> tuple[int, ...] | None:
    """A packed-suite record's ``cu_seqlens``, regenerated (``seqpar.layouts.packing.packed_row``) from its
    ``distribution``, ``packing_seed`` and ``packing_multiple`` - for older records, from its row's name
    ("packed-32k-lognormal"), the suite's seed and 2 x its world size; None for a record of no packed row."""
    if not rec.get("packed"):
        return None
    dist = rec.get("distribution") or str(rec["row"]).split("-", 2)[2]
    multiple = int(rec.get("packing_multiple", 2 * int(rec["world_size"])))
    return packed_row(int(rec["seq_len"]), dist, seed=int(rec.get("packing_seed", SEED)), multiple=multiple)


def predict_record(rec: dict[str, Any], prof: Profile | None = None, kernel: str | None = None) -> Prediction:
    """The cost model's prediction for one benchmark record of a seqpar method (a packed row's with its
    documents, Note [Packed batches] in ``seqpar.cost.model``)."""
    method, W = str(rec["method"]), int(rec["world_size"])
    profile = profile_for(rec, prof)
    causal = bool(rec.get("causal", True))
    topo = get_topology(None if W <= profile.gpus_per_node else "nvswitch", profile)
    kern = kernel or rec.get("kernel") or profile.default_kernel
    return predict(_problem(rec), parse_method(method, W, causal), Machine(profile, Network(topo, profile), kern))


def _problem(rec: dict[str, Any]) -> Problem:
    """The problem a benchmark record timed (a packed row's with its documents)."""
    if rec.get("packed"):
        rec = PACKED_SUITE_SHAPE | rec
    spec = rec.get("mask_spec")
    return Problem(seq_len=int(rec["seq_len"]), heads=int(rec["heads"]),
                   kv_heads=int(rec.get("kv_heads", rec["heads"])), head_dim=int(rec.get("head_dim", 128)),
                   batch=int(rec.get("batch", 1)), world=int(rec["world_size"]), causal=bool(rec.get("causal", True)),
                   dtype_bytes=DTYPE_BYTES[str(rec.get("dtype", "bfloat16"))], documents=packed_documents(rec),
                   mask=None if spec is None else from_spec(_tuples(spec)))


def _tuples(x: Any) -> Any:
    """A mask spec read back from JSON: its lists as the tuples ``seqpar.masks.from_spec`` takes."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _predict(rec: dict[str, Any], prof: Profile | None, kernel: str | None, source: str = "",
             label: str = "") -> Row:
    method, W, mode = str(rec["method"]), int(rec["world_size"]), str(rec["mode"])
    base = dict(preset=str(rec.get("preset", "")), mode=mode, world=W, method=method,
                measured_ms=float(rec["time_ms"]), measured_gib=rec.get("peak_mem_gib"), source=source, set=label)
    if not modelled(rec):
        return Row(**base, predicted_ms=None, error=None, predicted_gib=None,
                   note="auto: checked below" if is_auto(method) else
                   "peer: not modelled" if method.startswith("peer:") else
                   "mask: its spec not recorded" if rec.get("mask") and not rec.get("mask_spec") else
                   "transport not modelled")
    pred = predict_record(rec, prof, kernel)
    t = pred.time_ms(mode)
    return Row(**base, predicted_ms=t, error=t / base["measured_ms"] - 1, predicted_gib=pred.peak_mem(mode) / 2**30)


def check(records: Sequence[dict[str, Any]], profile: Profile | None = None, kernel: str | None = None,
          tol: float = 0.15, auto_tol: float = 0.05, sources: Sequence[str] | None = None,
          sets: Sequence[str] | None = None) -> tuple[list[Row], list[dict[str, Any]], bool]:
    """(rows, auto checks, all passed) for benchmark records; ``sources`` and ``sets`` (per record: its file's
    name; "fit" / "check") label the rows."""
    sources = sources or [""] * len(records)
    sets = sets or [""] * len(records)
    rows = [_predict(r, profile, kernel, src, st) for r, src, st in zip(records, sources, sets)]
    modelled = [r for r in rows if r.error is not None]
    ok = all(abs(r.error) <= tol for r in modelled if r.error is not None)
    autos = []

    def key_of(r: Row) -> tuple[str, str, str, int]:
        return r.source, r.preset, r.mode, r.world

    for key in sorted({key_of(r) for r in modelled}, key=lambda k: k[1:] + k[:1]):
        group = [r for r in modelled if key_of(r) == key]
        best = min(group, key=lambda r: r.measured_ms)
        pick = min(group, key=lambda r: (r.predicted_ms, r.method))
        entry = {"preset": key[1], "mode": key[2], "world": key[3], "pick": pick.method,
                 "pick_ms": pick.measured_ms, "best": best.method, "best_ms": best.measured_ms,
                 "ratio": pick.measured_ms / best.measured_ms}
        if key[0] or group[0].set:
            entry.update(source=key[0], set=group[0].set)
        measured_auto = [r.measured_ms for r in rows if is_auto(r.method) and key_of(r) == key]
        if measured_auto:                  # auto on the better of the layouts it was timed on (Note [Auto rows])
            entry["auto_ms"] = min(measured_auto)
            entry["auto_ratio"] = entry["auto_ms"] / best.measured_ms
        entry["ok"] = entry["ratio"] <= 1 + auto_tol and entry.get("auto_ratio", 1.0) <= 1 + auto_tol
        ok = ok and entry["ok"]
        autos.append(entry)
    return rows, autos, ok


def render(rows: Sequence[Row], autos: Sequence[dict[str, Any]], tol: float, auto_tol: float) -> str:
    """Markdown: the per-row table, the auto checks and a summary per world size (and per set, FIT then
    CHECK, when the rows have one)."""
    split = any(r.set for r in rows)
    lead, rule = ("| set | file ", "|---|---") if split else ("", "")

    def pre(x: Row | dict[str, Any]) -> str:
        if not split:
            return ""
        src, st = (x.source, x.set) if isinstance(x, Row) else (x.get("source", ""), x.get("set", ""))
        return f"| {st.upper()} | {src} "

    out = [f"{lead}| preset | mode | W | method | measured ms | predicted ms | error | mem GiB meas/pred |",
           f"{rule}|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error is None:
            out.append(f"{pre(r)}| {r.preset} | {r.mode} | {r.world} | {r.method} | {r.measured_ms:.3f} | - | "
                       f"{r.note} | - |")
            continue
        flag = "" if abs(r.error) <= tol else " **over**"
        mem = f"{r.measured_gib:.2f}" if r.measured_gib is not None else "-"
        out.append(f"{pre(r)}| {r.preset} | {r.mode} | {r.world} | {r.method} | {r.measured_ms:.3f} | "
                   f"{r.predicted_ms:.3f} | {r.error:+.1%}{flag} | {mem} / {r.predicted_gib:.2f} |")
    out += ["", f"{lead}| preset | mode | W | planner's pick | its measured ms | best measured | ratio | auto row |",
            f"{rule}|---|---|---|---|---|---|---|---|"]
    for a in autos:
        auto = f"{a['auto_ms']:.3f} ({a['auto_ratio']:.3f})" if "auto_ms" in a else "-"
        out.append(f"{pre(a)}| {a['preset']} | {a['mode']} | {a['world']} | {a['pick']} | {a['pick_ms']:.3f} | "
                   f"{a['best']} {a['best_ms']:.3f} | {a['ratio']:.3f}{'' if a['ok'] else ' **over**'} | {auto} |")
    out.append("")
    for st in ("fit", "check") if split else ("",):
        for W in sorted({r.world for r in rows if r.error is not None and r.set == st}):
            mine = [r for r in rows if r.world == W and r.error is not None and r.set == st]
            inside = sum(abs(r.error) <= tol for r in mine if r.error is not None)
            worst = max(abs(r.error) for r in mine if r.error is not None)
            picks = [a for a in autos if a["world"] == W and a.get("set", "") == st]
            good = sum(a["ok"] for a in picks)
            out.append(f"{st.upper() + ' ' if st else ''}W={W}: {inside}/{len(mine)} predictions within {tol:.0%} "
                       f"(worst {worst:.1%}); auto within {auto_tol:.0%} of the best on {good}/{len(picks)} cases")
    return "\n".join(out)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    lines = Path(path).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


STEADY_HELP = ("time calls back to back: a record's steady_ms (emulated runs; real runs of the bench with --steady) "
               "where it has one")


def results(path: str | Path, steady: bool = False) -> list[dict[str, Any]]:
    """The timed records of a benchmark file: single-GPU limit rows and failed runs left out. ``steady``: a
    record's time is its back-to-back time (``steady_ms``: an emulated run's, or a real one's with ``--steady``) where
    it has one."""
    out = [r for r in read_jsonl(path) if not str(r.get("method", "")).startswith("limit")
           and r.get("time_ms") is not None]
    return [r | {"time_ms": r["steady_ms"]} if steady and r.get("steady_ms") else r for r in out]


def write_report(path: str, module: str, argv: Sequence[str] | None, text: str) -> None:
    """``text`` under the command line that made it (``python -m module args``), as markdown."""
    args = list(argv) if argv is not None else sys.argv[1:]
    command = " ".join([f"python -m {module}", *map(shlex.quote, args)])
    Path(path).write_text(f"`{command}`\n\n{text}\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m seqpar.planner.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="benchmark JSON lines files")
    ap.add_argument("--profile", default=None, help="profile for every row (default: built-in by GPU name)")
    ap.add_argument("--kernel", default=None, help="kernel to model (default: the record's, else the profile's)")
    ap.add_argument("--tol", type=float, default=0.15)
    ap.add_argument("--auto-tol", type=float, default=0.05)
    ap.add_argument("--out", default=None, help="write the markdown table here (the command line first)")
    ap.add_argument("--json", default=None, help="write rows and checks as JSON here")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a check fails")
    ap.add_argument("--fit-file", action="append", default=[],
                    help="label every row of this file FIT (used by the fit); the others CHECK")
    ap.add_argument("--fit-presets", default="", help="comma-separated presets whose rows are labelled FIT")
    ap.add_argument("--steady", action="store_true", help=STEADY_HELP)
    args = ap.parse_args(list(argv) if argv is not None else None)
    labelled = [(Path(path).name, r) for path in args.results for r in results(path, args.steady)]
    records = [r for _, r in labelled]
    presets = [p for p in args.fit_presets.split(",") if p]
    sets = None
    if args.fit_file or presets:
        sets = ["fit" if in_fit_set(src, r, args.fit_file, presets) else "check" for src, r in labelled]
    prof = load_profile(args.profile) if args.profile else None
    rows, autos, ok = check(records, prof, args.kernel, args.tol, args.auto_tol, [src for src, _ in labelled], sets)
    text = render(rows, autos, args.tol, args.auto_tol)
    print(text)
    if args.out:
        write_report(args.out, "seqpar.planner.validate", argv, text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "auto": autos, "ok": ok},
                                              indent=1) + "\n")
    print("PASS" if ok else "FAIL: see the rows marked **over**")
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
