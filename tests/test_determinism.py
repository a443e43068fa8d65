"""Determinism: ``deterministic=True`` gives bitwise-identical out, lse and gradients across runs.

Each method runs the same cases twice in one pool and once more in a fresh pool (new processes); every
local tensor of every rank must be bitwise equal (``torch.equal``) across the three runs. The cases cover
what changes reduction orders: GQA (replicated KV heads in Ulysses), documents and windows (many tasks per
step merged in a fixed order), bf16 (a rounding per step would show), non-causal linear attention (its
all-reduce becomes an ordered all-gather sum under ``deterministic``).
"""

from __future__ import annotations

import pytest
import torch
from _workers_reliability import run_cases_raw, run_linear_raw
from conftest import new_pool
from linear_cases import LinearCase
from reliability_methods import LINEAR, SOFTMAX, linear_layout, softmax_setup

from seqpar.testing import Case, WorkerError

W = 4


@pytest.fixture(scope="module")
def fresh_pool():
    """A second pool of new processes, started after the shared one has run the same cases."""
    pool = new_pool(W, timeout=600)
    yield pool
    pool.close()


def _softmax_cases(method: str) -> list[Case]:
    s = softmax_setup(method, W)
    base = Case(method=method, layout=s.layout, ulysses=s.ulysses, options=s.options, seq_len=32, heads=4,
                kv_heads=1, head_dim=8, deterministic=True, lse_grad=True)
    return [base, base.with_(dtype="bfloat16", causal=False, kv_heads=2, seed=1),
            base.with_(window=(6, 0), cu_seqlens=(0, 5, 17, 29), valid_len=29, seed=2)]


def _linear_cases(method: str) -> list[LinearCase]:
    base = LinearCase(method=method, layout=linear_layout(method), gate="scalar", seq_len=32, dtype="float32")
    cases = [base, base.with_(gate="dim", dtype="bfloat16", cu_seqlens=(0, 9, 32), seed=1)]
    if method == "lasp2":
        cases.append(base.with_(gate="none", causal=False, seed=2))
    return cases


def _assert_bitwise(label: str, runs: list[list[list[dict]]]) -> None:
    first = runs[0]
    for n, other in enumerate(runs[1:], start=2):
        for rank, (a_all, b_all) in enumerate(zip(first, other)):
            for i, (a, b) in enumerate(zip(a_all, b_all)):
                for f, t in a.items():
                    if isinstance(t, torch.Tensor):
                        assert torch.equal(t, b[f]), \
                            f"{label} case {i}: {f} on rank {rank} differs between run 1 and run {n} " \
                            f"(max diff {(t.double() - b[f].double()).abs().max().item():.3e})"


@pytest.mark.parametrize("method", SOFTMAX + LINEAR)
def test_deterministic_runs_are_bitwise_identical(pools, fresh_pool, method):
    if method in LINEAR:
        fn, cases = run_linear_raw, _linear_cases(method)
    else:
        fn, cases = run_cases_raw, _softmax_cases(method)
    try:
        runs = [pools(W).run(fn, cases), pools(W).run(fn, cases), fresh_pool.run(fn, cases)]
    except WorkerError as e:
        if method not in ("ring", "ulysses", "usp", *LINEAR) and "Error" in str(e):
            pytest.skip(f"method {method!r} needs a setup these tests do not know: {str(e)[-300:]}")
        raise
    _assert_bitwise(method, runs)
