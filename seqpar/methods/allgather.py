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
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..kernels.executor import TaskRunner
from ..kernels.merge import merge_
from ..layouts import Layout, make_layout
from ..layouts.blocks import Rule, Run, Segments, Task, plan
from ..types import AttnOutput
from ._autograd import differentiable

NAME = "allgather"
LAYOUTS = ("contiguous", "zigzag")
MESH_DIMS = 1
OPTIONS: dict[str, object] = {"heads_k_stride": None}
FEATURES = frozenset({"window", "varlen", "padding", "lse_grad"})

__all__ = ["FEATURES", "LAYOUTS", "MESH_DIMS", "NAME", "OPTIONS", "GatherPlan", "attention", "gather_plan",
           "placement"]


def placement(layout: str, groups: SeqParallelGroups) -> tuple[Layout, int]:
    """Tokens follow ``layout`` over the whole group; this rank holds piece ``groups.index``."""
    return make_layout(layout, groups.world), groups.index


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
        raise ValueError(f"method={NAME!r} needs a layout of consecutive runs, got {layout.name}")
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

    Buffers are sequence-major, ``(rows, 2, B, stride, D)`` with K and V packed, so the rank-major gather
    concatenates along the sequence and the gathered K is the strided view ``(B, S, stride, D)``.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, stride: int, ag: AllGather, gp: GatherPlan):
        B, L, Hkv, D = k.shape
        self.k, self.v, self.stride, self.ag, self.gp = k, v, stride, ag, gp
        self.rounds = Hkv // stride
        self.send = k.new_empty(L, 2, B, stride, D)
        self.recv = [k.new_empty(ag.world * L, 2, B, stride, D) for _ in range(min(2, self.rounds))]
        self.glob = None if gp.order is None else torch.empty_like(self.recv[0])

    def post(self, c: int) -> Handle:
        """Pack KV heads of chunk c and post their gather (Note [All-gather pipeline])."""
        hs = slice(c * self.stride, (c + 1) * self.stride)
        self.send[:, 0].copy_(self.k[:, :, hs].transpose(0, 1))
        self.send[:, 1].copy_(self.v[:, :, hs].transpose(0, 1))
        return self.ag.gather(self.send, self.recv[c % len(self.recv)])

    def kv(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk c's gathered ``k, v (B, S, stride, D)`` in global order (after its handle's ``wait``)."""
        buf = self.recv[c % len(self.recv)]
        if self.glob is not None:
            _permute_chunks(buf, self.glob, self.gp.order)
            buf = self.glob
        return buf[:, 0].transpose(0, 1), buf[:, 1].transpose(0, 1)


def _setup(q: torch.Tensor, k: torch.Tensor, cfg: AttentionConfig, groups: SeqParallelGroups,
           needs_delta: bool = False):
    layout, index = placement(cfg.layout, groups)
    gp = gather_plan(layout, index, q.shape[1] * groups.world, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
    runner = TaskRunner(cfg.kernel, cfg.scale(q.shape[-1]), deterministic=cfg.deterministic,
                        needs_delta=needs_delta)
    stride = _stride(cfg, k.shape[2])
    return gp, runner, stride, q.shape[2] // k.shape[2]


def _forward(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups):
    """Forward: ``(out (B, L, H, D) in q.dtype, lse (B, H, L) fp32)`` (Note [All-gather pipeline])."""
    gp, runner, stride, G = _setup(q, k, cfg, groups)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, L, H, D = q.shape
    tasks = runner.prepare(gp.tasks, q[:, :, : stride * G], k[:, :, :stride])   # the same for every chunk
    direct = _disjoint(tasks)           # every row in at most one call: write results, no fp32 merge buffer
    out = torch.zeros(B, L, H, D, dtype=q.dtype if direct else acc, device=q.device)
    lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
    gathered = _Gathered(k, v, stride, AllGather(groups.group), gp)
    handle = gathered.post(0)
    for c in range(gathered.rounds):
        handle.wait()
        if c + 1 < gathered.rounds:
            handle = gathered.post(c + 1)              # in flight while chunk c computes
        kc, vc = gathered.kv(c)
        qh = slice(c * stride * G, (c + 1) * stride * G)
        qc = q[:, :, qh]
        for t in tasks:
            o, l = runner.forward(qc, kc, vc, t)
            if direct:
                out[:, t.q, qh] = o
                lse[:, qh, t.q] = l
            else:
                merge_(out[:, t.q, qh], lse[:, qh, t.q], o, l)
    return out.to(q.dtype), lse


@functools.lru_cache(maxsize=256)
def _disjoint(tasks: tuple[Task, ...]) -> bool:
    """No query row is in two calls (always so for a global-order plan unless varlen packing interleaves)."""
    spans = sorted((t.q_start, t.q_stop) for t in tasks)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def _backward(do, q, k, v, out, lse, dlse, cfg: AttentionConfig, groups: SeqParallelGroups):
    """Backward: re-gather per head chunk, local block backward, fp32 dK/dV reduce-scattered to owners."""
    delta = None
    if dlse is not None:       # d lse_i / d s_ij = P_ij: a gradient on lse shifts Delta by -dlse
        delta = (do.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(1, 2) - dlse.to(lse.dtype)
    gp, runner, stride, G = _setup(q, k, cfg, groups, needs_delta=delta is not None)
    ag = AllGather(groups.group)
    gathered = _Gathered(k, v, stride, ag, gp)
    grads = _DKV(k, stride, ag.world, gathered.rounds, gp.order, cfg.grad_dtype)
    dq = torch.zeros(q.shape, dtype=grads.acc_dtype, device=q.device)
    tasks = runner.prepare(gp.tasks, q[:, :, : stride * G], k[:, :, :stride])
    handle = gathered.post(0)
    for c in range(gathered.rounds):
        handle.wait()
        if c + 1 < gathered.rounds:
            handle = gathered.post(c + 1)
        kc, vc = gathered.kv(c)
        qh = slice(c * stride * G, (c + 1) * stride * G)
        qc, doc_, oc = q[:, :, qh], do[:, :, qh], out[:, :, qh]
        dkv = grads.start(c)
        for t in tasks:
            gq, gk, gv = runner.backward(doc_, qc, kc, vc, oc, lse[:, qh], t,
                                         None if delta is None else delta[:, qh])
            dq[:, t.q, qh] += gq
            dkv[t.k, 0] += gk.transpose(0, 1)
            dkv[t.k, 1] += gv.transpose(0, 1)
        grads.post(c, ag)
    dk, dv = grads.finish(k.dtype)
    return dq.to(q.dtype), dk, dv


class _DKV:
    """fp32 dK/dV of the gathered buffer per head chunk, and their pipelined reduce-scatter to the owners.

    ``start(c)`` gives chunk c's zeroed global-order accumulator ``(S, 2, B, stride, D)``; ``post(c)``
    brings it to rank order in the wire dtype (a copy only when the order or the dtype differs) and posts
    the reduce-scatter into ``out[c]``; ``finish`` waits and returns ``dk, dv (B, L, Hkv, D)``.
    """

    def __init__(self, k: torch.Tensor, stride: int, world: int, rounds: int, order: tuple[int, ...] | None,
                 grad_dtype: torch.dtype):
        B, L, _, D = k.shape
        self.acc_dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
        self.wire = self.acc_dtype if grad_dtype == torch.float32 else grad_dtype
        self.order, self.shape = order, (B, L, k.shape[2], D)
        self.direct = order is None and self.wire == self.acc_dtype      # reduce-scatter the accumulator
        nbuf = min(2, rounds)
        self.acc = [k.new_empty(world * L, 2, B, stride, D, dtype=self.acc_dtype)
                    for _ in range(nbuf if self.direct else 1)]
        self.send = [] if self.direct else [torch.empty_like(self.acc[0], dtype=self.wire) for _ in range(nbuf)]
        self.stage = (torch.empty_like(self.acc[0], dtype=self.wire)
                      if order is not None and self.wire != self.acc_dtype else None)
        self.out = k.new_empty(rounds, L, 2, B, stride, D, dtype=self.wire)
        self.pending: list[Handle | None] = [None] * nbuf

    def start(self, c: int) -> torch.Tensor:
        slot = c % len(self.pending)
        if self.direct and self.pending[slot] is not None:
            self.pending[slot].wait()                  # its reduce-scatter still reads this accumulator
        buf = self.acc[c % len(self.acc)]
        return buf.zero_()

    def post(self, c: int, ag: AllGather) -> None:
        slot = c % len(self.pending)
        buf = self.acc[c % len(self.acc)]
        if not self.direct:
            if self.pending[slot] is not None:
                self.pending[slot].wait()
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

    def finish(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        for h in self.pending:
            if h is not None:
                h.wait()
        B, L, Hkv, D = self.shape
        g = self.out.permute(2, 3, 1, 0, 4, 5).reshape(2, B, L, Hkv, D)   # (n, L, 2, B, s, D) -> (2, B, L, Hkv, D)
        return g[0].to(dtype), g[1].to(dtype)


@functools.lru_cache(maxsize=64)
def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for c, i in enumerate(order):
        inv[i] = c
    return tuple(inv)


def _stride(cfg: AttentionConfig, kv_heads: int) -> int:
    s = cfg.option("heads_k_stride")
    if s is None:
        return kv_heads
    if isinstance(s, bool) or not isinstance(s, int) or s < 1 or kv_heads % s:
        raise ValueError(f"heads_k_stride must be None or a positive divisor of the KV heads ({kv_heads}), "
                         f"got {s!r}{rank_suffix()}")
    return s


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
              groups: SeqParallelGroups) -> AttnOutput:
    """All-gather KV attention on local shards ``(B, L, H, D)``; differentiable in q, k, v (and through lse)."""
    _stride(cfg, k.shape[2])                  # validate the option before any collective
    return differentiable(q, k, v, cfg, groups, _forward, _backward)
