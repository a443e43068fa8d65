"""The emulated prediction against the real run, configuration by configuration (issue 23's "record its error").

    python benchmarks/real_vs_emulated.py RESULTS_DIR [EMULATED]   # RESULTS_DIR/real/*.jsonl against
                                                                   # RESULTS_DIR/EMULATED/*.jsonl (emulated)
    python benchmarks/real_vs_emulated.py RESULTS_DIR --steady --real A/real B/real   # calls back to back

``--steady``: both sides' calls issued back to back (``steady_ms``; a real run of the bench with ``--steady``),
against the same limits; records without a back-to-back time are left out. ``--real``: the real records' folders
(relative to RESULTS_DIR; default ``real``).

Both sides are ``seqpar.bench`` records of the same presets at the same W: real (``torchrun``, NCCL) and emulated
(``--emulate-world W``: the busiest rank on a fake group). Prints, as markdown:
  1. per row (preset x mode): the best seqpar configuration and the best peer of the real run, their efficiency,
     the same configuration's emulated efficiency and the error (emulated - real, and relative to real);
  2. per row and over all rows: the median and mean absolute relative error of efficiency, and how many
     configurations the emulation put faster than the real run (it is meant to be an upper bound);
  3. every configuration: real and emulated efficiency.
Efficiency on each side is against that side's own limit (the one-GPU kernel on the whole sequence / W, timed by
the same process). A real ring on copy engines (``.../transportcopy_engine``) is set against the emulated ring of the
same layout: a fake group's transfers are free on any transport, so the emulation has one prediction for both.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COPY_ENGINE = "transportcopy_engine"
"""The part of a record's method name that marks the ring on copy engines (``seqpar.bench.presets.MethodSpec``)."""


def load(folders: list[Path], steady: bool = False) -> dict[tuple[str, str, str], dict]:
    """(preset, mode, configuration) -> record; ``steady``: its back-to-back time as ``time_ms`` and efficiency."""
    rows = {}
    for folder in folders:
        for f in sorted(folder.glob("*.jsonl")):
            for line in f.read_text().splitlines():
                r = json.loads(line)
                if r.get("efficiency") is None or r["method"].startswith("limit:"):
                    continue
                if steady:
                    if not r.get("steady_ms"):
                        continue
                    r = {**r, "time_ms": r["steady_ms"], "efficiency": r["limit_ms"] / r["steady_ms"]}
                rows[(r["preset"], r["mode"], r["method"])] = r
    return rows


def main(folder: str, emulated: str = "emulated", real_dirs: tuple[str, ...] = ("real",),
         steady: bool = False) -> None:
    real = load([Path(folder) / d for d in real_dirs], steady)
    emu = load([Path(folder) / emulated], steady)
    for k in list(real):                     # the emulated twin of a ring on copy engines (module docstring)
        twin = (k[0], k[1], k[2].replace("/" + COPY_ENGINE, ""))
        if twin != k and twin in emu and k not in emu:
            emu[k] = emu[twin]
    both = sorted(set(real) & set(emu))
    rel = lambda k: (emu[k]["efficiency"] - real[k]["efficiency"]) / real[k]["efficiency"]   # noqa: E731
    print("| row | mode | best seqpar, real | eff | emulated | err (rel) "
          "| best peer, real | eff | emulated | err (rel) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in sorted({k[:2] for k in both}):
        cells = []
        for peer in (False, True):
            ks = [k for k in both if k[:2] == row and k[2].startswith("peer:") == peer]
            if not ks:
                cells += ["-"] * 4
                continue
            k = max(ks, key=lambda k: real[k]["efficiency"])
            e, r = emu[k]["efficiency"], real[k]["efficiency"]
            cells += [k[2].removeprefix("peer:"), f"**{r:.3f}**", f"{e:.3f}", f"{e - r:+.3f} ({rel(k):+.0%})"]
        print(f"| {row[0]} | {row[1]} | " + " | ".join(cells) + " |")
    print("\n| configurations | row | n | median rel err | mean abs rel err | min | max | emulated faster |")
    print("|---|---|---|---|---|---|---|---|")
    def peer(k):
        return k[2].startswith("peer:")
    for who, pick in (("seqpar", lambda k: not peer(k)), ("peers", peer)):
        for row in [*sorted({k[0] for k in both}), "all rows"]:
            ks = [k for k in both if pick(k) and row in (k[0], "all rows")]
            if not ks:
                continue
            errs = [rel(k) for k in ks]
            faster = sum(emu[k]["time_ms"] < real[k]["time_ms"] for k in ks)
            print(f"| {who} | {row} | {len(ks)} | {statistics.median(errs):+.1%} | "
                  f"{statistics.fmean(abs(x) for x in errs):.1%} | {min(errs):+.1%} | {max(errs):+.1%} "
                  f"| {faster}/{len(ks)} |")
    only = sorted(set(real) ^ set(emu))
    if only:
        real_only = sum(k in real for k in only)
        print(f"\nOn one side only: {real_only} configurations real, {len(only) - real_only} emulated "
              f"({', '.join(sorted({k[2] for k in only})[:6])}{', ...' if len({k[2] for k in only}) > 6 else ''})")
    print("\n| row | mode | configuration | real eff | emulated eff |")
    print("|---|---|---|---|---|")
    for k in both:
        print(f"| {k[0]} | {k[1]} | {k[2]} | {real[k]['efficiency']:.3f} | {emu[k]['efficiency']:.3f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("emulated", nargs="?", default="emulated")
    ap.add_argument("--real", nargs="+", default=["real"])
    ap.add_argument("--steady", action="store_true")
    args = ap.parse_args()
    main(args.folder, args.emulated, tuple(args.real), args.steady)
