"""Shipped test helpers: the dense oracle and oracle cases, with the process pool (``seqpar.pool``) and the
tolerances (``seqpar.tolerances``) they use, which shipped code (``verify``, calibration, the demo) uses too.

    from seqpar.testing import Case, ProcessPool, check_case, run_case
    with ProcessPool(4) as pool:
        report = check_case(case, pool.run(run_case, case))
"""

from __future__ import annotations

from ..pool import ProcessPool, WorkerError
from ..tolerances import judge, rel_error
from .cases import Case, Report, case_error, check_case, make_inputs, run_case
from .oracle import dense_attention, dense_mask

__all__ = ["Case", "ProcessPool", "Report", "WorkerError", "case_error", "check_case", "dense_attention",
           "dense_mask", "judge", "make_inputs", "rel_error", "run_case"]
