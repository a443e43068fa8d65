"""What the fuzz tests share: the hypothesis settings (``tests/test_fuzz.py`` too), and for the integrations'
fuzzes (``tests/test_*_fuzz.py``) CI's derandomized sample and the long run (``-m slow``, depth from
``SEQPAR_FUZZ_EXAMPLES``) that draws fresh examples and keeps going after a failure, failing at the end with every
one. ``check(example)`` raises on a mismatch."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy


def fuzz_settings(examples: int, derandomize: bool) -> settings:
    """Every fuzz test's hypothesis settings: no deadline, no example database, the blob printed on failure."""
    return settings(deadline=None, derandomize=derandomize, database=None, print_blob=True, max_examples=examples,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def sample(strategy: SearchStrategy, examples: int, check: Callable[[Any], None]) -> None:
    """CI: ``examples`` derandomized (reproducible) examples; the first failure fails the test."""
    @fuzz_settings(examples, derandomize=True)
    @given(example=strategy)
    def run(example):
        check(example)

    run()


def long_run(strategy: SearchStrategy, default: int, check: Callable[[Any], None], label: str) -> None:
    """The long run: ``SEQPAR_FUZZ_EXAMPLES`` (else ``default``) fresh examples, every failure kept."""
    failures: list[str] = []

    @fuzz_settings(int(os.environ.get("SEQPAR_FUZZ_EXAMPLES", str(default))), derandomize=False)
    @given(example=strategy)
    def run(example):
        try:
            check(example)
        except Exception as e:                          # kept, and the run goes on: the test fails at the end
            failures.append(f"{label} {example}\n{str(e)[-1500:]}")

    run()
    assert not failures, "\n\n".join(failures)
