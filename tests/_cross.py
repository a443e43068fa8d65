"""The softmax methods and layouts every cross-method test covers, and the shapes each can run.

Ulysses and USP are written in parallel: their parameters carry a ``skipif`` until they are registered,
and only the layouts a method declares in ``LAYOUTS`` are used, so these tests run unchanged once merged.
"""

from __future__ import annotations

import pytest

import seqpar
from seqpar.testing import Case

__all__ = ["LAYOUTS", "METHODS", "method_cases"]

LAYOUTS = {"ring": ("contiguous", "zigzag", "stripe"), "allgather": ("contiguous", "zigzag"),
           "ulysses": ("contiguous", "zigzag", "stripe"), "usp": ("contiguous", "zigzag", "stripe")}


def _method(name: str):
    """A ``method`` parameter, skipped until that method is merged (ulysses / usp are written in parallel)."""
    return pytest.param(name, id=name, marks=pytest.mark.skipif(
        name not in seqpar.methods.available(), reason=f"method {name!r} is not merged yet"))


METHODS = [_method(m) for m in LAYOUTS]


def method_cases(method: str, world: int, base: Case) -> list[Case]:
    """``base`` for every layout ``method`` accepts, with head counts and mesh it can run at ``world``."""
    if method not in seqpar.methods.available():
        return []
    module = seqpar.methods.get(method)
    shape = {}
    if method == "ulysses":
        shape = {"heads": 2 * world, "kv_heads": world}
    elif method == "usp":
        if world % 2:
            return []
        shape = {"heads": 4, "kv_heads": 2, "ulysses": 2}
    return [base.with_(method=method, layout=lay, **shape) for lay in LAYOUTS[method] if lay in module.layouts]
