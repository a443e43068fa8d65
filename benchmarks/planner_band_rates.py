"""The cost model's predictions against emulated measurements of windowed and masked calls, with and without the
profile's band rates (Note [Band rates] in ``seqpar/cost/model.py``). CPU only: it reads committed records.

    python benchmarks/planner_band_rates.py --out DIR

The measurements (rank 1 of 8 at 128K on a fake group, one H100, timed from an idle GPU):
- ``benchmarks/results/2026-11-28-h100-window-allgather/head-*.log``: ``window_size=(4095, 0)``, the all-gather,
  contiguous and zigzag (the mean of the two runs);
- ``benchmarks/results/2026-11-28-flex-bounds-tma/emulated-profile-masks.jsonl``: the sink window (4095 + 4),
  Llama 4's 8K chunks and causal, the all-gather and the ring, contiguous.

For each: ``seqpar.plan``'s time on the ``h100-emulated`` profile, as it is and with ``band_tflops`` removed, over
the measured time, forward and forward+backward. One JSON line each in DIR/planner_band_rates.jsonl, and a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import seqpar
from seqpar import masks
from seqpar.planner import load_profile

ROOT = Path(__file__).resolve().parent / "results"
CASES = {"window": dict(causal=True, window=(4095, 0)),
         "sink_window": dict(causal=False, mask_mod=masks.sink_window(4095, 4)),
         "chunked": dict(causal=True, mask_mod=masks.chunked(8192)),
         "causal": dict(causal=True)}


def measured() -> list[tuple[str, str, float, float]]:
    """``(case, method/layout, forward ms, forward+backward ms)`` from the committed records."""
    out = []
    window = [json.loads(line) for f in sorted((ROOT / "2026-11-28-h100-window-allgather").glob("head-*.log"))
              for line in f.read_text().splitlines() if line.startswith("{")]
    for layout in ("contiguous", "zigzag"):
        rows = [r for r in window if r["layout"] == layout]
        out.append(("window", f"allgather/{layout}", statistics.mean(r["rank_fwd_ms"] for r in rows),
                    statistics.mean(r["rank_fb_ms"] for r in rows)))
    for line in (ROOT / "2026-11-28-flex-bounds-tma" / "emulated-profile-masks.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("section") == "emulated" and "rank_fwd_ms" in r:
            out.append((r["mask"], f"{r['method']}/{r['layout']}", r["rank_fwd_ms"], r["rank_fb_ms"]))
    return out


def predicted(case: str, label: str, profile) -> tuple[float, float]:
    times = []
    for mode in ("fwd", "fwd+bwd"):
        r = seqpar.plan(seq_len=131072, world=8, heads=32, kv_heads=8, head_dim=128, mode=mode, profile=profile,
                        **CASES[case])
        times.append(next(e.time_ms for e in r.entries if e.label == label))
    return times[0], times[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"host": platform.node(), "torch": torch.__version__, "commit": commit,
           "command": " ".join([sys.executable, *sys.argv])}
    prof = load_profile("h100-emulated")
    bare = prof.replace(band_tflops=())
    lines = ["| case | method | measured fwd / fb ms | predicted / measured, band rates | without |",
             "|---|---|---|---|---|"]
    with (out / "planner_band_rates.jsonl").open("w") as f:
        for case, label, fwd, fb in measured():
            now, before = predicted(case, label, prof), predicted(case, label, bare)
            rec = {"case": case, "method": label, "measured_fwd_ms": fwd, "measured_fb_ms": fb,
                   "predicted_fwd_ms": now[0], "predicted_fb_ms": now[1], "predicted_fwd_ms_no_band_rates": before[0],
                   "predicted_fb_ms_no_band_rates": before[1], **env}
            f.write(json.dumps(rec) + "\n")
            lines.append(f"| {case} | {label} | {fwd:.2f} / {fb:.2f} | {now[0] / fwd:.2f} / {now[1] / fb:.2f} | "
                         f"{before[0] / fwd:.2f} / {before[1] / fb:.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
