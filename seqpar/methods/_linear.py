"""What the linear-attention methods (``lasp2``, ``lasp1``) share: config, slot plan, local compute, corrections.

Private: methods never import each other. A rank's rows are cut into **slots** (one per layout piece:
one for contiguous, two for zigzag), every slot a contiguous run of global positions; the global scan runs
over all slots in position order. Documents (``cu_seqlens``) and end padding cut a slot into **segments**:
runs of real rows of one document. Every local computation is per segment, with a zero initial state;
the cross-slot state enters through two closed-form terms (ALGORITHMS.md §10.3-§10.5).

Note [Slot summaries]
    Slot c maps the state entering it to the state leaving it: ``S_out(c) = Diag(P_c) S_in(c) + M_c``, with
    ``M_c = (K_e * e^{G_n - G})^T V_e`` over its LAST segment e (segment-local inclusive G, G_n its last
    value; exponents <= 0) and ``P_c = e^{G_n}`` when the slot is one segment that continues the document
    of the previous position ("passes"). A slot with a document boundary inside (or at its start) resets
    the chain: ``P_c = 0``. A slot of padding only is the identity (``P = 1, M = 0``) so the final state
    of the sequence passes through it. The initial state enters at global position 0 only: the owner of
    slot 0 folds it in (``M_0 <- P_0 S_init + M_0``), so every scan starts from zero. Consequences:
    S_in(c) corrects only the FIRST segment's queries, and dS_out(c) only the LAST segment's keys/values.

Note [Closed-form corrections]
    With the local pass run at zero state, the cross-slot terms are, per slot (S_in from the prefix scan,
    dS_out from the suffix scan)::

        o_f  += (Q_f * e^{G}) S_in                  dq_f += (dO_f S_in^T) * e^{G}        first segment f
        dk_e += e^{G_n - G} * (V_e dS_out^T)        dv_e += (K_e * e^{G_n - G}) dS_out    last segment e
        dg   += revcumsum_seg(q * dq_corr - k * dk_corr) + [e] rowsum_V(dS_out * S_out)

    The gate term is the identity dG_t = q_t dq_t - k_t dk_t (+ dS_n * S_n at the segment end), summed
    from t to the segment end because G is a cumulative sum; applied to the correction parts only, since
    the local pass's autograd already holds the rest. ``dS_in`` of this rank's own outputs is
    ``dM_f = (Q_f * e^{G})^T dO_f``: the summary the backward exchanges.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from ..errors import rank_suffix
from ..kernels.linear import LinearKernel, cumulative_gate
from ..layouts import Layout, Segments
from ..memo import batch_memo
from ..numerics import acc_dtype

__all__ = ["LinearConfig", "LinearPlan", "Seg", "Slot", "add_state_grads", "add_state_output", "linear_plan",
           "local_backward", "local_forward", "noncausal_sources", "segment_sums", "state_grad", "summaries"]


@dataclass(frozen=True, kw_only=True)
class LinearConfig:
    """One linear-attention call's options (frozen, hashable: plans are cached on it)."""

    method: str = "lasp2"
    """Sequence-parallel method: "lasp2" (all-gather of state summaries) or "lasp1" (the ring baseline)."""
    layout: str = "contiguous"
    """Token layout: "contiguous" or "zigzag" (lasp2); lasp1 takes contiguous only."""
    causal: bool = True
    """Causal (the recurrence); False: every token sees its whole document (no decay allowed)."""
    chunk_size: int = 64
    """Chunk length C of the local chunked form."""
    kernel: str = "auto"
    """Local kernel: "auto", "chunked", "recurrent" or "fla" (``seqpar.kernels.linear``)."""
    cu_seqlens: tuple[int, ...] | None = None
    """Global document boundaries (host ints, 0 first): the state resets at every boundary."""
    seq_len: int | None = None
    """Valid global length when the shards carry end padding."""
    grad_dtype: torch.dtype = torch.float32
    """Dtype of the exchanged state gradients (dM); fp32 default."""
    output_final_state: bool = False
    """Also return the state after the last valid token (replicated on every rank)."""
    has_initial_state: bool = False
    """An initial state enters at global position 0."""
    deterministic: bool = False
    """Reductions over ranks in a fixed order (an all-gather summed in rank order instead of an all-reduce)."""

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {self.chunk_size!r}{rank_suffix()}")
        if self.grad_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"grad_dtype must be a floating dtype, got {self.grad_dtype}{rank_suffix()}")
        cu = self.cu_seqlens
        if cu is not None and (len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu))):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {list(cu)[:12]}"
                             f"{rank_suffix()}")

    @property
    def valid_len(self) -> int | None:
        return self.seq_len if self.seq_len is not None else (self.cu_seqlens[-1] if self.cu_seqlens else None)


