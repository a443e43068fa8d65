"""The copy-engine ring (``transport="copy_engine"``, Note [Copy-engine ring] in ``seqpar.comm.symmetric``) on real
NCCL groups of 2 and 4 GPUs: every result bitwise equal to the NCCL ring's (the same kernels in the same order, only
the bytes' route differs), both judged against the dense oracle, eager and replayed as CUDA graphs."""

import pytest
import torch
from conftest import new_pool

from seqpar.testing.cases import Case, check_case, run_cases

pytestmark = pytest.mark.gpu

FIELDS = ("out", "lse", "dq", "dk", "dv")


def _cases(world: int) -> list[Case]:
    base = Case(method="ring", seq_len=1024 * world, heads=8, kv_heads=2, head_dim=64, dtype="bfloat16",
                kernel="auto", device="cuda")
    docs = (0, 100 * world, 300 * world, 1024 * world)
    return [base, base.with_(layout="contiguous", causal=False), base.with_(dtype="float32", kernel="reference"),
            base.with_(cu_seqlens=docs), base.with_(layout="stripe", options=(("head_chunks", 2),)),
            base.with_(heads=4, kv_heads=4, window=(700 * world // 2, 0), layout="contiguous")]


def _with(case: Case, transport: str, **kw) -> Case:
    return case.with_(options=tuple(sorted({**dict(case.options), "transport": transport}.items())), **kw)


@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_ring_equals_the_nccl_ring(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    cases = _cases(world)
    nccl = [_with(c, "nccl") for c in cases]
    # eager (graphs off), then graphs on: the first call runs eagerly, the second is captured, the third replays
    copy = [_with(c, "copy_engine", graphs=False) for c in cases]
    graphed = [_with(c, "copy_engine", graphs=True) for c in cases for _ in range(3)]
    with new_pool(world, backend="nccl", timeout=600) as pool:
        got = pool.run(run_cases, nccl + copy + graphed)
    n = len(cases)
    for i, case in enumerate(cases):
        want = [r[i] for r in got]
        report = check_case(nccl[i], want)
        assert report.ok, str(report)
        for j, label in [(n + i, "eager"), *((2 * n + 3 * i + t, f"graphed call {t}") for t in range(3))]:
            for rank, r in enumerate(got):
                for f in FIELDS:
                    assert torch.equal(r[j][f], want[rank][f]), (
                        f"{case.label()} {label}: rank {rank}'s {f} differs from the NCCL ring's")
