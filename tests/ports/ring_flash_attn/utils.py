"""Port of ring-flash-attention's test/utils.py: ``set_seed``, ``log`` (shared with the other ports), and the
scripts' ``__main__`` block (``run_script``, tests/ports/common.py)."""

from __future__ import annotations

import random

import torch
from ports.common import log, run_script

__all__ = ["log", "run_script", "set_seed"]


def set_seed(rank: int, seed: int = 42) -> None:
    seed = rank + seed
    random.seed(seed)
    torch.manual_seed(seed)
