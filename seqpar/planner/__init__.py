"""The planner: which method to use, predicted from a calibrated cost model (ALGORITHMS.md §12).

    seqpar.plan(seq_len=131072, heads=32, kv_heads=8, world=4)   # ranking with times, memory and the reason
    seqpar.attention(..., method="auto")                         # runs the planner's choice (``choose``)
    python -m seqpar.calibrate                                   # measure this host -> a profile JSON
    python -m seqpar plan --gpus 8,64,1024 --topology nvswitch   # simulate described clusters
    python -m seqpar.planner.validate results.jsonl              # predicted vs measured

Modules: ``profile`` (measured constants, JSON), ``work`` (per-step attention work, closed form),
``topology`` (described machines and pattern times), ``cost`` (one model per method), ``search``
(``plan``, ``choose``), ``simulate`` and ``cli`` (the ``plan`` subcommand), ``calibrate``, ``validate``.
"""

from __future__ import annotations

from .cost import Candidate, Prediction, Problem, predict
from .profile import Profile, builtin_profiles, load_profile
from .search import Ranking, choose, plan
from .topology import PRESETS, Topology

__all__ = ["PRESETS", "Candidate", "Prediction", "Problem", "Profile", "Ranking", "Topology", "builtin_profiles",
           "choose", "load_profile", "plan", "predict"]
