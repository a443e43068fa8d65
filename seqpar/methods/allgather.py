"""All-gather KV context parallelism ("llama3", ALGORITHMS.md §4): contiguous and zigzag layouts.

Every rank all-gathers K and V (``heads_k_stride`` KV heads at a time, to bound memory), computes its own
queries against the keys they may see in one pass (no merges across ranks: one pass sees every key), and in
backward re-gathers K and V, accumulates dK/dV for the whole gathered buffer in fp32 and reduce-scatters it
back to the owners (``cfg.grad_dtype`` on the wire, fp32 by default).

Note [Gather into global order]
    The collective delivers rank-major rows: contiguous ranks arrive in global order, zigzag ranks as
    ``[c0 c_{2W-1} | c1 c_{2W-2} | ...]``. We permute the gathered chunks into global order (one
    ``index_select`` of the gathered buffer on the device, chunk granularity, map precomputed) and plan
    against ONE key run per document. Then every query run sees one contiguous key span, so causal zigzag is
    exactly two bottom-right calls per rank (front chunk against keys ``[0, (r+1)L/2)``, back chunk against
    ``[0, (2W-r)L/2)``), varlen is one call per local document piece (packed into one varlen call), and
    no two calls share a query row. Planning against the rank-order buffer instead
    (``Segments.concat`` of every rank's segments) needs no copy but splits each zigzag query chunk into
    up to W calls (front chunks are interleaved with back chunks) plus fp32 merges: about 2W+1 small
    calls per rank against 2. The copy moves the gathered KV once through memory (O(S Hkv D) bytes) while
    the attention it feeds is O(S^2 H D / W) work, so the copy is the cheaper side on every GPU shape.
    Backward permutes the fp32 dK/dV buffer back to rank order the same way before the reduce-scatter.
    Contiguous needs neither copy.

Note [All-gather pipeline]
    KV heads are processed in chunks of ``heads_k_stride`` (None = all heads in one round; GQA: query heads
    ``[c0 G, (c0 + stride) G)`` go with KV heads ``[c0, c0 + stride)``). Chunk c+1's gather is posted
    before chunk c is computed (double-buffered receive buffers), so the transfer hides behind compute;
    with one chunk the gather is exposed. In backward the reduce-scatter of chunk c is posted right after
    its compute and waited only before its buffer is reused, so it overlaps chunk c+1. Backward re-gathers
    K and V rather than keeping the forward's buffer: keeping it would hold W times the local KV of every
    layer from forward to backward (e.g. 512 MiB per layer at 128K tokens, 8 KV heads, d 128, bf16), which
    is the memory this method exists to bound.

One rank: the gather is the identity, so the call runs pass-KV's single step (``_passkv.OneRank``) with no
buffers or copies; at W = 1 on a packed 128K row the pipelined engine cost 1.15x the single-GPU varlen kernel
(fwd+bwd, H100, ``benchmarks/results/2026-11-23-h100/run3``), its copies and fp32 dK/dV buffer included.

Windows: a full gather over-fetches (rank r needs keys only from ranks ``r - ceil(w / L) .. r``); the
planner skips every block outside the window, but fetching only the needed ranks (per-peer P2P or an
uneven all-to-all) is a follow-up. Documents, windows and end padding all come from the block planner.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch

from ..comm.all_gather import AllGather, Handle
from ..errors import rank_suffix
from ..kernels.executor import TaskRunner
from ..kernels.merge import merge_
from ..layouts import Layout
from ..layouts.blocks import Rule, Run, Segments, Task, plan
from ..numerics import GradRows, acc_dtype, wire_dtype
from ..planner import model
from ..runtime.loop import Loop, run_steps
from . import _passkv
from .base import LONG_CONTEXT, BackwardInputs, Call, Method

__all__ = ["METHOD", "GatherPlan", "gather_plan"]


@dataclass(frozen=True)
class GatherPlan:
    """This rank's kernel calls against the gathered KV in global order, and the chunk map to get there.

    Attributes:
        tasks: calls of this rank's query rows against key rows of the global-order buffer.
        chunk: rows per chunk of the rank-order -> global-order map.
        order: ``order[c]`` is the rank-order chunk holding global chunk c; None when they coincide.
    """

    tasks: tuple[Task, ...]
    chunk: int
    order: tuple[int, ...] | None


def _chunk_order(layout: Layout, seq_len: int) -> tuple[int, tuple[int, ...] | None]:
    runs = [(j, r) for j in range(layout.world) for r in layout.segments(j, seq_len).runs]
    chunk = math.gcd(*(r.length for _, r in runs), *(r.glob for _, r in runs))
    local = seq_len // layout.world
    order = [0] * (seq_len // chunk)
    for j, r in runs:
        for t in range(r.length // chunk):
            order[(r.glob + t * chunk) // chunk] = (j * local + r.local + t * chunk) // chunk
    return chunk, None if order == sorted(order) else tuple(order)


@functools.lru_cache(maxsize=256)
def gather_plan(layout: Layout, rank: int, seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None,
                valid_len: int | None) -> GatherPlan:
    """Rank ``rank``'s queries against the whole sequence in global order (Note [Gather into global order])."""
    if layout.segments(rank, seq_len).stride != 1:
        raise ValueError(f"method='allgather' needs a layout of consecutive runs, got {layout.name}")
    q = layout.segments(rank, seq_len).cut(doc_bounds, valid_len)
    k = Segments((Run(0, 0, seq_len),)).cut(doc_bounds, valid_len)
    chunk, order = _chunk_order(layout, seq_len)
    return GatherPlan(plan(q, k, rule), chunk, order)


