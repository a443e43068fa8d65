"""Note [Equal blocks as a batch] (``seqpar.kernels.executor``): equal full or causal blocks one after another on a
diagonal - Llama 4's chunks, equal documents - run as one kernel call with the blocks as its batch.

The structure (which runs stack, one kernel call for them), the runner's batched call against the same blocks one
call each (forward and backward, one batch and two, GQA, the lse gradient), and the methods that run a whole
sequence against itself (Ulysses, USP) against the fp64 oracle at W = 1, 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_ok, run_cases_batched

from seqpar import masks
from seqpar.kernels.executor import TaskRunner, stacked
from seqpar.layouts.blocks import Rule, Task
from seqpar.masks.forms import Band, Stacked, dense
from seqpar.methods._ulysses import local_tasks
from seqpar.numerics import GradRows
from seqpar.testing import Case

CAUSAL, FULL = Band(None, 0), Band()


def test_runs_of_equal_blocks_stack_and_nothing_else_does():
    blocks = tuple(Task(i * 4, i * 4 + 4, i * 4, i * 4 + 4, CAUSAL) for i in range(3))
    tail = Task(12, 14, 12, 14, CAUSAL)                                   # shorter: stays a block of its own
    out = stacked((*blocks, tail))
    assert out == (Task(0, 12, 0, 12, Stacked(3, CAUSAL)), tail)
    assert stacked(tuple(reversed(blocks))) == (Task(0, 12, 0, 12, Stacked(3, CAUSAL)),)    # order-free
    apart = (Task(0, 4, 0, 4, CAUSAL), Task(5, 9, 5, 9, CAUSAL))                           # a gap between them
    assert stacked(apart) is apart
    mixed = (Task(0, 4, 0, 4, CAUSAL), Task(4, 8, 4, 8, FULL))                             # different bands
    assert stacked(mixed) is mixed
    bands = (Task(0, 4, 0, 4, Band(-2, 0)), Task(4, 8, 4, 8, Band(-2, 0)))                 # windows never stack
    assert stacked(bands) is bands
    offset = (Task(0, 4, 4, 8, FULL), Task(4, 8, 8, 12, FULL), Task(8, 12, 0, 4, FULL))    # keys after the rows
    assert stacked(offset) == (Task(0, 8, 4, 12, Stacked(2, FULL)), offset[2])


def test_stacked_mask_is_the_blocks_on_the_diagonal():
    vis = dense(Stacked(2, CAUSAL), 4, 4)
    assert vis.tolist() == [[True, False, False, False], [True, True, False, False],
                            [False, False, True, False], [False, False, True, True]]


@pytest.mark.parametrize(("kernel", "size"), [("reference", 32), ("auto", 16)])
def test_llama4_chunks_run_as_one_call(kernel, size):
    """Ulysses' whole-sequence tasks under chunks over 64 tokens: one kernel call, forward and backward. Three or
    more small blocks on a kernel that packs documents (the reference kernel's varlen) stay one varlen call; on CPU
    auto (``cpu_flash``, no varlen) four chunks stack."""
    tasks = local_tasks(64, Rule(True, mask=masks.chunked(size)), None, None)
    assert len(tasks) == 64 // size
    runner = TaskRunner(kernel, 0.3)
    q, k, v = (torch.randn(1, 64, h, 8) for h in (4, 2, 2))
    parts = runner.forward_each(tasks, q, k, v)
    assert [t.mask for t, _ in parts] == [Stacked(64 // size, CAUSAL)]
    calls = []
    kern = runner.kernel_for(q, k, parts[0][0], backward=True)
    real = kern.backward
    kern.backward = lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    try:
        ((_, res),) = parts
        runner.backward_all(GradRows(torch.randn_like(q), res.out, None), q, k, v, res.lse, tasks)
    finally:
        del kern.backward
    assert calls == [(64 // size, size, 4, 8)]                   # one backward call, the chunks as its batch


@pytest.mark.parametrize("kernel", ["reference", "cpu_flash"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("band", [CAUSAL, FULL], ids=["causal", "full"])
def test_batched_call_equals_one_call_per_block(kernel, batch, band):
    """The runner's one batched call against one call per block: out, lse and (with an lse gradient) dq, dk, dv.
    Two batches take the copy path of ``_batch`` (rows of a slice are not one stride apart across batches)."""
    torch.manual_seed(batch)
    n, count, L = 6, 3, 20                          # blocks at rows 1:19 of 20: a slice, not the whole tensor
    blocks = tuple(Task(1 + i * n, 1 + (i + 1) * n, 1 + i * n, 1 + (i + 1) * n, band) for i in range(count))
    (task,) = stacked(blocks)
    q, k, v = (torch.randn(batch, L, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    runner = TaskRunner(kernel, 0.35)
    got = runner.forward(q, k, v, task)
    want = [runner.forward(q, k, v, t) for t in blocks]
    torch.testing.assert_close(got.out, torch.cat([w.out for w in want], 1))
    torch.testing.assert_close(got.lse, torch.cat([w.lse for w in want], -1))

    out = torch.zeros(batch, L, 4, 8, dtype=torch.float64)
    lse = torch.zeros(batch, 4, L, dtype=torch.float64)
    out[:, task.q], lse[:, :, task.q] = got.out, got.lse
    rows = GradRows(torch.randn_like(out), out, torch.randn_like(lse))
    g = runner.backward(rows, q, k, v, lse, task)
    parts = [runner.backward(rows, q, k, v, lse, t) for t in blocks]
    for i, x in enumerate(g):
        torch.testing.assert_close(x, torch.cat([p[i] for p in parts], 1))


def _cases(world: int) -> list[Case]:
    S = 24 * world
    out = []
    for method, ulysses in (("ulysses", None), ("usp", world)):
        base = Case(method=method, layout="contiguous" if method == "ulysses" else "zigzag", ulysses=ulysses,
                    heads=4 * world, kv_heads=2 * world if world < 4 else world, head_dim=8, seq_len=S,
                    seed=world, lse_grad=True)
        out += [base.with_(mask=masks.chunked(S // 4), kernel=kernel, batch=batch)
                for kernel in ("reference", "auto") for batch in (1, 2)]
        out += [base.with_(cu_seqlens=(0, S // 3, 2 * S // 3, S)),                     # three equal documents
                base.with_(causal=False, cu_seqlens=(0, S // 2, S), kernel="auto"),    # two, full
                base.with_(mask=masks.chunked(S // 3), cu_seqlens=(0, S // 3, S - 2), valid_len=S - 2)]
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stacked_blocks_through_the_methods_match_the_oracle(pools, world):
    assert_all_ok(run_cases_batched(pools(world), _cases(world)))


def _fuzz_cases(world: int, n: int, seed: int) -> list[Case]:
    """``n`` random Ulysses / USP calls whose whole-sequence call holds equal blocks in a row: chunks dividing the
    length, or equal documents; with padding, windows, dtypes, GQA, a value dim, sinks, softcap, the lse gradient."""
    import math
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        method = rng.choice(["ulysses", "usp"])
        kv = rng.choice([1, 2, world, 2 * world])
        heads = math.lcm(kv, world) * rng.choice([1, 2])
        count, size = rng.randint(2, 5), world * rng.choice([2, 4, 6])
        S = count * size
        valid = S - rng.randint(1, size - 1) if rng.random() < 0.2 else None
        docs = None if rng.random() < 0.6 else (*range(0, S - size + 1, size), valid or S)   # the last cut short
        kernel = rng.choice(["reference", "auto"])
        softcap = rng.choice([0.0, 0.0, 5.0]) if kernel == "reference" else 0.0
        out.append(Case(method=method, layout="contiguous" if method == "ulysses" else rng.choice(["contiguous",
                                                                                                       "zigzag"]),
                        ulysses=world if method == "usp" else None, heads=heads, kv_heads=kv,
                        head_dim=rng.choice([4, 8, 16]), seq_len=S, batch=rng.choice([1, 2]),
                        causal=rng.random() < 0.7, mask=masks.chunked(size) if docs is None else None,
                        cu_seqlens=docs, valid_len=valid, kernel=kernel, softcap=softcap,
                        dtype=rng.choice(["float32", "float64", "bfloat16", "float16"]),
                        window=rng.choice([(-1, -1), (-1, -1), (size // 2, 0)]),
                        value_dim=rng.choice([None, None, 12]), sinks=rng.random() < 0.3,
                        lse_grad=rng.random() < 0.5, seed=rng.randint(0, 2**16)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_stacked_blocks_fuzz_long(pools, world):
    """The long run (``-m slow``): ``SEQPAR_FUZZ_EXAMPLES`` (default 60) random calls per world size, seeded by
    ``SEQPAR_FUZZ_SEED`` (default: fresh), against the fp64 oracle."""
    import os
    import random

    n = int(os.environ.get("SEQPAR_FUZZ_EXAMPLES", "60"))
    seed = int(os.environ.get("SEQPAR_FUZZ_SEED", str(random.randrange(2**31))))
    reports = run_cases_batched(pools(world), _fuzz_cases(world, n, seed + world))
    bad = [str(r) for r in reports if not r.ok]
    assert not bad, f"seed {seed}: {len(bad)} of {len(reports)} failed:\n" + "\n".join(bad)
