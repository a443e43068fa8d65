"""The planner: which method to use, predicted from a calibrated cost model (ALGORITHMS.md §12).

    seqpar.plan(seq_len=131072, heads=32, kv_heads=8, world=4)   # ranking with times, memory and the reason
    seqpar.plan(..., cu_seqlens=cu, layout="zigzag")             # a packed batch (Note [Packed batches])
    seqpar.plan(..., cached=65536, layers=32)                    # + prefill and decode of a cached prefix
    seqpar.attention(..., method="auto")                         # runs the planner's choice (``choose``)
    python -m seqpar.calibrate                                   # measure this host -> a profile JSON
    python -m seqpar plan --gpus 8,64,1024 --topology nvswitch   # simulate described clusters
    python -m seqpar.planner.validate results.jsonl              # predicted vs measured

The methods are the registry's: each declares its cost model and candidates (``seqpar.methods.Method``),
written in ``seqpar.cost`` - ``model`` (the vocabulary and arithmetic; imports no method), ``work`` (per-step
attention work, closed form), ``profile`` (measured constants, JSON), ``topology`` (described machines and
pattern times) - a package below the methods, so methods never import the planner. Here: ``search``
(``plan``, ``choose``, ``predict``), ``inference`` (prefill and decode), ``simulate`` and ``cli`` (the ``plan``
subcommand), ``calibrate``, ``validate``, ``fit``. Names below load their module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PRESETS", "Candidate", "InferenceCase", "Prediction", "Problem", "Profile", "Ranking", "Topology",
           "builtin_profiles", "choose", "inference_case", "load_profile", "plan", "predict"]

_HOME = {"Candidate": "seqpar.cost.model", "Prediction": "seqpar.cost.model", "Problem": "seqpar.cost.model",
         "Profile": "seqpar.cost.profile", "builtin_profiles": "seqpar.cost.profile",
         "load_profile": "seqpar.cost.profile", "Ranking": "seqpar.planner.search", "choose": "seqpar.planner.search",
         "plan": "seqpar.planner.search", "predict": "seqpar.planner.search", "PRESETS": "seqpar.cost.topology",
         "Topology": "seqpar.cost.topology", "InferenceCase": "seqpar.planner.inference",
         "inference_case": "seqpar.planner.inference"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'seqpar.planner' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
