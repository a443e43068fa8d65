"""Reports from benchmark records (JSON lines): the console table, the README table, and the plots.

    python -m seqpar.bench.report benchmarks/results/<run>.jsonl [--readme] [--plot out.png]
    python -m seqpar.bench.report --emulated <emulated runs>.jsonl [--before <baseline runs>.jsonl]
    python -m seqpar.bench.report --steady <real run>.jsonl        (a run of the bench with --steady)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from ..planner.validate import is_auto

__all__ = ["best_rows", "console_table", "emulated_table", "load", "plot", "readme_table", "steady_rows",
           "write_probe"]


def load(paths: Iterable[str | Path]) -> list[dict]:
    """The records of JSON-lines files; a directory stands for every ``*.jsonl`` in it."""
    rows = []
    files = [f for p in paths for f in (sorted(Path(p).glob("*.jsonl")) if Path(p).is_dir() else [Path(p)])]
    for p in files:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def write_probe(path: str | Path | None, rows: Iterable[dict], **meta) -> None:
    """A probe's records (``benchmarks/gpu/probe_*.py``) as JSON lines: a header naming the device, torch and the
    command line (and ``meta``), then one line per row; nothing where ``path`` is None."""
    if path is None:
        return
    import sys

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(path, "w") as f:
        f.write(json.dumps({"device": device, "torch": torch.__version__, "argv": sys.argv, **meta}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _ok(r: dict) -> bool:
    return r.get("time_ms") is not None and not r.get("error")


def _suite(r: dict) -> bool:
    """A suite row (``seqpar.bench.suites``): compared by ratio to a single-GPU PyTorch kernel, not efficiency."""
    return "ratio" in r or r.get("method", "").startswith("sdpa:")


def suite_table(rows: list[dict]) -> str:
    """Suite rows: time against the single-GPU PyTorch kernel on the same work (back to back where the suite
    says), from an idle GPU and in kernels alone where recorded, host time, the target."""
    head = (f"{'preset':16} {'mode':8} {'W':>2} {'method':18} {'ms':>8} {'torch ms':>8} {'ratio':>6} {'idle ms':>8} "
            f"{'kern ms':>8} {'host us':>7} ok")
    lines = [head, "-" * len(head)]

    def num(x, w, p=3):
        return f"{'':>{w}}" if x is None else f"{x:{w}.{p}f}"
    for r in rows:
        if "ratio" not in r and not (r.get("error") and r.get("limit_ms")):
            continue
        if not _ok(r):
            lines.append(f"{r['preset']:16} {r['mode']:8} {r['world_size']:>2} {r['method']:18} failed: "
                         f"{str(r.get('error'))[:70]}")
            continue
        ok = r.get("within_target") and r.get("host_within_target") is not False
        lines.append(f"{r['preset']:16} {r['mode']:8} {r['world_size']:>2} {r['method']:18} {r['time_ms']:8.3f} "
                     f"{r['limit_ms']:8.3f} {r['ratio']:6.3f} {num(r.get('cold_ms'), 8)} {num(r.get('gpu_ms'), 8)} "
                     f"{num(r.get('host_us'), 7, 1)} {'yes' if ok else 'NO'}")
    return "\n".join(lines)


def console_table(rows: list[dict]) -> str:
    """Every record: preset, mode, method, time, efficiency, memory, exposed communication."""
    head = f"{'preset':18} {'mode':8} {'W':>2} {'method':36} {'ms':>10} {'eff':>6} {'GiB':>6} {'exp.comm ms':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("method", "").startswith("limit") or _suite(r):
            continue
        if not _ok(r):
            lines.append(f"{r['preset']:18} {r['mode']:8} {r['world_size']:>2} {r['method']:36} "
                         f"{'failed: ' + str(r.get('error'))[:60]}")
            continue
        exp = r.get("exposed_comm_ms")
        lines.append(f"{r['preset']:18} {r['mode']:8} {r['world_size']:>2} {r['method']:36} {r['time_ms']:10.2f} "
                     f"{r.get('efficiency', float('nan')):6.3f} {r.get('peak_mem_gib', 0.0):6.2f} "
                     f"{'' if exp is None else f'{exp:11.2f}'}")
    return "\n".join(lines)


def steady_rows(rows: list[dict]) -> list[dict]:
    """A real run's records as calls issued back to back (``--steady`` on the bench): each record that carries
    ``steady_ms`` with that as its time and ``steady_efficiency`` as its efficiency; the limit rows as they are
    (the one-GPU kernel's time from an idle GPU, as the efficiencies use it); the others dropped."""
    out = []
    for r in rows:
        if r.get("method", "").startswith("limit"):
            out.append(r)
        elif r.get("steady_ms") is not None and not r.get("error"):
            out.append({**r, "time_ms": r["steady_ms"], "efficiency": r["steady_efficiency"]})
    return out


def best_rows(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Per (preset, mode, world): the best seqpar record and the best peer record."""
    best: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if not _ok(r) or r["method"].startswith("limit") or r.get("scaling") or _suite(r):
            continue
        key = (r["preset"], r["mode"], r["world_size"])
        side = "peer" if r["method"].startswith("peer:") else "ours"
        if side not in best[key] or r["time_ms"] < best[key][side]["time_ms"]:
            best[key][side] = r
    return best


def readme_table(rows: list[dict]) -> str:
    """Markdown: per preset and mode, the limit, seqpar's best, the best peer in the same run, the target."""
    out = ["| preset | mode | GPUs | limit ms | seqpar best | eff | peak GiB (min) | best peer, same run | peer eff "
           "| target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (preset, mode, world), b in best_rows(rows).items():
        ours, peer = b.get("ours"), b.get("peer")
        if ours is None or "efficiency" not in ours:
            continue
        tgt = ours.get("target")
        peer_cells = (f"{peer['time_ms']:.2f} ms ({peer['method'][5:]}) | {peer['efficiency']:.3f}" if peer
                      else "not run | -")
        out.append(f"| {preset} | {mode} | {world} | {ours['limit_ms']:.2f} | {ours['time_ms']:.2f} ms "
                   f"({ours['method']}) | **{ours['efficiency']:.3f}** | {ours['peak_mem_gib']:.1f} "
                   f"({ours.get('min_mem_gib', 0):.1f}) | {peer_cells} | {'-' if tgt is None else f'{tgt:.3f}'} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str | Path) -> str | None:
    """Efficiency per preset and method (bars, fwd+bwd and fwd), and the scaling curves. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install seqpar[bench])"
    table = [r for r in rows
             if _ok(r) and not _suite(r) and not r.get("scaling") and not r["method"].startswith("limit")]
    presets = sorted({r["preset"] for r in table})
    scaling = [r for r in rows if _ok(r) and r.get("scaling")]
    n = len(presets) + (1 if scaling else 0)
    if n == 0:
        return "no efficiency rows to plot (suite rows are in the suite table)"
    fig, axes = plt.subplots(n, 1, figsize=(12, 3.2 * n), squeeze=False)
    for ax, preset in zip(axes[:, 0], presets):
        sel = [r for r in table if r["preset"] == preset]
        labels = sorted({r["method"] for r in sel}, key=lambda m: (m.startswith("peer:"), m))
        for off, mode in ((-0.2, "fwd"), (0.2, "fwd+bwd")):
            eff = {r["method"]: r["efficiency"] for r in sel if r["mode"] == mode}
            xs = [i + off for i, m in enumerate(labels) if m in eff]
            ax.bar(xs, [eff[m] for m in labels if m in eff], width=0.4, label=mode,
                   color=["tab:gray" if m.startswith("peer:") else ("tab:blue" if mode == "fwd" else "tab:green")
                          for m in labels if m in eff])
        ax.set_xticks(range(len(labels)), [m.replace("peer:", "peer\n") for m in labels], rotation=60,
                      fontsize=6, ha="right")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.set_ylabel("efficiency")
        ax.set_title(f"{preset}: single-GPU cuDNN time / N / time (blue fwd, green fwd+bwd, gray peers)", fontsize=8)
    if scaling:
        ax = axes[-1, 0]
        for key in sorted({(r["scaling"], r["method"], r["mode"]) for r in scaling}):
            pts = sorted((r["world_size"], r["efficiency"]) for r in scaling
                         if (r["scaling"], r["method"], r["mode"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(key))
        ax.set_xlabel("GPUs")
        ax.set_ylabel("efficiency")
        ax.set_title("scaling: strong (global 128K) and weak (32K per GPU)", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


#: the methods' columns of the emulated table: each the best configuration (layout, options) of that method
_EMULATED_COLUMNS = ("ring", "allgather", "ulysses", "usp", "tokenring", "tasp", "double_ring")


def emulated_table(rows: list[dict], before: list[dict] | None = None, steady: bool = False) -> str:
    """The README table of emulated runs (Note [Emulated world] in ``seqpar.bench``): per preset, emulated W and
    mode, each method's compute efficiency (its busiest rank, communication free; the method's best
    configuration), ``method="auto"`` on the better of its layouts with the method it ran there (Note [Auto rows]
    in ``seqpar.bench``), the best seqpar method and the best peer; ``before``: a baseline run's best seqpar beside it.
    Records of a run with a modelled link (``--link``) give their ``predicted_efficiency`` instead: label such a
    table as predicted (Note [Modelled link] in ``seqpar.comm.link``).
    A peer above 1.3 is marked: beyond the kernel's limit, not a meaningful emulated figure. ``steady``: the
    efficiency of calls issued back to back (``steady_*`` fields) instead of one call from an idle GPU."""
    prefix = "steady_" if steady else ""
    picks: dict[tuple, str] = {}

    def table(rs):
        out: dict[tuple, dict[str, float]] = defaultdict(dict)
        for r in rs:
            if _ok(r) and r.get("emulated_world") and not r["method"].startswith("limit"):
                key = (r["preset"], r["emulated_world"], r["mode"])
                eff = r.get(f"{prefix}compute_efficiency", r.get(f"{prefix}predicted_efficiency"))
                if eff is not None:
                    out[key][r["method"]] = max(out[key].get(r["method"], 0.0), eff)
                if is_auto(r["method"]) and rs is rows:
                    picks[(*key, r["method"])] = f"{r.get('auto_pick')}, {r['method'].partition('/')[2]}"
        return out

    now, base = table(rows), table(before or [])
    head = ["preset", "W", "tokens/rank", "mode", *_EMULATED_COLUMNS, "auto (its pick)", "best seqpar", "best peer"]
    head += ["best seqpar before"] if before else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (preset, W, mode), effs in sorted(now.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2])):
        ours = {m: e for m, e in effs.items() if not m.startswith("peer:") and not is_auto(m)}
        autos = {m: e for m, e in effs.items() if is_auto(m)}
        peers = {m: e for m, e in effs.items() if m.startswith("peer:")}
        cells = []
        for c in _EMULATED_COLUMNS:
            got = [e for m, e in ours.items() if m.split("/")[0] == c]
            cells.append(f"{max(got):.2f}" if got else "-")
        key = (preset, W, mode)
        auto = max(autos, key=autos.get) if autos else None
        cells.append(f"{autos[auto]:.2f} ({picks.get((*key, auto))})" if auto else "-")
        best = max(ours, key=ours.get) if ours else None
        peer = max(peers, key=peers.get) if peers else None
        seq = next(r["seq_len"] for r in rows if r.get("preset") == preset and r.get("seq_len"))
        row = [preset, str(W), f"{seq // W // 1024}K", mode, *cells,
               f"**{ours[best]:.2f}** ({best})" if best else "-",
               f"{peers[peer]:.2f}{' (!)' if peers[peer] > 1.3 else ''} ({peer[5:]})" if peer else "not run"]
        if before:
            b = {m: e for m, e in base.get(key, {}).items() if not m.startswith("peer:") and not is_auto(m)}
            row.append(f"{max(b.values()):.2f}" if b else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m seqpar.bench.report")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--readme", action="store_true", help="print the README table (markdown)")
    ap.add_argument("--plot", help="write the efficiency / scaling plot to this PNG")
    ap.add_argument("--emulated", action="store_true", help="print the emulated-world table (markdown)")
    ap.add_argument("--before", nargs="*", default=[], help="with --emulated: a baseline run's records")
    ap.add_argument("--steady", action="store_true",
                    help="calls issued back to back (steady_* fields), not one from an idle GPU: emulated records, "
                         "and a real run's records where the bench ran with --steady")
    args = ap.parse_args(argv)
    rows = load(args.files)
    if args.steady and not args.emulated:
        rows = steady_rows(rows)
    if args.emulated:
        print(emulated_table(rows, load(args.before) if args.before else None, steady=args.steady))
        return 0
    print(readme_table(rows) if args.readme else console_table(rows))
    if args.plot:
        msg = plot(rows, args.plot)
        if msg:
            print(msg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
