"""One module per method, the same anatomy in each; a method never imports another.

Every method module defines:

    NAME       the ``method=`` string
    LAYOUTS    layouts it accepts (first = default when the caller's layout does not apply)
    MESH_DIMS  1 (a group or 1D mesh) or 2 (a ("ulysses", "ring") mesh)
    OPTIONS    method-specific keyword options and their defaults (anything else is an error)
    FEATURES   the subset of {"window", "varlen", "padding", "lse_grad"} it serves (others raise)
    CAUSAL_LAYOUTS  (optional) the layouts that serve causal=True, when not all of LAYOUTS do
    placement(layout, groups) -> (Layout, index)   where the tokens live, for shard/unshard/positions
    _forward / _backward, then attention(q, k, v, cfg, groups) -> AttnOutput through _autograd.differentiable

Code two methods share (the pass-KV ring loop) lives in private ``_``-modules here. To add a method, copy
the anatomy of ``ring.py``, register its module below, and add it to the oracle tests and the demo.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import rank_suffix

__all__ = ["available", "causal_layouts", "get"]

_MODULES = {
    "ring": "seqpar.methods.ring",
    "allgather": "seqpar.methods.allgather",
    "ulysses": "seqpar.methods.ulysses",
    "usp": "seqpar.methods.usp",
    "tokenring": "seqpar.methods.tokenring",
    "tasp": "seqpar.methods.tasp",
    "double_ring": "seqpar.methods.double_ring",
}


def available() -> list[str]:
    """Names ``seqpar.attention(method=...)`` accepts."""
    return list(_MODULES)


def get(name: str) -> ModuleType:
    """The module implementing ``name``; ValueError listing the valid names otherwise."""
    if name not in _MODULES:
        raise ValueError(f"method must be one of {available()}, got {name!r}{rank_suffix()}")
    return importlib.import_module(_MODULES[name])


def causal_layouts(module: ModuleType) -> tuple[str, ...]:
    """The layouts of ``module`` that serve causal=True (``CAUSAL_LAYOUTS``, else all of ``LAYOUTS``)."""
    return tuple(getattr(module, "CAUSAL_LAYOUTS", module.LAYOUTS))

