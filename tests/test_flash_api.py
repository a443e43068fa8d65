"""ring-flash-attn style names (``seqpar.flash_api`` = ``seqpar.compat.ring_flash_attn``) against the dense oracle.

Each name is called exactly as a ring-flash-attn user would (local shards, flash-attn arguments,
``return_attn_probs=True``), and out, lse, dq, dk, dv are judged like every method test. PEERS.md §1:
defect 1 (dq returned in bf16: dtypes are checked), 2 (windows in local coordinates), 6 (zigzag defaults to
causal=False and then fails: here it runs), 7 (documents must divide by W; cu_seqlens_q != cu_seqlens_k).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_ok

import seqpar
from seqpar import flash_api
from seqpar.testing import Case, check_case, make_inputs

LAYOUT = {"ring": "contiguous", "zigzag_ring": "zigzag", "stripe": "stripe"}


def _family(name: str) -> str:
    return next(f for f in ("zigzag_ring", "ring", "stripe", "llama3") if name.startswith(f))


def _call(name: str, case: Case, q, k, v, extra: dict):
    """Call ``flash_api.<name>`` the ring-flash-attn way; returns (out, lse, None)."""
    fn = getattr(flash_api, name)
    packed = "qkvpacked" if "qkvpacked" in name else "kvpacked" if "kvpacked" in name else None
    varlen = "varlen" in name
    dim = 1 if varlen else 2
    if packed == "qkvpacked":
        head = (torch.stack((q, k, v), dim),)
    elif packed == "kvpacked":
        head = (q, torch.stack((k, v), dim))
    else:
        head = (q, k, v)
    kw = {"causal": case.causal, "window_size": case.window, "softmax_scale": case.scale, "return_attn_probs": True,
          **extra}
    if not varlen:
        return fn(*head, **kw)
    cu = torch.tensor(case.cu_seqlens or (0, case.seq_len), dtype=torch.int32)
    if _family(name) != "llama3":              # seqpar's stream convention: global boundaries, layout= keyword
        return fn(*head, cu, int((cu[1:] - cu[:-1]).max()), layout=case.layout, **kw)
    stride = dict(case.options).get("heads_k_stride")
    if case.layout != "contiguous":            # global boundaries in both slots, no slice
        return fn(*head, cu, cu, None, None, stride, None, layout=case.layout, **kw)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cu_q, cu_k, max_q, max_k, k_slice = flash_api.llama3_flash_attn_prepare_cu_seqlens(cu, case.causal, rank, world)
    return fn(*head, cu_q, cu_k, max_q, max_k, stride, k_slice, **kw)        # ring-flash-attn's per-rank values


def _worker(case: Case, name: str, extra: dict) -> dict:
    """Like ``seqpar.testing.run_case``, through a flash_api name; varlen names run on batch 1."""
    where = {"method": case.method, "layout": case.layout}
    q, k, v, do, _ = make_inputs(case)
    varlen = "varlen" in name
    ql, kl, vl = (seqpar.shard(t, **where) for t in (q, k, v))
    dol = seqpar.shard(do, **where)
    if varlen:
        ql, kl, vl, dol = (t[0] for t in (ql, kl, vl, dol))
    for t in (ql, kl, vl):
        t.requires_grad_()
    out, lse, none = _call(name, case, ql, kl, vl, extra)
    assert none is None
    (out.float() * dol.float()).sum().backward()
    res = {"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    if varlen:
        assert lse.shape == (case.heads, ql.shape[0]), "varlen lse is (heads, total_local)"
        res = {f: t.unsqueeze(0) for f, t in res.items()}
    local = {f: t.detach() for f, t in res.items()}
    local["positions"] = seqpar.positions(case.seq_len, **where)
    local["times"] = (0.0, 0.0)
    return local


def _judge(pool, case: Case, name: str, extra: dict | None = None):
    report = check_case(case, pool.run(_worker, case, name, extra or {}))
    if not report.ok:
        report.problems.append(f"called as seqpar.flash_api.{name}")
    return report


def _batch_cases() -> list[tuple[Case, str]]:
    out = []
    for fam, layout in LAYOUT.items():
        base = Case(method="ring", layout=layout, seq_len=24, heads=4, kv_heads=2, head_dim=8, seed=len(fam))
        out += [(base.with_(causal=False), f"{fam}_flash_attn_func"),          # zigzag: causal=False runs
                (base.with_(window=(3, -1), dtype="bfloat16"), f"{fam}_flash_attn_kvpacked_func"),
                (base.with_(kv_heads=4, causal=True), f"{fam}_flash_attn_qkvpacked_func")]
    return out


def test_batch_names_match_oracle(pools):
    assert_all_ok([_judge(pools(3), c, n) for c, n in _batch_cases()])


def _varlen_cases() -> list[tuple[Case, str]]:
    cu = (0, 1, 9, 10, 17, 24)                      # length-1 documents, one spanning three ranks' chunks
    out = []
    for fam, layout in LAYOUT.items():
        base = Case(method="ring", layout=layout, seq_len=24, heads=4, kv_heads=2, head_dim=8, cu_seqlens=cu)
        out += [(base, f"{fam}_flash_attn_varlen_func"),
                (base.with_(causal=False, window=(2, 1)), f"{fam}_flash_attn_varlen_kvpacked_func"),
                (base.with_(kv_heads=4, dtype="bfloat16"), f"{fam}_flash_attn_varlen_qkvpacked_func")]
    for layout in ("contiguous", "zigzag"):
        base = Case(method="allgather", layout=layout, seq_len=24, heads=4, kv_heads=2, head_dim=8, cu_seqlens=cu,
                    options=(("heads_k_stride", 1),))
        out += [(base, "llama3_flash_attn_varlen_func"),
                (base.with_(causal=False, options=()), "llama3_flash_attn_varlen_kvpacked_func"),
                (base.with_(kv_heads=4, window=(4, -1)), "llama3_flash_attn_varlen_qkvpacked_func")]
    return out


def test_varlen_names_match_oracle(pools):
    assert_all_ok([_judge(pools(3), c, n) for c, n in _varlen_cases()])


def test_return_attn_probs_false_returns_the_output_only(pools):
    res = pools(3).run(_plain_worker, 0)
    assert all(r == ((1, 8, 4, 8), (8, 4, 8)) for r in res), res


def _plain_worker(_: int):
    q = torch.randn(1, 8, 4, 8)
    a = flash_api.zigzag_ring_flash_attn_func(q, q, q, causal=True)
    b = flash_api.llama3_flash_attn_varlen_func(q[0], q[0], q[0], [0, 24], [0, 24], causal=True)
    return tuple(a.shape), tuple(b.shape)


# ---- llama3_flash_attn_prepare_cu_seqlens: ring-flash-attn's per-rank values ----

def test_llama3_prepare_matches_ring_flash_attn_values():
    """Hand-derived from ring-flash-attn's definition: documents [0,3) [3,10) [10,13) [13,16) over 4 ranks."""
    cu = torch.tensor([0, 3, 10, 13, 16], dtype=torch.int32)
    want = {  # rank: (causal: cu_q, cu_k, max_q, max_k, slice), (non-causal: cu_k, max_k, slice)
        0: (([0, 3, 4], [0, 3, 4], 3, 3, (0, 4)), ([0, 3, 10], 7, (0, 10))),
        1: (([0, 4], [0, 5], 4, 5, (3, 8)), ([0, 7], 7, (3, 10))),
        2: (([0, 2, 4], [0, 7, 9], 2, 7, (3, 12)), ([0, 7, 10], 7, (3, 13))),
        3: (([0, 1, 4], [0, 3, 6], 3, 3, (10, 16)), ([0, 3, 6], 3, (10, 16))),
    }
    for rank, ((cq, ck, mq, mk, sl), (ck_n, mk_n, sl_n)) in want.items():
        for causal, (k_want, max_k, span) in ((True, (ck, mk, sl)), (False, (ck_n, mk_n, sl_n))):
            cu_q, cu_k, max_q, got_max_k, k_slice = flash_api.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, 4)
            assert cu_q.dtype == cu_k.dtype == torch.int32
            assert (cu_q.tolist(), cu_k.tolist(), max_q, got_max_k, k_slice) == (cq, k_want, mq, max_k, slice(*span))
    # a document boundary exactly on a rank edge, and an empty document (kept, as ring-flash-attn keeps it)
    assert flash_api.llama3_flash_attn_prepare_cu_seqlens([0, 4, 16], True, 1, 4)[:2][0].tolist() == [0, 4]
    cu_q, cu_k, *_ = flash_api.llama3_flash_attn_prepare_cu_seqlens([0, 4, 4, 8], True, 1, 2)
    assert (cu_q.tolist(), cu_k.tolist()) == ([0, 0, 4], [0, 0, 4])
    with pytest.raises(ValueError, match="must be a multiple of world_size=4 for a contiguous split, got 15 "
                                         "\\(pad to 16\\)"):
        flash_api.llama3_flash_attn_prepare_cu_seqlens([0, 15], True, 0, 4)


