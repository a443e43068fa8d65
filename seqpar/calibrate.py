"""``python -m seqpar.calibrate``: measure this host and write a planner profile JSON.

A thin entry point; the measurements live in ``seqpar.planner.calibrate`` (see its docstring).

    torchrun --nproc-per-node 4 -m seqpar.calibrate --out h200.json
    python -m seqpar.calibrate --device cpu --spawn 2
"""

from __future__ import annotations

from .planner.calibrate import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
