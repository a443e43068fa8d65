"""Before/after of two emulated runs in one directory: ``emulated-base*/`` against ``emulated-new*/``.

    python benchmarks/compare_emulated.py benchmarks/results/<run>

One line per configuration both runs measured (preset, W, method/layout, mode): efficiency, host milliseconds of
one call from an idle GPU, GPU operations per call and peak GiB, before -> after. The runs are what
``benchmarks/gpu/emulate_1gpu.sh`` writes with ``TAG=base`` / ``TAG=new`` (and ``base-dense`` / ``new-dense``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def records(root: Path, tag: str) -> dict[tuple, dict]:
    """``(preset, W, method, mode) -> record`` of the emulated records under ``root/emulated-<tag>/``."""
    out = {}
    for path in sorted((root / f"emulated-{tag}").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "emulated_world" in r and "efficiency" in r:
                out[(r["preset"], r["emulated_world"], r["method"], r["mode"])] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path)
    args = ap.parse_args()
    for before, after in (("base", "new"), ("base-dense", "new-dense")):
        b, n = records(args.root, before), records(args.root, after)
        for key in sorted(k for k in n if k in b):
            x, y = b[key], n[key]
            print(f"{key[0]:22s} W{key[1]} {key[2]:24s} {key[3]:8s} {x['efficiency']:.3f} -> {y['efficiency']:.3f}"
                  f"  host {x.get('host_ms_per_call', 0):.2f}->{y.get('host_ms_per_call', 0):.2f}"
                  f" ops {x.get('gpu_ops_per_call')}->{y.get('gpu_ops_per_call')}"
                  f" mem {x.get('peak_mem_gib', 0):.2f}->{y.get('peak_mem_gib', 0):.2f}")


if __name__ == "__main__":
    main()
