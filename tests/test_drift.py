"""Numerical drift: the error against an fp64 dense computation does not grow with the world size.

Per method and dtype (fp32, bf16): the same global problems at W = 2, 4, 8, 16 (tiny shapes: 64 tokens,
16 heads so Ulysses can split them 16 ways; three seeds) judged against the fp64 oracle (out, lse, dq,
dk, dv; for linear methods out, dq, dk, dv, dg against the fp64 recurrence). Every fp32 run must pass the
oracle tolerance (bf16 runs are judged by the oracle grids of each method; here a single draw against the
2x-single-device rule is noise - see below), and for every field the mean error over the seeds must satisfy
``error(W) <= 1.5 * error(2) + floor`` (floor: 1e-6 fp32, 1e-4 bf16). A max-normalised bf16 error is
quantised by one element's rounding, so single draws jump by 2x between equally good runs; the mean over
seeds is what a trend shows in.

Known, bounded exception - linear methods in bf16 (growth limit 2.0 instead of 1.5): LASP's gradients are
rounded twice on the rows that receive a cross-rank correction (the local pass's autograd returns bf16, the
fp32 correction is added, the sum is rounded again), and more rows receive one as W grows: the mean dq
error goes 2.3e-3 (W=2) -> 4.0e-3 (W=4, 8), then stays. Recomputing the local backward in fp32 makes it
flat at 2.0e-3 for every W (measured); that costs the bf16 speed of the local kernel, so it is the lasp
owner's call (reported), and this test pins the bound meanwhile.

The criterion has teeth: the peers' defect (ring-flash-attn #42: the running output kept in bf16, rounded
at every merge) is simulated on the ring and its bf16 error at W = 16 must violate the criterion - while
still passing the oracle tolerance, which is why this test exists in addition to the oracle grids.

Cost: this is the W = 16 sweep (16 processes on 2 cores); it is one test so that its time is visible.
"""

from __future__ import annotations

from _workers_reliability import run_cases_list
from linear_cases import LinearCase, check_linear_case, run_linear_cases
from reliability_methods import LINEAR, SOFTMAX, linear_layout, padded_length, softmax_setup

from seqpar.testing import Case, check_case

WORLDS = (2, 4, 8, 16)
GROWTH = 1.5
LINEAR_BF16_GROWTH = 2.0        # double rounding of LASP gradients (module docstring)
FLOOR = {"float32": 1e-6, "bfloat16": 1e-4}
SEEDS = (5, 6, 7)
LENGTH = 64


def _softmax_cases(world: int) -> list[Case]:
    cases = []
    for method in SOFTMAX:
        s = softmax_setup(method, world)
        n = padded_length(s, world, LENGTH)      # the same 64 tokens at every W; end padding where needed
        for dtype in FLOOR:
            cases += [Case(method=method, layout=s.layout, ulysses=s.ulysses, options=s.options, seq_len=n,
                           valid_len=None if n == LENGTH else LENGTH, heads=16, kv_heads=4, head_dim=8,
                           dtype=dtype, seed=seed) for seed in SEEDS]
    return cases


def _linear_cases() -> list[LinearCase]:
    return [LinearCase(method=m, layout=linear_layout(m), gate="scalar", seq_len=64, chunk_size=4, dtype=dtype,
                       seed=seed) for m in LINEAR for dtype in FLOOR for seed in SEEDS]


def _grows(errors: dict[int, float], dtype: str, growth: float = GROWTH) -> list[str]:
    base = errors[WORLDS[0]]
    return [f"W={w}: {e:.2e} > {growth} * {base:.2e} + {FLOOR[dtype]:.0e}" for w, e in errors.items()
            if e > growth * base + FLOOR[dtype]]


def _growth(method: str, dtype: str) -> float:
    return LINEAR_BF16_GROWTH if method in LINEAR and dtype == "bfloat16" else GROWTH


def _add(errors: dict, key: tuple[str, str, str], world: int, error: float) -> None:
    """Accumulate the mean over seeds."""
    errors.setdefault(key, {}).setdefault(world, 0.0)
    errors[key][world] += error / len(SEEDS)


def test_error_does_not_grow_with_world_size(pools):
    errors: dict[tuple[str, str, str], dict[int, float]] = {}
    lossy: dict[int, float] = {}
    failed = []
    for world in WORLDS:
        pool = pools(world)
        cases = _softmax_cases(world)
        results = pool.run(run_cases_list, cases)
        for i, case in enumerate(cases):
            report = check_case(case, [r[i] for r in results])
            failed += [] if report.ok or case.dtype != "float32" else [f"W={world}: {report}"]
            for f, v in report.verdicts.items():
                _add(errors, (case.method, case.dtype, f), world, v.error)
        lin = _linear_cases()
        per_rank = pool.run(run_linear_cases, lin)
        for i, case in enumerate(lin):
            report = check_linear_case(case, [r[i] for r in per_rank])
            failed += [] if report.ok or case.dtype != "float32" else [f"W={world}: {report}"]
            for f, e in report.errors.items():
                _add(errors, (case.method, case.dtype, f), world, e)
        if world in (WORLDS[0], WORLDS[-1]):
            rings = [Case(method="ring", layout="zigzag", seq_len=64, heads=16, kv_heads=4, head_dim=8,
                          dtype="bfloat16", seed=seed) for seed in SEEDS]
            results = pool.run(run_cases_list, rings, True)
            lossy[world] = sum(check_case(c, [r[i] for r in results]).verdicts["out"].error
                               for i, c in enumerate(rings)) / len(SEEDS)
    assert not failed, "\n".join(failed)
    grown = {key: g for key, errs in errors.items() if (g := _grows(errs, key[1], _growth(key[0], key[1])))}
    assert not grown, "error grows with the world size:\n" + "\n".join(f"{k}: {v}" for k, v in grown.items())
    assert _grows(lossy, "bfloat16"), f"the criterion misses the simulated bf16-accumulator defect: {lossy}"
