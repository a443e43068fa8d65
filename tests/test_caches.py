"""Bounded caches: packed batches leave nothing behind once they are gone (Note [Bounded plan cache]).

Every packed batch is a new call signature (new ``cu_seqlens``). 1400 of them go through every method that takes
documents at W = 4: the caches stay within their bounds, the per-batch objects that hold device tensors or long
host structures (plans, ring schedules, the all-gather's index tensors) number a few batches' worth, and the
resident memory after 1400 batches is what it was after 400. Most batches are planned only (``planned``, no
round: what a call does on a miss); every ``EXECUTE``-th one runs forward and backward through
``seqpar.attention`` with its default agreement round, so the runners' memos and the rounds take part too.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import torch
import torch.distributed as dist

import seqpar
from seqpar.masks import Band, Varlen

W = 4
S = 24 * W                 # global tokens: TASP's zigzag needs at least 2W(W-1)
BATCHES = 1400
EARLY = 400
EXECUTE = 200              # every this many batches, a real forward and backward per method
METHODS = {"ring": "balanced", "allgather": "balanced", "ulysses": "contiguous", "usp": "balanced",
           "tokenring": "balanced", "tasp": "zigzag", "double_ring": "balanced"}
OPTIONS = {"double_ring": {"node_size": 2}}

_MESHES: dict[str, Any] = {}


def _mesh(method: str):
    if method != "usp":
        return None
    if "usp" not in _MESHES:               # mesh creation is collective: every rank builds it once
        _MESHES["usp"] = seqpar.make_mesh(ulysses=2, device_type="cpu")
    return _MESHES["usp"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _live(*types: type) -> int:
    return sum(isinstance(o, types) for o in gc.get_objects())


def _batch(method: str, cu: tuple[int, ...], execute: bool) -> None:
    from seqpar.runtime.call import planned

    H, D, L = 4, 8, S // W
    q, k, v = (torch.randn(1, L, H, D, requires_grad=True) for _ in range(3))
    kw = dict(method=method, layout=METHODS[method], cu_seqlens=cu, mesh=_mesh(method))
    if execute:
        seqpar.attention(q, k, v, **kw, **OPTIONS.get(method, {})).sum().backward()
        return
    planned(q, k, v, None, **kw, causal=True, softmax_scale=None, kernel="auto", return_lse=False,
            window_size=(-1, -1), seq_len=None, deterministic=False, grad_dtype=torch.float32, dropout_p=0.0,
            alibi_slopes=None, softcap=0.0, check_ranks=False, verify=False, options=OPTIONS.get(method, {}))


def packed_batches(batches: int, measure_at: tuple[int, ...]) -> dict[str, Any]:
    """``batches`` new packed batches (2-6 documents each) through every method; at each of ``measure_at``:
    RSS (MB), live plans, ring schedules and all-gather index holders, and the plan cache's own account."""
    from seqpar.methods import _passkv, allgather
    from seqpar.runtime import call

    # the workers are shared with other test modules: start from empty caches, so what is counted is this test's
    call.cache_clear()
    _passkv.schedule.cache_clear()
    gc.collect()
    rng = random.Random(dist.get_rank() * 0 + 7)     # the same batches on every rank
    holders = tuple(getattr(allgather, n) for n in ("_SelectionIndex", "_ChunkIndex") if hasattr(allgather, n))
    out: dict[str, Any] = {}
    for i in range(1, batches + 1):
        cu = (0, *sorted(rng.sample(range(1, S), rng.randint(1, 5))), S)
        for method in METHODS:
            _batch(method, cu, execute=i % EXECUTE == 0)
        if i in measure_at:
            gc.collect()
            out[i] = {"rss": _rss_mb(), "plans": _live(call.Plan), "schedules": _live(_passkv.Schedule),
                      "index": _live(*holders), "info": call.cache_info() if hasattr(call, "cache_info") else None}
    return out