# ------------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class Seg:
    """Local rows ``start:stop`` of document ``doc`` (real tokens only)."""

    start: int
    stop: int
    doc: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)


@dataclass(frozen=True)
class Slot:
    """One layout piece of one rank: its real segments and how the state crosses it (Note [Slot summaries])."""

    owner: int
    piece: int
    segs: tuple[Seg, ...]
    receives: bool
    """The first segment continues the state entering the slot (or the initial state at position 0)."""
    passes: bool
    """A single segment that receives: ``S_out = Diag(e^{G_n}) S_in + M``; otherwise ``S_out = M``."""


@dataclass(frozen=True)
class LinearPlan:
    """All slots in global position order; ``pieces`` slots per rank."""

    slots: tuple[Slot, ...]
    pieces: int

    def row(self, slot: Slot) -> int:
        """The slot's row in a gathered ``(W * pieces, ...)`` buffer (rank-major, as the all-gather lays it)."""
        return slot.owner * self.pieces + slot.piece

    def own(self, rank: int) -> tuple[Slot, ...]:
        """``rank``'s slots in local order (piece 0 first)."""
        return tuple(sorted((s for s in self.slots if s.owner == rank), key=lambda s: s.piece))

    def order(self, slot: Slot) -> int:
        """Position of ``slot`` in the global scan."""
        return self.slots.index(slot)


@batch_memo()
def linear_plan(layout: Layout, seq_len: int, doc_bounds: tuple[int, ...] | None, valid_len: int | None,
                has_init: bool) -> LinearPlan:
    """Every rank's slots and segments (host ints, identical on every rank; Note [Slot summaries])."""
    end = valid_len if valid_len is not None else seq_len
    starts = set((doc_bounds or (0, end))[:-1])
    placed = []
    for r in range(layout.world):
        whole = layout.segments(r, seq_len)
        if whole.stride != 1:
            raise ValueError(f"linear attention needs layouts of contiguous pieces, got {layout.name}")
        for piece, run in enumerate(whole.runs):
            cut = Segments((run,)).cut(doc_bounds, valid_len)
            segs = tuple(Seg(x.local, x.end, x.doc) for x in cut.runs if x.doc >= 0)
            first = cut.runs[0]
            receives = first.doc >= 0 and (first.glob not in starts or (first.glob == 0 and has_init))
            placed.append((run.glob, Slot(r, piece, segs, receives, receives and len(segs) == 1)))
    placed.sort(key=lambda x: x[0])
    return LinearPlan(tuple(s for _, s in placed), len(layout.segments(0, seq_len).runs))


# ------------------------------------------------------------------------------------------------ local work


def _rows(x: torch.Tensor | None, seg: Seg) -> torch.Tensor | None:
    return None if x is None else x[:, seg.rows]


def _decayed(x: torch.Tensor, G: torch.Tensor | None, to_end: bool = False) -> torch.Tensor:
    """``x * e^{G}`` (or ``x * e^{G_n - G}`` with ``to_end``) in G's dtype; every exponent is <= 0."""
    if G is None:
        return x
    return x.to(G.dtype) * torch.exp(G[:, -1:] - G if to_end else G)


