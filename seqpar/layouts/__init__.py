"""Where each token lives: pure index math, testable in one process.

``make_layout(name, world)`` builds one of ``LAYOUTS`` (plain: a function of the length alone);
``make_layout(name, world, cu_seqlens)`` one of ``DOCUMENT_LAYOUTS`` (placed per batch from the global
document boundaries, ``layouts.documents``); ``Layout.documents`` says which kind a layout is. ``Nested``
composes a ring layout with a contiguous Ulysses split (USP). ``blocks.plan`` turns two ranks' positions
and a visibility rule into kernel calls; ``work.work`` counts each rank's attention work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Layout, Nested
from .blocks import Rule, Run, Segments, Task, group_varlen, plan
from .contiguous import Contiguous
from .documents import Balanced, BalancedWhole, DocContiguous, DocumentLayout, DocZigzag
from .stripe import Stripe
from .zigzag import Zigzag

__all__ = ["ALL_LAYOUT_NAMES", "BALANCED_LAYOUTS", "DOCUMENT_LAYOUTS", "LAYOUTS", "ONE_DOCUMENT", "Balanced",
           "BalancedWhole", "Contiguous", "DocContiguous", "DocZigzag", "DocumentLayout", "Layout", "Nested", "Rule",
           "Run", "Segments", "Stripe", "Task", "Zigzag", "group_varlen", "make_layout", "plan"]

#: plain layouts: the placement is a function of the global length alone
LAYOUTS: dict[str, type[Layout]] = {"contiguous": Contiguous, "zigzag": Zigzag, "stripe": Stripe}
#: document layouts: the placement is a function of the batch's global ``cu_seqlens`` too
DOCUMENT_LAYOUTS: dict[str, type[DocumentLayout]] = {"balanced": Balanced, "balanced_whole": BalancedWhole,
                                                      "doc_contiguous": DocContiguous, "doc_zigzag": DocZigzag}
#: layouts that balance work (and, with a named mask, the mask's work): ``rule`` is theirs
BALANCED_LAYOUTS: tuple[str, ...] = ("balanced", "balanced_whole")
ALL_LAYOUT_NAMES: tuple[str, ...] = (*LAYOUTS, *DOCUMENT_LAYOUTS)
#: the plain layout that places one causal document as each document layout does (``cu_seqlens = (0, S)``)
ONE_DOCUMENT: dict[str, str] = {"balanced": "zigzag", "balanced_whole": "zigzag", "doc_zigzag": "zigzag",
                                "doc_contiguous": "contiguous"}


def make_layout(name: str, world: int, cu_seqlens: Sequence[int] | torch.Tensor | None = None,
                rule: Rule | None = None) -> Layout:
    """The layout called ``name`` over ``world`` ranks; ValueError listing the valid names otherwise.

    A document layout needs the batch's global ``cu_seqlens`` (a sequence or 1-D tensor of ints); a plain
    layout ignores it. ``rule``: a rule with a named mask, whose visible pairs ``balanced`` (and
    ``balanced_whole``) balances (None: causal work); only those take it.
    """
    if rule is not None and name not in BALANCED_LAYOUTS:
        raise ValueError(f"only the balanced layouts {list(BALANCED_LAYOUTS)} balance a mask's work, got a mask with "
                         f"layout={name!r}")
    if name in LAYOUTS:
        return LAYOUTS[name](world)
    if name not in DOCUMENT_LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(ALL_LAYOUT_NAMES)}, got {name!r}")
    if cu_seqlens is None:
        raise ValueError(f"cu_seqlens (the batch's global document boundaries) must be given for the {name} layout, "
                         f"which places documents, got None")
    bounds = tuple(int(c) for c in cu_seqlens)
    return DOCUMENT_LAYOUTS[name](world, bounds, rule) if rule is not None else DOCUMENT_LAYOUTS[name](world, bounds)
