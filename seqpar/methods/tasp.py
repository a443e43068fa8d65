"""TASP (ALGORITHMS.md §8): every rank's KV in W-1 sub-chunks moving on W-1 links at once, every round.

A ring uses one of a rank's W-1 links per step; on a full point-to-point mesh (MI300X xGMI, PCIe
switches, one NIC per GPU) TASP keeps all of them busy: each round is an all-to-all in which every
ordered pair carries one sub-chunk (‖KV‖ / (W-1)), so the bytes equal the ring's and the step time can
drop by up to W-1 (Note [TASP rounds] in ``_tasp``).

Options:
    schedule: "cycles" - TASP's arc-disjoint Hamiltonian cycles, store and forward (every W except 4 and
        6, ``seqpar.comm.topology``); "direct" - the staggered direct all-to-all (§8.4, any W: no
        forwarding, so rounds never wait on each other, and pieces the receiver does not need are not
        sent); "auto" (default) - "direct". Within one host every pair of GPUs has its own link (or a
        switch), where the direct form moves the same bytes without forwarding (§8.4, §8.6); the
        cycles pay off across nodes (§8.3, each chunk crosses the node boundary once), which this
        single-group method does not model, so "auto" never picks them.

Layouts: zigzag (causal and not) and contiguous (non-causal only: causal work would be unbalanced);
every piece of a rank is cut into W-1 sub-chunks within a row of each other (Note [Uneven sub-chunks] in
``seqpar.layouts.subchunks``), so the length is the layout's (a multiple of 2W for zigzag, W for contiguous) and at
least W-1 rows per piece. GQA/MQA: KV travels with its own Hkv heads.
"""

from __future__ import annotations

from ..comm import topology
from ..config import AttentionConfig
from ..cost import model
from ..errors import rank_suffix
from ..groups import GroupSizes
from ..kernels.executor import TaskRunner
from ..layouts import Layout, make_layout
from ..layouts.subchunks import Subchunked
from . import _tasp
from .base import LONG_CONTEXT, BackwardInputs, Call, Method

__all__ = ["METHOD", "SCHEDULES", "resolve_schedule"]

SCHEDULES = ("auto", "cycles", "direct")


def _placement(layout: str, groups, documents=None, rule=None) -> tuple[Layout, int]:
    """``layout`` over the group with every per-rank piece cut into W-1 sub-chunks (same token placement)."""
    W = groups.world
    return Subchunked(W, base=make_layout(layout, W), parts=max(W - 1, 1)), groups.index


def resolve_schedule(cfg: AttentionConfig, world: int) -> str:
    """The schedule this call runs ("cycles" or "direct"); raises for input TASP cannot serve."""
    name = cfg.option("schedule", "auto")
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)} for method='tasp', got {name!r}{rank_suffix()}")
    if name == "cycles" and not topology.has_cycles(world):
        raise ValueError(f"schedule='cycles' needs a group size with a Hamiltonian decomposition (every size "
                         f"except 4 and 6), got {world} ranks; use schedule='direct'{rank_suffix()}")
    return "direct" if name == "auto" else name


class _Engine:
    saves = False

    def __init__(self, call: Call):
        cfg = call.cfg
        kind = resolve_schedule(cfg, call.groups.world)
        row = _tasp.held_row_bytes(call.k_shape[0], call.k_shape[2], call.k_shape[3], call.v_shape[3], call.dtype)
        tp = _tasp.schedule(call.layout, call.index, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len, kind,
                            _tasp.gathers(call.seq_len, call.groups.world, row))
        runner = TaskRunner.of(call)
        self.tasp = _tasp.Tasp(call.groups, tp, runner, cfg.grad_dtype)

    def forward(self, q, k, v):
        return self.tasp.forward(q, k, v)

    def backward(self, b: BackwardInputs):
        return self.tasp.backward(b.rows, b.q, b.k, b.v, b.lse)


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """KV in W-1 sub-chunks over all W-1 links per round (ALGORITHMS.md §8.2-8.5); a round visits the pairs
    of a ring step, so the busiest rank's calls are the ring's (``model.steps``)."""
    W, L = p.world, p.seq_len / p.world
    schedule = c.option("schedule", "direct")
    pattern = "cycles" if schedule == "cycles" else "allpairs"
    steps = model.steps(p, c.layout, W)
    n = len(steps)
    kv, dkv = p.act(L, 2 * p.kv_heads), p.act(L, 2 * p.kv_heads, p.grad_bytes)
    grp = model.Group(W)
    t_kv, t_kvd, t_dkv = (m.comm_ms(pattern, x, grp) for x in (kv, kv + dkv, dkv))
    extra_launch = m.profile.launch_us * 1e-3 if p.causal else 0.0       # M and P sub-chunks: two calls
    f, b = model.tallies(m, "tasp")
    for s, blk in enumerate(steps):
        more = s + 1 < n
        comp = m.kernel_ms(p, blk, p.heads) + (m.merge_ms(p, blk.rows, p.heads) + extra_launch if s and blk else 0.0)
        f.step(comp, t_kv if more else 0.0, pattern, kv if more else 0.0)
    for s, blk in enumerate(steps):
        more = s + 1 < n
        back = s >= 2                                                     # partials of round s-1 go home
        comm = t_kvd if (more and back) else (t_kv if more else (t_dkv if back else 0.0))
        sent = (kv if more else 0.0) + (dkv if back else 0.0)
        b.step(m.kernel_ms(p, blk, p.heads, "bwd") + (extra_launch if s else 0.0), comm, pattern, sent)
    if n > 1:
        b.wait(t_dkv, dkv)
    fb, bb = model.base_mem(p)
    acc = p.act(L, p.heads, 4) + p.rowstat(L, p.heads)
    dkv32 = p.act(L, 2 * p.kv_heads, 4)
    cost = model.Cost(f, b, fb + 3 * kv + acc + p.act(L, p.heads),           # own KV + two receive buffers
                      bb + 3 * kv + 3 * dkv32 + p.act(L, p.heads, 4) + model.temps(p, L, p.heads, p.kv_heads))
    cost.notes.append(f"{schedule}: every round uses all {W - 1} links of each rank")
    if p.shaped:
        cost.balance = model.balance(p, c.layout, W, steps)
    return cost.prediction()


