"""Shipped test helpers: the multi-process harness, the dense oracle, tolerances and oracle cases.

    from seqpar.testing import Case, ProcessPool, check_case, run_case
    with ProcessPool(4) as pool:
        report = check_case(case, pool.run(run_case, case))
"""

from __future__ import annotations

from .cases import Case, Report, case_error, check_case, make_inputs, run_case
from .harness import ProcessPool, WorkerError
from .oracle import dense_attention, dense_mask
from .tolerances import judge, rel_error

__all__ = ["Case", "ProcessPool", "Report", "WorkerError", "case_error", "check_case", "dense_attention",
           "dense_mask", "judge", "make_inputs", "rel_error", "run_case"]
