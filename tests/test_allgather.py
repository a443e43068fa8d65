"""All-gather KV ("llama3") against the dense oracle, its plan, its communication layer and its errors.

PEERS.md §1 defect 4 (llama3 reduce-scatters dK/dV in bf16, blocking): our wire is fp32 by default and the
bf16 error does not grow with the world size; ``grad_dtype`` is honoured, not ignored. Defect 7 (llama3 is
contiguous, hence causally imbalanced): zigzag gives every rank the same work.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import assert_all_ok, run_cases

from seqpar.layouts import Contiguous, Rule, Zigzag
from seqpar.masks import Band
from seqpar.methods.allgather import gather_plan
from seqpar.testing import Case

LAYOUTS = ["contiguous", "zigzag"]
AG = "allgather"


def _grid(world: int, layout: str) -> list[Case]:
    seq = 4 * world if world < 8 else 32
    base = Case(method=AG, layout=layout, seq_len=seq, heads=4, head_dim=8, seed=world)
    cases = []
    for causal in (True, False):
        cases += [base.with_(causal=causal, kv_heads=4),
                  base.with_(causal=causal, kv_heads=2, dtype="bfloat16", options=(("heads_k_stride", 1),)),
                  base.with_(causal=causal, kv_heads=1, seed=world + 1)]
    cases += [base.with_(batch=2, kv_heads=4, options=(("heads_k_stride", 2),)),
              base.with_(heads=2, kv_heads=1, head_dim=16, dtype="float64"),
              base.with_(heads=2, kv_heads=2, dtype="float16", scale=0.3)]
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_allgather_matches_oracle(pools, world):
    assert_all_ok(run_cases(pools(world), [c for lay in LAYOUTS for c in _grid(world, lay)]))


def test_bf16_error_does_not_grow_with_world_size(pools):
    """PEERS §1 defect 4: dK/dV partials are summed in fp32 on the wire, so W = 8 is no worse than W = 2."""
    cases = [Case(method=AG, layout=lay, seq_len=64, heads=4, kv_heads=2, head_dim=16, dtype="bfloat16", seed=3,
                  options=(("heads_k_stride", 1),)) for lay in LAYOUTS]
    r8 = run_cases(pools(8), cases)
    r2 = run_cases(pools(2), cases)
    for a, b in zip(r2, r8):
        assert a.ok and b.ok, f"{a}\n{b}"
        for f in ("out", "dq", "dk", "dv"):
            e2, e8 = a.verdicts[f].error, b.verdicts[f].error
            assert e8 <= 1.25 * e2 + 1e-4, f"{a.case.layout} {f}: error {e8:.2e} at W=8 vs {e2:.2e} at W=2"


def test_grad_dtype_is_the_wire_dtype(pools):
    """grad_dtype=bf16 puts dK/dV partials on the wire in bf16 (bigger dk/dv error); fp32 is the default."""
    case = Case(method=AG, layout="zigzag", seq_len=32, heads=4, kv_heads=2, head_dim=16, seed=5)
    fp32, bf16 = run_cases(pools(2), [case, case.with_(options=(("grad_dtype", torch.bfloat16),))])
    assert fp32.ok, fp32
    for f in ("out", "lse", "dq"):
        assert bf16.verdicts[f].error == pytest.approx(fp32.verdicts[f].error, abs=1e-9), f
    for f in ("dk", "dv"):
        assert 1e-4 < bf16.verdicts[f].error < 2e-2, bf16
        assert bf16.verdicts[f].error > 10 * fp32.verdicts[f].error, (bf16, fp32)


def test_lse_gradient_and_head_dim_256(pools):
    cases = [Case(method=AG, layout="zigzag", seq_len=8, heads=4, kv_heads=2, lse_grad=True,
                  options=(("heads_k_stride", 1),)),
             Case(method=AG, layout="contiguous", causal=False, seq_len=8, lse_grad=True, dtype="float64"),
             Case(method=AG, layout="zigzag", seq_len=4, heads=2, kv_heads=1, head_dim=256)]
    assert_all_ok(run_cases(pools(2), cases))


# ---- the plan (single process) ----

def _cells(task) -> int:
    lo, hi = task.mask.lo, task.mask.hi
    return sum(1 for i in range(task.rows) for j in range(task.cols)
               if (lo is None or j - i >= lo) and (hi is None or j - i <= hi))


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_is_two_bottom_right_calls(world):
    """Note [Gather into global order]: front chunk vs keys [0, (r+1)h), back chunk vs [0, (2W-r)h)."""
    h = 3
    lay = Zigzag(world)
    seq = 2 * world * h
    for r in range(world):
        gp = gather_plan(lay, r, seq, Rule(True), None, None)
        if r == world - 1:                           # chunks W-1 and W are adjacent: one causal call
            (t,) = gp.tasks
            assert (t.q, t.k) == (slice(0, 2 * h), slice(0, (world + 1) * h))
        else:
            front, back = sorted(gp.tasks, key=lambda t: t.q_start)
            assert (front.q, front.k) == (slice(0, h), slice(0, (r + 1) * h))
            assert (back.q, back.k) == (slice(h, 2 * h), slice(0, (2 * world - r) * h))
        for t in gp.tasks:
            assert t.mask == Band(None, t.cols - t.rows), "bottom-right causal"
        if world > 1:
            assert gp.order is not None and sorted(gp.order) == list(range(2 * world))
        assert len(gather_plan(lay, r, seq, Rule(False), None, None).tasks) == 1
        cgp = gather_plan(Contiguous(world), r, seq, Rule(True), None, None)
        assert cgp.order is None and len(cgp.tasks) == 1


def test_zigzag_balances_causal_work_contiguous_does_not():
    """PEERS §1 defect 7: llama3's contiguous split is causally imbalanced; zigzag is exact."""
    world, seq = 4, 32
    for lay, balanced in ((Zigzag(world), True), (Contiguous(world), False)):
        work = [sum(_cells(t) for t in gather_plan(lay, r, seq, Rule(True), None, None).tasks) for r in range(world)]
        assert sum(work) == seq * (seq + 1) // 2
        assert (len(set(work)) == 1) == balanced, (lay, work)


