"""The copy-engine ring (``transport="copy_engine"``, Note [Copy-engine ring] in ``seqpar.comm.symmetric``) and
Ulysses' copy-engine all-to-alls (Note [Copy-engine all-to-all]) on real NCCL groups of 2 and 4 GPUs: the ring's
both backward paths (running sums, partials home), eager and replayed as CUDA graphs, every result judged against
the dense oracle, and - with deterministic kernels - bitwise equal to the same method on NCCL (the same kernels in
the same order: only the bytes' route differs). A graphed call's second call is its capture, its third a replay
(Note [Graphed calls] in ``seqpar.runtime.graphs``)."""

import pytest
import torch
from _workers_ulysses import run_calls
from conftest import new_pool

from seqpar.testing.cases import Case, check_case

pytestmark = pytest.mark.gpu

FIELDS = ("out", "lse", "dq", "dk", "dv")


def _cases(world: int) -> list[Case]:
    base = Case(method="ring", seq_len=1024 * world, heads=8, kv_heads=2, head_dim=64, dtype="bfloat16",
                kernel="auto", device="cuda", deterministic=True)
    docs = (0, 100 * world, 300 * world, 1024 * world)
    return [base, base.with_(layout="contiguous", causal=False), base.with_(dtype="float32", kernel="reference"),
            base.with_(cu_seqlens=docs), base.with_(layout="stripe", options=(("head_chunks", 2),)),
            base.with_(heads=4, kv_heads=4, window=(700 * world // 2, 0), layout="contiguous"),
            base.with_(deterministic=False, lse_grad=True)]


def _with(case: Case, transport: str, **kw) -> Case:
    return case.with_(options=tuple(sorted({**dict(case.options), "transport": transport}.items())), **kw)


def _agrees(pool, case: Case, short: bool, eager_calls: int) -> None:
    """``case`` on NCCL, then on copy engines: ``eager_calls`` eager calls of one plan and three graphed calls of
    another (warm-up, capture, replay), each within the oracle's tolerance and - with deterministic kernels -
    bitwise equal to NCCL's (the same kernels in the same order: only the bytes' route differs)."""
    want = [r[0] for r in pool.run(run_calls, short, _with(case, "nccl"), 1)]
    report = check_case(case, want)
    assert report.ok, str(report)
    eager = pool.run(run_calls, short, _with(case, "copy_engine", graphs=False), eager_calls)
    graphed = pool.run(run_calls, short, _with(case, "copy_engine", graphs=True), 3)
    runs = [*((f"eager call {t}", t, eager) for t in range(eager_calls)),
            *((f"graphed call {t}", t, graphed) for t in range(3))]
    for label, i, res in runs:
        got = [r[i] for r in res]
        report = check_case(case, got)
        assert report.ok, f"{label}: {report}"
        if case.deterministic:
            for rank, (g, w) in enumerate(zip(got, want)):
                for f in FIELDS:
                    assert torch.equal(g[f], w[f]), f"{case.label()} {label}: rank {rank}'s {f} differs from NCCL's"


@pytest.mark.parametrize("short", [False, True], ids=["running-sums", "partials-home"])
@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_ring_equals_the_nccl_ring(world, short):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    with new_pool(world, backend="nccl", timeout=600) as pool:
        for case in _cases(world):
            _agrees(pool, case, short, 1)


def _ulysses_cases(world: int) -> list[Case]:
    base = Case(method="ulysses", layout="contiguous", seq_len=1024 * world, heads=8, kv_heads=2, head_dim=64,
                dtype="bfloat16", kernel="auto", device="cuda", deterministic=True)
    return [base, base.with_(causal=False, dtype="float32", kernel="reference"),
            base.with_(cu_seqlens=(0, 100 * world, 300 * world, 1024 * world), options=(("head_chunks", 2),)),
            base.with_(heads=4, kv_heads=4, window=(700 * world // 2, 0)),
            base.with_(deterministic=False, lse_grad=True)]


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_on_copy_engines_equals_nccl(world):
    """Ulysses' all-to-alls pulled on copy engines (Note [Copy-engine all-to-all]): a plan's first call on NCCL (it
    learns the sizes), the next on copy engines - eager, captured, replayed (KV heads replicated at W = 4, head
    groups in flight at once, documents, a window, the lse gradient)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    with new_pool(world, backend="nccl", timeout=600) as pool:
        for case in _ulysses_cases(world):
            _agrees(pool, case, False, 2)


@pytest.mark.parametrize("short", [False, True], ids=["running-sums", "partials-home"])
def test_usp_on_copy_engines_equals_nccl(short):
    """USP 2 x 2 with ``transport="copy_engine"`` on four GPUs: the ring's hops pushed on its subgroup's lanes, the
    all-to-alls on NCCL; eager and graphed."""
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    base = Case(method="usp", layout="zigzag", ulysses=2, seq_len=4096, heads=8, kv_heads=2, head_dim=64,
                dtype="bfloat16", kernel="auto", device="cuda", deterministic=True)
    with new_pool(4, backend="nccl", timeout=600) as pool:
        for case in (base, base.with_(cu_seqlens=(0, 400, 1200, 4096), options=(("head_chunks", 2),))):
            _agrees(pool, case, short, 2)


@pytest.mark.parametrize("world", [2, 4])
def test_auto_with_copy_engines_allowed(world):
    """``method="auto", transport="copy_engine"`` on real NCCL groups: whatever auto picks (the ring on copy engines
    where the planner predicts it fastest) is correct against the oracle, eager and graphed."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    mha = Case(method="auto", seq_len=2048 * world, heads=8, kv_heads=8, head_dim=64, dtype="bfloat16",
               kernel="auto", device="cuda", options=(("transport", "copy_engine"),))
    with new_pool(world, backend="nccl", timeout=600) as pool:
        for case in (mha, mha.with_(heads=8, kv_heads=2), mha.with_(causal=False, layout="contiguous")):
            for short in (False, True):
                got = pool.run(run_calls, short, case.with_(graphs=True), 3)
                for t in range(3):
                    report = check_case(case, [r[t] for r in got])
                    assert report.ok, f"call {t}: {report}"
