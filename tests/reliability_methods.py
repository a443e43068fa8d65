"""Which methods the reliability tests cover, and how to set each one up (parent side, no distributed state).

Every per-method reliability test is parametrized over ``seqpar.methods.available()`` and
``seqpar.linear_methods()``, so methods merged later are covered automatically. A method that needs a 2D
mesh or options gets them from ``SETUP``; an unknown method gets the defaults (1D group, no options, its
first layout - zigzag when it takes zigzag). When a test's setup is wrong for a method (every rank rejects
the call with a validation error), the test skips with that error as the reason instead of failing.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any

import seqpar
from seqpar.methods import get

SOFTMAX = seqpar.methods.available()
LINEAR = seqpar.linear_methods()

# method -> how to build its call at world size W (a function of W)
SETUP: dict[str, Any] = {
    "usp": lambda W: {"ulysses": 2 if W % 2 == 0 and W > 2 else 1},
    "double_ring": lambda W: {"options": (("node_size", 2 if W % 2 == 0 else 1),)},
}

SETUP_ERRORS = ("ValueError", "TypeError", "NotImplementedError", "UnsupportedInputError")


@dataclass(frozen=True)
class MethodSetup:
    method: str
    layout: str
    ulysses: int | None = None
    options: tuple[tuple[str, Any], ...] = ()


def softmax_setup(method: str, world: int, layout: str | None = None) -> MethodSetup:
    """Layout (``layout`` if the method takes it, else zigzag if it can, else its first), mesh and options."""
    module = get(method)
    layouts = module.layouts
    chosen = layout if layout in layouts else ("zigzag" if "zigzag" in layouts else layouts[0])
    extra = SETUP.get(method, lambda W: {})(world)
    ulysses = extra.get("ulysses") if module.mesh_dims == 2 else None
    if module.mesh_dims == 2 and ulysses is None:
        ulysses = 1
    return MethodSetup(method, chosen, ulysses, tuple(extra.get("options", ())))


def length_divisor(method: str, layout: str, world: int, ulysses: int | None = None) -> int:
    """The global-length multiple of the method's placement, from a stand-in for the process groups."""
    u = ulysses or 1
    fake = types.SimpleNamespace(world=world, index=0, ulysses_size=u, ring_size=world // u, group=None,
                                 ulysses=None, ring=None)
    try:
        lay, _ = get(method).placement(layout, fake)
        return lay.divisor
    except Exception:              # an unknown method's placement needs real groups: a safe multiple
        return 2 * world


def padded_length(s: MethodSetup, world: int, want: int) -> int:
    """The smallest length >= ``want`` that the setup's layout splits at ``world`` (pass ``valid_len=want``)."""
    d = length_divisor(s.method, s.layout, world, s.ulysses)
    return math.ceil(want / d) * d


def linear_layout(method: str) -> str:
    module = seqpar.linear_api.get_linear_method(method)
    return "zigzag" if "zigzag" in module.LAYOUTS else module.LAYOUTS[0]


def all_rejected(errors: list[str | None]) -> str | None:
    """The first error when every rank rejected the call with a validation error (a setup problem), else None."""
    if errors and all(e is not None and e.split(":", 1)[0] in SETUP_ERRORS for e in errors):
        return errors[0]
    return None
