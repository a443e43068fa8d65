"""Packed documents (global ``cu_seqlens``), end padding and ``shard_info``, for every method and layout.

Documents of random length (length 1 included), a document spanning three ranks, one document per rank,
documents with windows, padding that holds garbage, a rank that holds only padding (PEERS.md §7 defect 5:
NaN when every token of a rank is masked): out, lse, dq, dk, dv against the dense oracle with an
explicit mask. A leak test perturbs one token and checks that nothing outside its document and window moves.
PEERS.md §1 defect 7 (documents must divide by W / 2W) and §7 defect 2 (lengths silently rounded down):
lengths here are arbitrary, and a length the layout cannot split is padded or refused with the length needed.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from _cross import METHODS, method_cases
from conftest import assert_all_ok, run_cases

import seqpar
from seqpar.layouts import Contiguous, Stripe, Zigzag
from seqpar.layouts.varlen import shard_info
from seqpar.testing import Case, dense_attention, dense_mask

WORLDS = [2, 3, 4, 8]

def _random_docs(rng: random.Random, valid: int, ones: int = 2) -> tuple[int, ...]:
    cuts = set(rng.sample(range(1, valid), min(valid - 1, rng.randint(2, 5))))
    for _ in range(ones):                            # length-1 documents
        p = rng.randrange(1, valid - 1)
        cuts |= {p, p + 1}
    return (0, *sorted(cuts), valid)


def doc_cases(world: int) -> list[Case]:
    """The document mixes of the issue at ``world`` ranks (global length 6W: zigzag chunks of 3)."""
    S = 6 * world
    L = S // world
    rng = random.Random(world)
    span3 = (0, L // 2, min(2 * L + 1, S), S)        # one document over ranks 0..2 (contiguous split)
    base = Case(seq_len=S, heads=4, kv_heads=2, head_dim=8, seed=world)
    valid = S - 5
    return [
        base.with_(cu_seqlens=tuple(range(0, S + 1, L))),                                   # one per rank
        base.with_(cu_seqlens=_random_docs(rng, S)),                                         # random, 1s
        base.with_(causal=False, cu_seqlens=span3, window=(2, 3), dtype="bfloat16"),          # span 3 + window
        base.with_(cu_seqlens=_random_docs(rng, S), window=(4, -1), kv_heads=1),             # docs + window
        base.with_(causal=False, cu_seqlens=(0, 1, min(L + 2, valid - 1), valid), valid_len=valid,   # + padding
                   lse_grad=True),
        base.with_(valid_len=valid, window=(L, -1)),                                          # padding only
        base.with_(causal=False, valid_len=S - L - 1, kv_heads=4),   # the last contiguous rank is all padding
    ]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", WORLDS)
def test_documents_and_padding_match_oracle(pools, method, world):
    cases = [c for base in doc_cases(world) for c in method_cases(method, world, base)]
    assert_all_ok(run_cases(pools(world), cases))


# ---- the leak test ----

def _leak_worker(case: Case, t: int) -> dict:
    """Forward twice: the original inputs, then q, k, v of global token t perturbed. Local results."""
    from seqpar.testing import make_inputs

    mesh = None
    if case.ulysses is not None:
        mesh = seqpar.make_mesh(ulysses=case.ulysses, device_type="cpu")
    where = {"mesh": mesh, "method": case.method, "layout": case.layout}
    q, k, v, _, _ = make_inputs(case)
    outs = []
    for bump in (0.0, 3.0):
        qb, kb, vb = (x.clone() for x in (q, k, v))
        for x in (qb, kb, vb):
            x[:, t] += bump
        res = seqpar.attention(*(seqpar.shard(x, **where) for x in (qb, kb, vb)), causal=case.causal,
                               window_size=case.window, cu_seqlens=case.cu_seqlens, seq_len=case.valid_len,
                               kernel=case.kernel, return_lse=True, **where)
        outs.append((res.out, res.lse))
    return {"outs": outs, "positions": seqpar.positions(case.seq_len, **where)}


def _assemble(results, i, field, S):
    dim = 1 if field == 0 else 2
    parts = [r["outs"][i][field] for r in results]
    shape = list(parts[0].shape)
    shape[dim] = S
    full = parts[0].new_zeros(shape)
    for p, r in zip(parts, results):
        full.index_copy_(dim, r["positions"], p)
    return full


LEAK = [("ring", "zigzag"), ("ring", "stripe"), ("ring", "contiguous"), ("allgather", "zigzag"),
        ("allgather", "contiguous"), ("ulysses", "contiguous"), ("usp", "zigzag")]


@pytest.mark.parametrize("method,layout", [pytest.param(m, lay, marks=p.marks, id=f"{m}-{lay}")
                                           for m, lay in LEAK for p in METHODS if p.values[0] == m])
def test_perturbing_a_token_moves_nothing_outside_its_document_and_window(pools, method, layout):
    world, S = 4, 24
    cu = (0, 5, 6, 17, 24)
    t = 11                                           # inside document [6, 17)
    base = Case(seq_len=S, heads=4, kv_heads=2, head_dim=8, cu_seqlens=cu, seed=7)
    for causal, window in ((True, (3, -1)), (False, (2, 1)), (True, (-1, -1))):
        for case in method_cases(method, world, base.with_(causal=causal, window=window)):
            if case.layout != layout:
                continue
            res = pools(world).run(_leak_worker, case, t)
            sees = dense_mask(S, causal=causal, window=window, cu_seqlens=cu)
            affected = sees[:, t].clone()                # queries that see key t
            affected[t] = True                           # and t's own query
            o0, o1 = _assemble(res, 0, 0, S), _assemble(res, 1, 0, S)
            l0, l1 = _assemble(res, 0, 1, S), _assemble(res, 1, 1, S)
            label = case.label()
            assert torch.equal(o0[:, ~affected], o1[:, ~affected]), f"{label}: an output moved outside the window"
            assert torch.equal(l0[:, :, ~affected], l1[:, :, ~affected]), f"{label}: an lse moved"
            moved = (o0 - o1).abs().amax(dim=(0, 2, 3)) > 0
            assert torch.equal(moved, affected), f"{label}: rows that see token {t} must change"


# ---- shard_info (single process) and the padded user path (distributed) ----

@pytest.mark.parametrize("layout_cls", [Contiguous, Zigzag, Stripe])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_info_layouts(layout_cls, world):
    rng = random.Random(world)
    lay = layout_cls(world)
    for _ in range(20):
        seq_len = rng.randint(1, 5 * lay.divisor)
        cu = _random_docs(rng, seq_len, ones=1) if seq_len > 3 else (0, seq_len)
        infos = [shard_info(lay, r, seq_len, cu) for r in range(world)]
        total = infos[0].padded_len
        assert total % lay.divisor == 0 and 0 <= total - seq_len < lay.divisor
        allpos = torch.cat([i.positions for i in infos])
        assert torch.equal(allpos.sort().values, torch.arange(total))
        for r, info in enumerate(infos):
            assert torch.equal(info.positions, lay.positions(r, total))
            assert torch.equal(info.pad_mask, info.positions >= seq_len)
            doc = torch.bucketize(info.positions, torch.tensor(cu[1:]), right=True)
            real = ~info.pad_mask
            assert torch.equal(info.documents[real], doc[real]) and (info.documents[~real] == -1).all()
            start = torch.tensor(cu)[info.documents.clamp(min=0)]
            assert torch.equal(info.positions_in_document[real], (info.positions - start)[real])
            assert (info.positions_in_document[~real] == 0).all()
            c = info.cu_seqlens.tolist()
            assert info.cu_seqlens.dtype == torch.int32 and c[0] == 0 and c[-1] == info.positions.numel()
            stride = lay.segments(r, total).stride
            for a, b in itertools.pairwise(c):              # one document, consecutive positions
                assert a < b and len(set(info.documents[a:b].tolist())) == 1
                assert (info.positions[a + 1:b] - info.positions[a:b - 1] == stride).all()
            for b in c[1:-1]:                                # and nothing finer than that
                assert not (info.documents[b] == info.documents[b - 1]
                            and info.positions[b] - info.positions[b - 1] == stride)


def test_shard_info_docstring_example():
    r0, r1 = (shard_info(Zigzag(2), r, 10, [0, 3, 10]) for r in (0, 1))
    assert r0.positions.tolist() == [0, 1, 2, 9, 10, 11]
    assert r0.positions_in_document.tolist() == [0, 1, 2, 6, 0, 0]
    assert r0.documents.tolist() == [0, 0, 0, 1, -1, -1]
    assert r0.cu_seqlens.tolist() == [0, 3, 4, 6] and r0.max_seqlen == 3
    assert r1.cu_seqlens.tolist() == [0, 6] and r1.positions_in_document.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("layout_cls", [Contiguous, Zigzag])
def test_blocks_without_document_overlap_are_skipped(layout_cls):
    """One document per rank: no ring step after the first has work (the ring ends at once), and the
    all-gather plan reads only the rank's own document."""
    from seqpar.layouts import Rule
    from seqpar.methods import _passkv
    from seqpar.methods.allgather import gather_plan

    world, S = 4, 32
    lay = layout_cls(world)
    own = [lay.segments(r, S).positions() for r in range(world)]
    for causal in (True, False):
        if layout_cls is Contiguous:
            cu = tuple(range(0, S + 1, S // world))
            sched = _passkv.schedule(lay, 0, S, Rule(causal), cu, None)
            assert sched.n_steps == 1, sched
        else:                                    # zigzag: each rank's two chunks, as two documents
            cu = tuple(range(0, S + 1, S // world // 2))
        for r in range(world):
            gp = gather_plan(lay, r, S, Rule(causal), cu, None)
            assert gp.selection is not None and gp.selection.rows == len(own[r])   # nothing else travels
            for t in gp.tasks:
                assert set(gp.key_positions(t)) <= set(own[r]), (r, t)


def _padded_user_path(method: str, layout: str, S: int, cu: tuple[int, ...]) -> dict:
    """The user's path for a length the layout cannot split: shard(pad=True), attention(seq_len=), unshard."""
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, S, h, 8, generator=g) for h in (4, 2, 2, 4))
    where = {"method": method, "layout": layout}
    info = seqpar.shard_info(S, cu_seqlens=torch.tensor(cu, dtype=torch.int32), **where)
    ql, kl, vl = (seqpar.shard(x, pad=True, **where).requires_grad_() for x in (q, k, v))
    out = seqpar.attention(ql, kl, vl, cu_seqlens=torch.tensor(cu, dtype=torch.int32), seq_len=S, **where)
    (out * seqpar.shard(do, pad=True, **where)).sum().backward()
    full = {name: seqpar.unshard(x, seq_len=S, **where) for name, x in
            (("out", out.detach()), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad))}
    pad = info.pad_mask
    full["pad_rows"] = torch.stack([x[0, pad].abs().sum() for x in (out.detach(), ql.grad, kl.grad, vl.grad)])
    full["info"] = (info.positions, info.padded_len, ql.shape[1])
    return full


@pytest.mark.parametrize("method,layout", [("ring", "zigzag"), ("ring", "stripe"), ("allgather", "zigzag"),
                                           ("allgather", "contiguous")])
def test_uneven_length_is_padded_and_never_leaks(pools, method, layout):
    world, S = 4, 13                                 # zigzag over 4 ranks needs multiples of 8: padded to 16
    cu = (0, 1, 7, 13)
    res = pools(world).run(_padded_user_path, method, layout, S, cu)
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, S, h, 8, generator=g) for h in (4, 2, 2, 4))
    truth = dense_attention(q, k, v, do, causal=True, cu_seqlens=cu)
    for r, got in enumerate(res):
        for f in ("out", "dq", "dk", "dv"):
            assert got[f].shape[1] == S
            err = (got[f].double() - truth[f]).abs().max() / truth[f].abs().max()
            assert err < 1e-5, f"rank {r} {f}: {err:.2e}"
        assert (got["pad_rows"] == 0).all(), "padding rows must have zero output and gradients"
        _, padded, local = got["info"]
        divisor = world * (2 if layout == "zigzag" else 1)
        assert padded == -(-S // divisor) * divisor and local * world == padded


def _errors(_: int) -> list[str]:
    x = torch.randn(1, 16, 2, 8)
    msgs = []

    def attempt(fn):
        try:
            fn()
            msgs.append("no error")
        except (ValueError, TypeError, NotImplementedError) as e:
            msgs.append(f"{type(e).__name__}: {e}")

    xl = seqpar.shard(x, method="ring", layout="zigzag")                  # W = 4: 4 tokens per rank
    attempt(lambda: seqpar.shard(torch.randn(1, 15, 2, 8), method="ring", layout="zigzag"))
    attempt(lambda: seqpar.attention(xl, xl, xl, cu_seqlens=[0, 5, 15]))
    attempt(lambda: seqpar.attention(xl, xl, xl, cu_seqlens=torch.tensor([0.0, 16.0])))
    attempt(lambda: seqpar.attention(xl, xl, xl, cu_seqlens=[0, 9, 5, 16]))
    attempt(lambda: seqpar.attention(xl, xl, xl, seq_len=17))
    attempt(lambda: seqpar.shard_info(15, cu_seqlens=[0, 5, 14]))
    attempt(lambda: seqpar.attention(xl, xl, xl, method="allgather", layout="zigzag", cu_seqlens=[0, 5, 15]))
    return msgs


def test_lengths_are_never_silently_rounded(pools):
    """PEERS §7 defect 2 and §1 defect 6: a length that does not fit raises, naming the length needed."""
    msgs = pools(4).run(_errors, 0)[0]
    assert msgs[0].startswith("ValueError: global sequence length must be a multiple of 8") and "pad to 16" in msgs[0]
    assert msgs[1].startswith("ValueError: cu_seqlens must end at the global length 16 (or pass seq_len"), msgs[1]
    assert msgs[2].startswith("TypeError: cu_seqlens must be a 1D int32 tensor"), msgs[2]
    assert msgs[3].startswith("ValueError: cu_seqlens must start at 0 and be non-decreasing"), msgs[3]
    assert msgs[4].startswith("ValueError: seq_len / cu_seqlens[-1] must be in [1, 16]"), msgs[4]
    assert msgs[5].startswith("ValueError: cu_seqlens must start at 0, be non-decreasing and end at seq_len=15")
    assert msgs[6].startswith("ValueError: cu_seqlens must end at the global length 16"), msgs[6]
    assert all("(rank 0 of 4)" in m for m in msgs), msgs


# ---- Note [Varlen backward in row groups] ----

def test_row_groups_cut_at_documents_and_cover_the_call():
    from seqpar.kernels.executor import row_groups
    from seqpar.layouts.blocks import Task
    from seqpar.masks import Varlen

    cu = (0, 3, 3, 10, 11, 30, 31, 32)                       # an empty document, one longer than the bound
    task = Task(4, 36, 2, 34, Varlen(cu, cu, (-1, 0)))
    groups = row_groups(task, 8)
    assert [(t.q_start, t.q_stop) for t in groups] == [(4, 7), (7, 15), (15, 34), (34, 36)]
    at_q, at_k = task.q_start, task.k_start
    for t in groups:
        assert (t.q_start, t.k_start) == (at_q, at_k) and t.mask.window == (-1, 0)
        assert t.mask.cu_q[0] == 0 and t.mask.cu_q[-1] == t.rows and t.mask.cu_k[-1] == t.cols
        assert t.rows <= 8 or len(t.mask.cu_q) == 2, t             # over the bound only as one document
        at_q, at_k = t.q_stop, t.k_stop
    assert (at_q, at_k) == (task.q_stop, task.k_stop)


def _grouped_backward_worker(bounds: tuple[int, ...]) -> list[list[torch.Tensor]]:
    """``seqpar.attention``'s output and gradients at W = 1 on a packed row, once per bound on the rows of one
    varlen backward call, with the rows of each backward call made."""
    from seqpar.kernels import executor

    default, backward = executor.VARLEN_BWD_ROWS, executor.TaskRunner.backward
    calls: list[int] = []

    def spy(self, rows, q, k, v, lse, task):
        calls.append(task.rows)
        return backward(self, rows, q, k, v, lse, task)

    executor.TaskRunner.backward = spy
    runs = []
    try:
        for bound in bounds:
            executor.VARLEN_BWD_ROWS = bound
            calls.clear()
            g = torch.Generator().manual_seed(3)
            q, k, v, do = (torch.randn(2, 40, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            out = seqpar.attention(*leaves, method="ring", layout="contiguous", cu_seqlens=(0, 1, 9, 9, 23, 24, 37, 40),
                                   kernel="reference")
            runs.append([out.detach(), *torch.autograd.grad(out, leaves, do), torch.tensor(calls)])
    finally:
        executor.TaskRunner.backward, executor.VARLEN_BWD_ROWS = backward, default
    return runs


def test_varlen_backward_in_row_groups_equals_one_call(pools):
    """Row groups of at most 16 rows (B = 2: 8 positions) give exactly the one-call gradients, and both match
    the dense oracle."""
    (*one, one_calls), (*cut, cut_calls) = pools(1).run(_grouped_backward_worker, (1 << 30, 16))[0]
    assert one_calls.tolist() == [40] and cut_calls.tolist() == [1, 8, 14, 1, 13, 3], (one_calls, cut_calls)
    for a, b in zip(one, cut):
        assert torch.equal(a, b)
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 40, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    want = dense_attention(q, k, v, do, causal=True, cu_seqlens=(0, 1, 9, 9, 23, 24, 37, 40))
    for name, got in zip(("out", "dq", "dk", "dv"), cut):
        torch.testing.assert_close(got, want[name], rtol=1e-10, atol=1e-10)


def test_varlen_packing_keeps_large_blocks_alone_and_the_reference_kernel_out():
    """``TaskRunner.prepare``: small per-document blocks pack into one varlen call, blocks of ``GROUP_ROWS`` rows
    keep their own call - unless block shapes vary batch to batch (documents: Note [Plans per shape]), when
    they pack too - and CPU auto never packs blocks that cpu_flash serves one by one into a reference call."""
    from seqpar.kernels.executor import GROUP_ROWS, TaskRunner
    from seqpar.layouts.blocks import Task
    from seqpar.masks import Band, Varlen

    n = GROUP_ROWS + 12
    q = k = torch.zeros(1, n, 2, 8)
    small = tuple(Task(a, a + 4, a, a + 4, Band(None, 0)) for a in (0, 4, 8))
    big = Task(12, n, 12, n, Band(None, 0))
    packed = TaskRunner("reference", 1.0).prepare((*small, big), q, k)
    assert big in packed and sum(isinstance(t.mask, Varlen) for t in packed) == 1 and len(packed) == 2
    varying = TaskRunner("reference", 1.0, shapes_vary=True).prepare((*small, big), q, k)
    assert len(varying) == 1 and isinstance(varying[0].mask, Varlen)
    assert TaskRunner("auto", 1.0).prepare(small, q, k) == small       # cpu_flash per block, not reference varlen