# ---- errors ----

def _error_worker(_: int) -> list[str]:
    q = torch.randn(8, 4, 8)
    msgs = []
    calls = [
        lambda: flash_api.ring_flash_attn_varlen_func(q, q, q, [0, 3, 8], 5, layout="contiguous"),  # local cu
        lambda: flash_api.ring_flash_attn_varlen_func(q, q, q, [0, 24], 24, dropout_p=0.1, layout="contiguous"),
        lambda: flash_api.llama3_flash_attn_varlen_func(q, q, q, [0, 24], [0, 12, 24], 24, 24, 1, None),
        lambda: flash_api.llama3_flash_attn_varlen_func(q, q, q, [0, 24], [0, 24], 24, 24, 1, slice(0, 9),
                                                        causal=True),
        lambda: flash_api.zigzag_ring_flash_attn_varlen_func(q, q, q, [0, 24], 0),
        lambda: flash_api.stripe_flash_attn_varlen_func(q[None], q[None], q[None], [0, 24], 24),
        lambda: flash_api.ring_flash_attn_varlen_func(q, q, q, [0, 24], 24, alibi_slopes=torch.ones(4),
                                                      layout="contiguous"),
        lambda: flash_api.zigzag_ring_flash_attn_func(q[None, :7], q[None, :7], q[None, :7], causal=True),
        lambda: flash_api.ring_flash_attn_varlen_func(q, q, q, [0, 24], 24),                # GLOBAL cu, doc layout
        lambda: flash_api.llama3_flash_attn_varlen_func(q, q, q, [0, 8], [0, 9], 8, 9, 1, slice(15, 24),
                                                        causal=True),                      # not from prepare
        lambda: flash_api.zigzag_ring_flash_attn_varlen_func(q, q, q, [0, 3, 8], 5),         # odd local length
    ]
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except (ValueError, TypeError, NotImplementedError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    return msgs


def test_errors_name_the_rule(pools):
    msgs = pools(3).run(_error_worker, 0)[2]
    assert msgs[0].startswith("ValueError: cu_seqlens must be the GLOBAL document boundaries ending at the global "
                              "length 24 (3 ranks x 8 local tokens"), msgs[0]
    assert "ring-flash-attn's per-rank cu_seqlens" in msgs[0]
    assert msgs[1].startswith("NotImplementedError: dropout_p is not supported yet"), msgs[1]
    assert msgs[2].startswith("NotImplementedError: cu_seqlens_k must equal cu_seqlens_q"), msgs[2]
    assert msgs[3].startswith("ValueError: local_k_slice must be slice(0, 24) for this rank's documents"), msgs[3]
    assert msgs[4].startswith("ValueError: max_seqlen must be a positive int or None, got 0"), msgs[4]
    assert msgs[5].startswith("ValueError: q must be (total_local, heads, head_dim) in the varlen functions"), msgs[5]
    assert msgs[6].startswith("NotImplementedError: alibi_slopes is not supported yet"), msgs[6]
    assert msgs[7].startswith("ValueError: local sequence length must be"), msgs[7]
    assert msgs[8].startswith("ValueError: cu_seqlens must be this rank's LOCAL document boundaries ending at "
                              "total_local=8"), msgs[8]
    assert msgs[9].startswith("ValueError: cu_seqlens_q, cu_seqlens_k and local_k_slice must be what "
                              "llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal=True, rank=2, world_size=3) "
                              "returned in this process"), msgs[9]
    assert msgs[10].startswith("ValueError: every document must have an even number of local tokens with "
                               "layout='doc_zigzag'"), msgs[10]
    assert all("(rank 2 of 3)" in m for m in msgs), msgs
