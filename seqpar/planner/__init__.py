"""The planner: which method to use, predicted from a calibrated cost model (ALGORITHMS.md §12).

    seqpar.plan(seq_len=131072, heads=32, kv_heads=8, world=4)   # ranking with times, memory and the reason
    seqpar.plan(..., cu_seqlens=cu, layout="zigzag")             # a packed batch (Note [Packed batches])
    seqpar.plan(..., cached=65536, layers=32)                    # + prefill and decode of a cached prefix
    seqpar.attention(..., method="auto")                         # runs the planner's choice (``choose``)
    python -m seqpar.calibrate                                   # measure this host -> a profile JSON
    python -m seqpar plan --gpus 8,64,1024 --topology nvswitch   # simulate described clusters
    python -m seqpar.planner.validate results.jsonl              # predicted vs measured

The methods are the registry's: each declares its cost model and candidates (``seqpar.methods.Method``).
Modules: ``model`` (the vocabulary and arithmetic every method's model is written in; imports no method),
``work`` (per-step attention work, closed form), ``profile`` (measured constants, JSON), ``topology``
(described machines and pattern times), ``search`` (``plan``, ``choose``, ``predict``), ``inference``
(prefill and decode), ``simulate`` and ``cli`` (the ``plan`` subcommand), ``calibrate``, ``validate``,
``fit``. Names below load their module on first use, so importing ``seqpar.planner.model`` (as methods
do) loads neither the search nor the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PRESETS", "Candidate", "InferenceCase", "Prediction", "Problem", "Profile", "Ranking", "Topology",
           "builtin_profiles", "choose", "inference_case", "load_profile", "plan", "predict"]

_HOME = {"Candidate": "model", "Prediction": "model", "Problem": "model", "Profile": "profile",
         "builtin_profiles": "profile", "load_profile": "profile", "Ranking": "search", "choose": "search",
         "plan": "search", "predict": "search", "PRESETS": "topology", "Topology": "topology",
         "InferenceCase": "inference", "inference_case": "inference"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'seqpar.planner' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