def local_forward(kern: LinearKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                  slots: tuple[Slot, ...], chunk_size: int) -> torch.Tensor:
    """Every real segment at zero initial state: ``o (B, L, H, V)`` in the accumulation dtype, 0 at padding."""
    acc = acc_dtype(q.dtype)
    o = q.new_zeros(*q.shape[:3], v.shape[-1], dtype=acc)
    for slot in slots:
        for s in slot.segs:
            o_s, _ = kern.run(q[:, s.rows], k[:, s.rows], v[:, s.rows], _rows(g, s), None, chunk_size)
            o[:, s.rows] = o_s.to(acc)
    return o


def local_backward(kern: LinearKernel, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor | None, slots: tuple[Slot, ...], chunk_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of ``local_forward`` (recomputed under autograd), accumulation dtype, 0 at padding."""
    acc = acc_dtype(q.dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    gl = None if g is None else g.detach().requires_grad_()
    outs, gouts = [], []
    with torch.enable_grad():
        for slot in slots:
            for s in slot.segs:
                o_s, _ = kern.run(*(t[:, s.rows] for t in leaves), _rows(gl, s), None, chunk_size)
                outs.append(o_s)
                gouts.append(do[:, s.rows].to(o_s.dtype))
        inputs = leaves + ([] if gl is None else [gl])
        grads = torch.autograd.grad(outs, inputs, gouts, allow_unused=True) if outs else [None] * len(inputs)
    res = [torch.zeros_like(t, dtype=acc) if d is None else d.to(acc) for t, d in zip(inputs, grads)]
    return res[0], res[1], res[2], (res[3] if gl is not None else None)


# ------------------------------------------------------------------------------------------------ summaries


def summaries(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, slots: tuple[Slot, ...],
              fold: tuple[Slot, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The packed ``[M | P]`` of each own slot, ``(pieces, B, H, K, V + 1)`` fp32, plus M and P per slot.

    ``fold = (slot, h0)``: the initial state enters the chain at that slot (the one at global position 0),
    so its packed summary is ``P h0 + M`` (Note [Slot summaries]); the returned M stays unfolded.
    """
    acc = acc_dtype(k.dtype)
    B, _, H, K = k.shape
    V = v.shape[-1]
    buf = k.new_empty(len(slots), B, H, K, V + 1, dtype=acc)
    Ms, Ps = [], []
    for i, slot in enumerate(slots):
        if not slot.segs:                                   # padding only: the identity
            M, P = k.new_zeros(B, H, K, V, dtype=acc), k.new_ones(B, H, K, dtype=acc)
        else:
            e = slot.segs[-1]
            G = cumulative_gate(_rows(g, e), acc)
            M = torch.einsum("bnhk,bnhv->bhkv", _decayed(k[:, e.rows].to(acc), G, to_end=True),
                             v[:, e.rows].to(acc))
            if not slot.passes:
                P = k.new_zeros(B, H, K, dtype=acc)
            elif G is None:
                P = k.new_ones(B, H, K, dtype=acc)
            else:
                P = torch.exp(G[:, -1]).expand(B, H, K)
        Ms.append(M)
        Ps.append(P)
        buf[i, ..., :V] = P.unsqueeze(-1) * fold[1].to(acc) + M if fold is not None and fold[0] == slot else M
        buf[i, ..., V] = P
    return buf, Ms, Ps


def add_state_output(o: torch.Tensor, q: torch.Tensor, g: torch.Tensor | None, slot: Slot,
                     S_in: torch.Tensor) -> None:
    """``o_f += (Q_f * e^{G}) S_in`` on the slot's first segment (Note [Closed-form corrections])."""
    f = slot.segs[0]
    G = cumulative_gate(_rows(g, f), S_in.dtype)
    o[:, f.rows] += torch.einsum("bnhk,bhkv->bnhv", _decayed(q[:, f.rows].to(S_in.dtype), G), S_in)


def state_grad(q: torch.Tensor, g: torch.Tensor | None, do: torch.Tensor, slot: Slot, dtype: torch.dtype
               ) -> torch.Tensor:
    """``dM_f = (Q_f * e^{G})^T dO_f``: the gradient of this slot's own outputs w.r.t. ``S_in``."""
    f = slot.segs[0]
    G = cumulative_gate(_rows(g, f), dtype)
    return torch.einsum("bnhk,bnhv->bhkv", _decayed(q[:, f.rows].to(dtype), G), do[:, f.rows].to(dtype))


def _revcumsum(x: torch.Tensor) -> torch.Tensor:
    return x.flip(1).cumsum(1).flip(1)


def add_state_grads(grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, do: torch.Tensor, slot: Slot,
                    S_in: torch.Tensor, dS_out: torch.Tensor, S_out: torch.Tensor) -> None:
    """Add the cross-slot terms of Note [Closed-form corrections] to ``(dq, dk, dv, dg)`` in place.

    ``S_in``/``S_out`` are the states entering/leaving the slot, ``dS_out`` the gradient of the state leaving
    it (from the slots after it); all in the accumulation dtype.
    """
    dq, dk, dv, dg = grads
    acc = S_in.dtype
    last = len(slot.segs) - 1
    terms: dict[int, torch.Tensor] = {}          # segment index -> dL/dG_t of the correction parts
    if slot.receives:
        f = slot.segs[0]
        G = cumulative_gate(_rows(g, f), acc)
        dq_c = _decayed(torch.einsum("bnhv,bhkv->bnhk", do[:, f.rows].to(acc), S_in), G)
        dq[:, f.rows] += dq_c
        if dg is not None:
            terms[0] = q[:, f.rows].to(acc) * dq_c
    if slot.segs:
        e = slot.segs[last]
        G = cumulative_gate(_rows(g, e), acc)
        dk_c = _decayed(torch.einsum("bnhv,bhkv->bnhk", v[:, e.rows].to(acc), dS_out), G, to_end=True)
        dk[:, e.rows] += dk_c
        dv[:, e.rows] += torch.einsum("bnhk,bhkv->bnhv", _decayed(k[:, e.rows].to(acc), G, to_end=True), dS_out)
        if dg is not None:
            terms[last] = terms.get(last, 0.0) - k[:, e.rows].to(acc) * dk_c
    if dg is None:
        return
    for i, term in terms.items():
        term = _revcumsum(term)
        if i == last:                                        # e^{G_n} of the state leaving the slot
            term = term + (dS_out * S_out).sum(-1).unsqueeze(1)
        dg[:, slot.segs[i].rows] += term.sum(-1) if dg.dim() == 3 else term


# ------------------------------------------------------------------------------------------------ non-causal


def segment_sums(a: torch.Tensor, b: torch.Tensor, slots: tuple[Slot, ...], dtype: torch.dtype
                 ) -> list[list[torch.Tensor]]:
    """``A_s^T B_s`` per real segment of every slot (``(B, H, K, V)`` in ``dtype``)."""
    return [[torch.einsum("bnhk,bnhv->bhkv", a[:, s.rows].to(dtype), b[:, s.rows].to(dtype)) for s in slot.segs]
            for slot in slots]


@functools.lru_cache(maxsize=32)
def noncausal_sources(plan: LinearPlan, rank: int) -> tuple[tuple[tuple[int, ...] | None, ...], ...]:
    """For each own slot and segment: the rows of the gathered ``(W * pieces * 2)`` boundary sums that make its
    document's total, or None for a segment inside the slot (its own sum is the total).

    Each slot contributes two boundary entries: its first segment's sum (row ``2 * row(slot)``) and, when it
    has more than one segment, its last segment's (row ``2 * row(slot) + 1``). Only those can share a
    document with another slot.
    """
    entries = []
    for slot in plan.slots:
        if slot.segs:
            entries.append((2 * plan.row(slot), slot.segs[0].doc))
        if len(slot.segs) > 1:
            entries.append((2 * plan.row(slot) + 1, slot.segs[-1].doc))
    out = []
    for slot in plan.own(rank):
        per = []
        for i, s in enumerate(slot.segs):
            boundary = i == 0 or i == len(slot.segs) - 1
            per.append(tuple(row for row, doc in entries if doc == s.doc) if boundary else None)
        out.append(tuple(per))
    return tuple(out)