def test_packed_batches_leave_the_caches_bounded_and_memory_flat(pools):
    from seqpar.methods._passkv import BATCH_SCHEDULES
    from seqpar.runtime.call import BATCH_CACHE_SIZE, CACHE_BYTES

    results = pools(W).run(packed_batches, BATCHES, (EARLY, BATCHES), timeout=600)
    for rank, res in enumerate(results):
        early, late = res[EARLY], res[BATCHES]
        for when in (early, late):
            info = when["info"]
            assert info is not None and info["batch_plans"] <= BATCH_CACHE_SIZE and info["plans"] <= len(METHODS), \
                f"rank {rank}: {info}"
            assert 0 < info["bytes"] <= CACHE_BYTES, f"rank {rank}: {info}"
            # the cached plans and nothing else; their schedules and index tensors, and a few batches' more
            held = info["batch_plans"] + info["plans"]
            assert when["plans"] <= held, f"rank {rank}: {when}"
            assert when["schedules"] <= held + BATCH_SCHEDULES, f"rank {rank}: {when}"
            assert when["index"] <= 2 * held, f"rank {rank}: {when}"
        assert late["rss"] - early["rss"] < 8.0, f"rank {rank}: RSS {early['rss']:.1f} -> {late['rss']:.1f} MB"


def test_block_masks_of_past_batches_go():
    """FlexAttention block masks hold device tensors: document masks (one packed batch's each) keep a handful,
    band masks (shape-keyed, reused by every batch) more, all under a byte budget."""
    from torch.nn.attention.flex_attention import BlockMask

    from seqpar.kernels import flex

    cpu = torch.device("cpu")
    rng = random.Random(3)
    for _ in range(40):
        cu = (0, *sorted(rng.sample(range(1, 256), 20)), 256)
        flex._block_mask(Varlen(cu, cu, (-1, 0)), 256, 256, cpu)
    for lo in range(-40, 0):
        flex._block_mask(Band(lo, 0), 256, 256, cpu)
    gc.collect()
    kept = _live(BlockMask)
    assert kept <= flex.VARLEN_MASKS + flex.BAND_MASKS, kept
    assert len(flex._DOCS) == flex.VARLEN_MASKS and len(flex._BANDS) == 40
    held = sum(n for _, n in (*flex._DOCS.values(), *flex._BANDS.values()))
    assert held == flex._HELD[0] > 0
    budget = flex.MASK_BYTES
    try:
        flex.MASK_BYTES = held // 2                  # over the budget: least recent first, documents first
        flex._block_mask(Band(-41, 0), 256, 256, cpu)
        assert flex._HELD[0] <= held // 2 and len(flex._DOCS) < flex.VARLEN_MASKS and len(flex._BANDS) == 41
    finally:
        flex.MASK_BYTES = budget


def test_batch_memo_keeps_per_batch_plans_apart():
    """Note [Per-batch memos]: calls with documents or a valid length go to a small tier, so a stream of new
    batches never evicts the fixed-shape plans and never holds more than BATCH_ENTRIES batches' plans."""
    from seqpar.memo import BATCH_ENTRIES, batch_memo

    built: list = []

    @batch_memo(4)
    def plan_of(seq_len, doc_bounds=None, valid_len=None):
        built.append((seq_len, doc_bounds, valid_len))
        return object()

    fixed = plan_of(64)
    for i in range(100):                                   # 100 packed batches, then a padded one
        plan_of(64, (0, i + 1, 64))
    plan_of(64, valid_len=60)
    assert plan_of(64) is fixed and len(built) == 102       # the fixed plan survived every batch
    fixed_tier, batch_tier = plan_of.tiers
    assert fixed_tier.cache_info().currsize == 1 and batch_tier.cache_info().currsize == BATCH_ENTRIES
    plan_of.cache_clear()
    assert batch_tier.cache_info().currsize == 0 and plan_of(64) is not fixed
