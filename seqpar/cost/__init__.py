"""The cost model every method's ``cost`` is written in, below the methods (ALGORITHMS.md §12).

``model`` (the vocabulary and arithmetic: problems, candidates, machines, predictions; imports no method),
``work`` (per-step attention work, closed form), ``profile`` (measured constants, JSON; built-in profiles in
``profiles/``), ``topology`` (described machines and pattern times). The planner (``seqpar.planner``) ranks
the methods with it; methods import it and never the planner.
"""
