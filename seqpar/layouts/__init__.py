"""Where each token lives: pure index math, testable in one process.

``make_layout(name, world)`` builds one of ``LAYOUTS``; ``Nested`` composes a ring layout with a
contiguous Ulysses split (USP). ``blocks.plan`` turns two ranks' positions and a visibility rule into
kernel calls.
"""

from __future__ import annotations

from .base import Layout, Nested
from .blocks import Rule, Run, Segments, Task, group_varlen, plan
from .contiguous import Contiguous
from .stripe import Stripe
from .zigzag import Zigzag

__all__ = ["LAYOUTS", "Contiguous", "Layout", "Nested", "Rule", "Run", "Segments", "Stripe", "Task",
           "Zigzag", "group_varlen", "make_layout", "plan"]

LAYOUTS: dict[str, type[Layout]] = {"contiguous": Contiguous, "zigzag": Zigzag, "stripe": Stripe}


def make_layout(name: str, world: int, cu_seqlens: tuple[int, ...] | None = None) -> Layout:
    """The layout called ``name`` over ``world`` ranks; ValueError listing the valid names otherwise."""
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name](world)
