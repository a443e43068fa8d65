"""One module per method, the same anatomy in each; a method never imports another.

Every method module ends with ``METHOD = Method(...)`` (``seqpar.methods.base``): its name, layouts, options,
features, mesh dims, placement, the engine a planned call builds, its cost model and the configurations the
planner, the benchmark and the demo try. The registry (``available``, ``get``, ``register``) is the only list
of methods in seqpar. Code two methods share (the pass-KV ring loop, the Ulysses sandwich, pass-Q and TASP
engines) lives in private ``_``-modules here.

Adding a method: write ``methods/<name>.py`` ending in ``METHOD = Method(...)`` (copy the anatomy of
``ring.py``: an engine class over the runtime's ``run_steps``, the block planner and a ``TaskRunner``), add its
name to ``base.BUILTIN``, and add its tests (the oracle cases read the declaration).
"""

from __future__ import annotations

from .base import (
    BUILTIN,
    FEATURES,
    BackwardInputs,
    Call,
    Engine,
    Method,
    available,
    causal_layouts,
    get,
    register,
    ring_placement,
    unregister,
)

__all__ = ["BUILTIN", "FEATURES", "BackwardInputs", "Call", "Engine", "Method", "available", "causal_layouts", "get",
           "register", "ring_placement", "unregister"]
