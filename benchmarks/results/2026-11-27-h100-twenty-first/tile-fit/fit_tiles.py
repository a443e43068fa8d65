"""The query-tile cost of packed calls (Note [Query tiles of packed calls] in seqpar/cost/model.py), chosen on a grid.

    PYTHONPATH=. python benchmarks/results/2026-11-27-h100-twenty-first/tile-fit/fit_tiles.py > grid.txt

For each (fwd, bwd) microseconds per query tile and head: the median and largest |error| of the planner's
predictions, and the cases where its pick is within 5% of the best measured, on the twentieth session's packed rows:
emulated W = 8 (steady; fitted against ``h100-emulated``) and four real H100s (checked against ``h100-nvswitch``).
"""

import statistics

from seqpar.cost.profile import load_profile
from seqpar.planner.validate import check, results

R = "benchmarks/results/2026-11-27-h100-twentieth"
EMULATED = results(f"{R}/packed-auto/emulated-packed-auto/"
                   "vm-8xNVIDIA_H100_80GB_HBM3-20261127-0639-w8-packed-auto.jsonl", steady=True)
REAL = results(f"{R}/real-w4-packed-1m/vm-4xNVIDIA_H100_80GB_HBM3-20261127-0733-real.jsonl")


def score(records, profile, fwd: float, bwd: float) -> str:
    rows, autos, _ = check(records, load_profile(profile).replace(varlen_tile_us=(("bwd", bwd), ("fwd", fwd))))
    errs = [abs(r.error) for r in rows if r.error is not None]
    return f"{statistics.median(errs):.2f} / {max(errs):.2f}, picks {sum(a['ok'] for a in autos)}/{len(autos)}"


print("| fwd us | bwd us | emulated W = 8: median / largest |error|, picks | real W = 4 |")
print("|---|---|---|---|")
for fwd in (0, 0.03, 0.06, 0.09, 0.12, 0.16, 0.2):
    for bwd in (0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4):
        emulated, real = score(EMULATED, "h100-emulated", fwd, bwd), score(REAL, "h100-nvswitch", fwd, bwd)
        print(f"| {fwd} | {bwd} | {emulated} | {real} |")