def _candidates(p: model.Problem, topo, layouts: tuple[str, ...], ulysses: int | None) -> list:
    """The direct schedule inside a node (§8.4: the same bytes without forwarding); the cycles too across
    nodes (§8.3: each chunk crosses the node boundary once)."""
    schedules = ("direct", "cycles") if p.world > topo.node_size else ("direct",)
    return [model.Candidate("tasp", lay, options=(("schedule", s),)) for lay in layouts for s in schedules]


def _why_not(p: model.Problem, c: model.Candidate) -> list[str]:
    if c.option("schedule") == "cycles" and not topology.has_cycles(p.world):
        return [f"no Hamiltonian cycle decomposition exists for W={p.world} (use schedule='direct')"]
    return []


def _bench_specs(preset, world: int) -> list:
    if preset.seq_len >= LONG_CONTEXT or world <= 2:
        return []
    return [("zigzag" if preset.causal else "contiguous", (), None)]


#: rows and keys of the kernel tile ``_slowest_rank`` counts (cuDNN's forward on an H100)
TILE = 128


def _slowest_rank(layout: str, world: int, seq_len: int, rule) -> int:
    """The rank with the most kernel calls, then the most ``TILE`` x ``TILE`` tiles, in the plan both passes run (the
    rounds', or at short chunks the gathered one: Notes [TASP forward at short chunks], [TASP backward at short
    chunks]; gathering is decided by rows here, without the shapes' byte limit).

    Zigzag gives every rank the same pairs, but not the same calls: rank 0 sees all of every higher rank's
    sub-chunk in one call a round, and so does the last rank with the lower ranks' front pieces, while a rank
    between runs two a round on keys that are sums of sub-chunks (tiles half empty). Emulated on an H100 at 2K
    tokens per rank over 8 (GQA), rank 3's forward+backward took 3.84 ms of GPU time where rank 0's took 2.84
    (``benchmarks/results/2026-11-26-h100-tasp-aligned``), and rank 1's 4.11 ms steady where rank 3's took 3.88
    (``2026-11-26-h100-tasp-gathered``); gathered, the ranks between the ends run a call more than the ends (two
    classes of pieces), rank 1 the most tiles of them (at 2K tokens per rank over 8 and 4K over 4)."""
    placed, _ = _placement(layout, GroupSizes(world))
    counts = []
    for r in range(world):
        tp = _tasp.schedule(placed, r, seq_len, rule, None, None, "direct", _tasp.gathers(seq_len, world))
        rounds = [t for ts in tp.gathered.tasks for t in ts] if tp.gathered is not None else \
            [t for rd in tp.rounds for t in rd.tasks]
        tasks = [*tp.early, *tp.late, *rounds]
        counts.append((len(tasks), sum(-(-t.rows // TILE) * -(-t.cols // TILE) for t in tasks), -r))
    return -max(counts)[2]


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    """Zigzag with every half cut into W-1 sub-chunks: the length a multiple of 2W, at least 2W(W-1)."""
    if world <= 1:
        return []
    d = 2 * world
    return [dict(layout="zigzag", seq_len=max(-(-seq_len // d) * d, d * (world - 1)))]


METHOD = Method(
    name="tasp",
    summary="KV split over W-1 links per round (Hamiltonian cycles or staggered direct all-to-all)",
    layouts=("zigzag", "contiguous"),
    causal_layouts=("zigzag",),        # sub-chunked zigzag keeps every round balanced (ALGORITHMS.md §8.2)
    options={"schedule": "auto"},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "mask"}),
    placement=_placement,
    check=lambda call: resolve_schedule(call.cfg, call.groups.world) and None,
    engine=_Engine,
    cost=_cost,
    candidates=_candidates,
    why_not=_why_not,
    bench_specs=_bench_specs,
    slowest_rank=_slowest_rank,
    demo_cases=_demo_cases,
)