def test_documents_one_call_per_piece_and_no_shared_rows():
    world, seq = 3, 24
    bounds = (0, 1, 2, 9, 10, 20, 24)               # length-1 documents, one spanning three chunks
    for lay in (Contiguous(world), Zigzag(world)):
        for rule in (Rule(True), Rule(False), Rule(True, (2, -1)), Rule(False, (1, 3))):
            for r in range(world):
                gp = gather_plan(lay, r, seq, rule, bounds, None)
                pieces = lay.segments(r, seq).cut(bounds).runs
                assert len(gp.tasks) <= len(pieces)
                rows = sorted((t.q_start, t.q_stop) for t in gp.tasks)
                assert all(a[1] <= b[0] for a, b in itertools.pairwise(rows)), "a query row in two calls"
                for t in gp.tasks:                   # keys never leave the query's document
                    qpos = lay.segments(r, seq).positions()[t.q_start]
                    doc = max(d for d in range(len(bounds) - 1) if bounds[d] <= qpos)
                    assert bounds[doc] <= t.k_start and t.k_stop <= bounds[doc + 1]


# ---- communication layer and errors (distributed workers) ----

def _comm_worker(world_unused: int) -> dict:
    import torch.distributed as dist

    from seqpar.comm.all_gather import AllGather

    ag = AllGather(None)
    r, w = dist.get_rank(), dist.get_world_size()
    send = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r
    recv = torch.empty(2 * w, 3)
    h = ag.gather(send, recv)
    h.wait()
    h.wait()                                          # idempotent
    big = torch.ones(2 * w, 3, dtype=torch.float64) * (r + 1)
    big[2 * r:2 * r + 2] += 10
    small = torch.empty(2, 3, dtype=torch.float64)
    ag.reduce_scatter(big, small).wait()
    errors = []
    for bad in (lambda: ag.gather(send, torch.empty(2 * w + 1, 3)),
                lambda: ag.gather(send, torch.empty(2 * w, 3, dtype=torch.float64)),
                lambda: ag.reduce_scatter(torch.empty(2 * w, 3).t(), torch.empty(3, 2))):
        try:
            bad()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return {"recv": recv, "small": small, "errors": errors}


def test_all_gather_and_reduce_scatter(pools):
    w = 2
    res = pools(w).run(_comm_worker, w)
    want = torch.cat([torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * j for j in range(w)])
    total = sum(range(1, w + 1))
    for got in res:
        assert torch.equal(got["recv"], want)
        assert torch.equal(got["small"], torch.full((2, 3), float(total + 10), dtype=torch.float64))
        assert all(e is not None for e in got["errors"]), got["errors"]


def _error_worker(_: int) -> list[str]:
    import seqpar

    q = torch.randn(1, 4, 4, 8)
    k = torch.randn(1, 4, 4, 8)
    out = []
    for kw in ({"heads_k_stride": 3}, {"heads_k_stride": 0}, {"heads_k_stride": True}, {"heads_k_stride": 2.0},
               {"node_size": 2}, {"layout": "stripe"}):
        try:
            seqpar.attention(q, k, k, method=AG, **{"layout": "zigzag", **kw})
            out.append("no error")
        except (ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_bad_options_raise_before_any_collective(pools):
    msgs = pools(2).run(_error_worker, 0)[1]
    for m in msgs[:4]:
        assert m.startswith("ValueError: heads_k_stride must be None or a positive divisor of the KV heads (4)"), m
        assert "(rank 1 of 2)" in m
    assert msgs[4].startswith("TypeError: method='allgather' takes options ['heads_k_stride']"), msgs[4]
    assert msgs[5].startswith("ValueError: layout must be one of ['contiguous', 'zigzag', 'balanced'"), msgs[5]
