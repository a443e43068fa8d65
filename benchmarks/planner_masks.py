"""The cost model against the bench's mask rows recorded before records carried their mask's spec.

    PYTHONPATH=. python benchmarks/planner_masks.py RESULTS.jsonl [...] [--out FILE.md] [--steady]

``python -m seqpar.planner.validate`` prices a named mask's row by its blocks only when the record carries the
mask's spec (``mask_spec``, written since 2026-11-28); it lists older mask rows as not modelled (before, it
dropped the mask and priced the unmasked call). This script fills the spec in from the bench's preset of the same
name (``seqpar.bench.presets.PRESETS``: the planner does not import the bench) and runs the same check and table.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from seqpar.bench.presets import PRESETS
from seqpar.planner.validate import STEADY_HELP, check, render, results


def with_spec(rec: dict) -> dict:
    """``rec`` with its preset's mask spec when it names a masked preset and carries none."""
    preset = PRESETS.get(str(rec.get("preset", "")))
    if preset is None or preset.mask is None or rec.get("mask_spec"):
        return rec
    return {**rec, "mask": preset.mask[0], "mask_spec": preset.mask}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", default=None)
    ap.add_argument("--steady", action="store_true", help=STEADY_HELP)
    args = ap.parse_args()
    labelled = [(Path(p).name, with_spec(r)) for p in args.results for r in results(p, args.steady)]
    rows, autos, _ = check([r for _, r in labelled], sources=[s for s, _ in labelled])
    text = render(rows, autos, 0.15, 0.05)
    print(text)
    if args.out:
        command = " ".join(["PYTHONPATH=. python benchmarks/planner_masks.py", *map(shlex.quote, sys.argv[1:])])
        Path(args.out).write_text(f"`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