@functools.lru_cache(maxsize=64)
def _index(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(order, dtype=torch.long, device=device)


def _permute_chunks(src: torch.Tensor, dst: torch.Tensor, order: tuple[int, ...]) -> None:
    """``dst`` chunk c = ``src`` chunk ``order[c]`` (dim 0 cut into ``len(order)`` chunks), one device op."""
    n = len(order)
    torch.index_select(src.view(n, -1), 0, _index(order, src.device), out=dst.view(n, -1))


class _Gathered:
    """Double-buffered all-gather of one KV head chunk at a time, read back in global order.

    Buffers are sequence-major, ``(rows, B, stride, D + Dv)`` with K and V side by side on the last dim (Note
    [One KV message] in ``_shared``), so the rank-major gather concatenates along the sequence and the
    gathered K is the view ``(B, S, stride, D)``.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, stride: int, ag: AllGather, gp: GatherPlan):
        B, L, _, D = k.shape
        self.k, self.v, self.stride, self.ag, self.gp, self.d = k, v, stride, ag, gp, D
        self.rounds = k.shape[2] // stride
        self.send = k.new_empty(L, B, stride, D + v.shape[-1])
        self.recv = [k.new_empty(ag.world * L, B, stride, D + v.shape[-1]) for _ in range(min(2, self.rounds))]
        self.glob = None if gp.order is None else torch.empty_like(self.recv[0])

    def post(self, c: int) -> Handle:
        """Pack KV heads of chunk c and post their gather (Note [All-gather pipeline])."""
        hs = slice(c * self.stride, (c + 1) * self.stride)
        self.send[..., : self.d].copy_(self.k[:, :, hs].transpose(0, 1))
        self.send[..., self.d:].copy_(self.v[:, :, hs].transpose(0, 1))
        return self.ag.gather(self.send, self.recv[c % len(self.recv)])

    def kv(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk c's gathered ``k (B, S, stride, D), v (B, S, stride, Dv)`` in global order (after its wait)."""
        buf = self.recv[c % len(self.recv)]
        if self.glob is not None:
            _permute_chunks(buf, self.glob, self.gp.order)
            buf = self.glob
        return buf[..., : self.d].transpose(0, 1), buf[..., self.d:].transpose(0, 1)


class _DKV:
    """fp32 dK/dV of the gathered buffer per head chunk, and their pipelined reduce-scatter to the owners.

    ``start(c)`` gives chunk c's zeroed global-order accumulator ``(S, B, stride, D + Dv)``; ``post(c)`` brings
    it to rank order in the wire dtype (a copy only when the order or the dtype differs) and posts the
    reduce-scatter into ``out[c]``; ``finish`` waits and returns ``dk (B, L, Hkv, D), dv (B, L, Hkv, Dv)``.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, stride: int, world: int, rounds: int,
                 order: tuple[int, ...] | None, grad_dtype: torch.dtype, loop: Loop):
        B, L, _, D = k.shape
        F = D + v.shape[-1]
        self.acc_dtype = acc_dtype(k.dtype)
        self.wire = wire_dtype(grad_dtype, k.dtype)
        self.order, self.shape, self.d, self.loop = order, (B, L, k.shape[2], D, v.shape[-1]), D, loop
        self.direct = order is None and self.wire == self.acc_dtype      # reduce-scatter the accumulator
        nbuf = min(2, rounds)
        self.acc = [k.new_empty(world * L, B, stride, F, dtype=self.acc_dtype)
                    for _ in range(nbuf if self.direct else 1)]
        self.send = [] if self.direct else [torch.empty_like(self.acc[0], dtype=self.wire) for _ in range(nbuf)]
        self.stage = (torch.empty_like(self.acc[0], dtype=self.wire)
                      if order is not None and self.wire != self.acc_dtype else None)
        self.out = k.new_empty(rounds, L, B, stride, F, dtype=self.wire)
        self.pending: list[Handle | None] = [None] * nbuf

    def _wait(self, slot: int) -> None:
        h = self.pending[slot]
        if h is not None:
            self.loop.wait([h])
            self.pending[slot] = None

    def start(self, c: int) -> torch.Tensor:
        slot = c % len(self.pending)
        if self.direct:
            self._wait(slot)                   # its reduce-scatter still reads this accumulator
        return self.acc[c % len(self.acc)].zero_()

    def post(self, c: int, ag: AllGather) -> Handle:
        slot = c % len(self.pending)
        buf = self.acc[c % len(self.acc)]
        if not self.direct:
            self._wait(slot)
            send = self.send[slot]
            if self.order is None:
                send.copy_(buf)
            elif self.stage is None:
                _permute_chunks(buf, send, _inverse(self.order))
            else:
                self.stage.copy_(buf)
                _permute_chunks(self.stage, send, _inverse(self.order))
            buf = send
        self.pending[slot] = ag.reduce_scatter(buf, self.out[c])
        return self.pending[slot]

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        for slot in range(len(self.pending)):
            self._wait(slot)
        B, L, Hkv, D, Dv = self.shape
        g = self.out.permute(2, 1, 0, 3, 4)                # (n, L, B, s, F) -> (B, L, n, s, F)
        g = g.reshape(B, L, Hkv, D + Dv)
        return g[..., :D].to(dtype), g[..., D:].to(dtype)


@functools.lru_cache(maxsize=64)
def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for c, i in enumerate(order):
        inv[i] = c
    return tuple(inv)


@functools.lru_cache(maxsize=256)
def _disjoint(tasks: tuple[Task, ...]) -> bool:
    """No query row is in two calls (always so for a global-order plan unless varlen packing interleaves)."""
    spans = sorted((t.q_start, t.q_stop) for t in tasks)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def _stride(options, kv_heads: int) -> int:
    s = dict(options).get("heads_k_stride")
    if s is None:
        return kv_heads
    if isinstance(s, bool) or not isinstance(s, int) or s < 1 or kv_heads % s:
        raise ValueError(f"heads_k_stride must be None or a positive divisor of the KV heads ({kv_heads}), "
                         f"got {s!r}{rank_suffix()}")
    return s


def _check(call: Call) -> None:
    _stride(call.cfg.options, call.k_shape[2])


class _Engine:
    """All-gather KV per head chunk (Note [All-gather pipeline]) on the runtime's ``run_steps``."""

    saves = False

    def __init__(self, call: Call):
        cfg = call.cfg
        self.gp = gather_plan(call.layout, call.index, call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        self.runner = TaskRunner(cfg.kernel, call.scale, deterministic=cfg.deterministic, softcap=cfg.softcap)
        self.stride = _stride(cfg.options, call.k_shape[2])
        self.G = call.q_shape[2] // call.k_shape[2]
        self.groups, self.grad_dtype = call.groups, cfg.grad_dtype

    def _heads(self, c: int) -> slice:
        return slice(c * self.stride * self.G, (c + 1) * self.stride * self.G)

    def forward(self, q, k, v):
        """``(out (B, L, H, Dv) in q.dtype, lse (B, H, L) fp32)``."""
        runner, G, stride = self.runner, self.G, self.stride
        B, L, H, _ = q.shape
        acc = acc_dtype(q.dtype)
        tasks = runner.prepare(self.gp.tasks, q[:, :, : stride * G], k[:, :, :stride])   # the same for every chunk
        direct = _disjoint(tasks)       # every row in at most one call: write results, no fp32 merge buffer
        out = torch.zeros(B, L, H, v.shape[-1], dtype=q.dtype if direct else acc, device=q.device)
        lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
        gathered = _Gathered(k, v, stride, AllGather(self.groups.group), self.gp)
        with Loop() as loop:
            handles = [loop.post(gathered.post(0))]

            def compute(c: int) -> None:
                kc, vc = gathered.kv(c)
                qh = self._heads(c)
                qc = q[:, :, qh]
                for t in tasks:
                    o, l = runner.forward(qc, kc, vc, t)
                    if direct:
                        out[:, t.q, qh] = o
                        lse[:, qh, t.q] = l
                    else:
                        merge_(out[:, t.q, qh], lse[:, qh, t.q], o, l)

            def post(c: int):
                loop.wait(handles[c])             # chunk c arrived (and its send buffer is free again)
                if c + 1 < gathered.rounds:       # chunk c+1's gather in flight while chunk c computes
                    handles.append(loop.post(gathered.post(c + 1)))
                return None

            run_steps(gathered.rounds, post=post, compute=compute, loop=loop)
        return out.to(q.dtype), lse

    def backward(self, b: BackwardInputs):
        """Re-gather per head chunk, local block backward, fp32 dK/dV reduce-scattered to the owners."""
        q, k, v, rows = b.q, b.k, b.v, b.rows
        runner, G, stride = self.runner, self.G, self.stride
        ag = AllGather(self.groups.group)
        gathered = _Gathered(k, v, stride, ag, self.gp)
        dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        tasks = runner.prepare(self.gp.tasks, q[:, :, : stride * G], k[:, :, :stride])
        with Loop() as loop:
            grads = _DKV(k, v, stride, ag.world, gathered.rounds, self.gp.order, self.grad_dtype, loop)
            handles = [loop.post(gathered.post(0))]
            d = k.shape[-1]

            def compute(c: int) -> None:
                kc, vc = gathered.kv(c)
                qh = self._heads(c)
                hrows = GradRows(rows.do[:, :, qh], rows.out[:, :, qh], None if rows.dlse is None
                                 else rows.dlse[:, qh])
                dkv = grads.start(c)
                for t in tasks:
                    gq, gk, gv = runner.backward(hrows, q[:, :, qh], kc, vc, b.lse[:, qh], t)
                    dq[:, t.q, qh] += gq
                    dkv[t.k, ..., :d] += gk.transpose(0, 1)
                    dkv[t.k, ..., d:] += gv.transpose(0, 1)

            def post(c: int):
                loop.wait(handles[c])
                if c + 1 < gathered.rounds:
                    handles.append(loop.post(gathered.post(c + 1)))
                return None

            def post_after(c: int) -> None:   # chunk c's reduce-scatter runs behind chunk c+1 (waited by _DKV)
                loop.post(grads.post(c, ag))

            run_steps(gathered.rounds, post=post, compute=compute, post_after=post_after, loop=loop)
            dk, dv = grads.finish(k.dtype)
        return dq.to(q.dtype), dk, dv


def _engine(call: Call):
    """The pipelined all-gather; on one rank, pass-KV's single step (the gather is the identity there)."""
    return _passkv.OneRank(call) if call.groups.world == 1 else _Engine(call)


def _cost(p: model.Problem, c: model.Candidate, m: model.Machine) -> model.Prediction:
    """All-gather K, V per head chunk; reduce-scatter dK, dV (ALGORITHMS.md §4, Note [All-gather pipeline])."""
    W, S, L = p.world, p.seq_len, p.seq_len / p.world
    stride = c.option("heads_k_stride") or p.kv_heads
    nc = p.kv_heads // stride
    heads = stride * p.group_ratio
    blocks = model.gather_blocks_of(p, c.layout)
    # Note [Gather into global order]: every layout but contiguous permutes the gathered chunks
    perm = m.permute_ms(p.batch * S * 2 * stride * p.head_dim) if c.layout != "contiguous" and W > 1 else 0.0
    cf = sum(m.kernel_ms(p, blk, heads) for blk in blocks) + perm
    cb = sum(m.kernel_ms(p, blk, heads, "bwd") for blk in blocks) + 2 * perm \
        + m.hbm_ms(sum(p.act(blk.cols, 2 * stride, 8) for blk in blocks))           # KV into order, dK/dV back
    g_bytes = (W - 1) * p.act(L, 2 * stride)
    r_bytes = (W - 1) * p.act(L, 2 * stride, p.grad_bytes)
    grp = model.Group(W)
    t_ag, t_rs = m.comm_ms("allgather", g_bytes, grp), m.comm_ms("reduce_scatter", r_bytes, grp)
    f, b = model.tallies(m, "allgather")
    f.wait(t_ag, g_bytes)                                                 # the first chunk's gather
    for i in range(nc):
        more = i + 1 < nc
        f.step(cf, t_ag if more else 0.0, "allgather", g_bytes if more else 0.0)
    b.wait(t_ag, g_bytes)                                                 # backward re-gathers
    for i in range(nc):
        comm = (t_ag if i + 1 < nc else 0.0) + (t_rs if i else 0.0)
        b.step(cb, comm, "allgather", (g_bytes if i + 1 < nc else 0.0) + (r_bytes if i else 0.0))
    b.wait(t_rs, r_bytes)
    bufs = 2 if nc > 1 else 1
    gathered = bufs * p.act(S, 2 * stride)
    fb, bb = model.base_mem(p)
    cost = model.Cost(f, b, fb + gathered + p.act(L, p.heads),
                      bb + gathered + bufs * p.act(S, 2 * stride, 4) + p.act(L, p.heads, 4))
    if nc == 1:
        cost.notes.append("one round: the gather is exposed; the whole sequence's KV is held")
    else:
        cost.notes.append(f"{nc} head chunks pipelined (heads_k_stride={stride})")
    if p.documents is not None:
        cost.balance = model.balance(p, c.layout, W)
        cost.notes.append(f"busiest rank {cost.balance[0]:.2f}x the mean work")
    elif p.causal and c.layout == "contiguous" and W > 1:
        cost.notes.append(f"contiguous causal: the last rank does {2 * W - 1} of {W} average units")
    return cost.prediction()


def _candidates(p: model.Problem, topo, layouts: tuple[str, ...], ulysses: int | None) -> list:
    """Each layout with all KV heads in one round, and in rounds of Hkv/2, Hkv/4 and 1 head."""
    strides = [None] + [s for s in sorted({p.kv_heads // 2, p.kv_heads // 4, 1}, reverse=True)
                        if 0 < s < p.kv_heads and p.kv_heads % s == 0]
    return [model.Candidate("allgather", lay, options=() if s is None else (("heads_k_stride", s),))
            for lay in layouts for s in strides]


def _bench_specs(preset, world: int) -> list:
    """The balanced layout, in one round and in rounds of Hkv/4 heads; one head a round at 1M tokens."""
    if preset.seq_len >= LONG_CONTEXT:
        return [("zigzag", (("heads_k_stride", 1),), None)]
    lay = "zigzag" if preset.causal else "contiguous"
    stride = max(1, preset.kv_heads // 4)
    return [(lay, (), None)] + ([(lay, (("heads_k_stride", stride),), None)] if stride < preset.kv_heads else [])


def _demo_cases(world: int, seq_len: int, documents: tuple[int, ...]) -> list:
    return [dict(layout="contiguous"), dict(layout="zigzag"), dict(layout="zigzag", cu_seqlens=documents)]


METHOD = Method(
    name="allgather",
    summary="all-gather K, V per head chunk; reduce-scatter dK/dV (fp32)",
    layouts=("contiguous", "zigzag", "balanced", "doc_zigzag", "doc_contiguous"),
    options={"heads_k_stride": None},
    features=frozenset({"window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap",
                        "document_layouts"}),
    check=_check,
    engine=_engine,
    cost=_cost,
    candidates=_candidates,
    bench_specs=_bench_specs,
    demo_cases=_demo_cases,
)
