"""The Ulysses sandwich shared by ``ulysses`` and ``usp`` (ALGORITHMS.md §5, §6).

Private: methods never import each other. A sandwich is: all-to-all q/k/v to head-sharded inside the
Ulysses group (one packed collective, Note [Ulysses all-to-all] in ``seqpar.comm.all_to_all``), run an
*inner* engine on H/U heads of the group's whole sequence, all-to-all out and lse back. The inner engine is
``LocalEngine`` (one rank sees its whole sequence: Ulysses, and USP with ring degree 1) or USP's pass-KV
ring. Backward mirrors it: dO (and dlse, whenever lse is returned - an agreed fact, zeros where this rank's
lse got no gradient) to head-sharded, the inner backward with the FINAL out and lse (attention sinks
re-applied to the saved head-sharded rows, Note [Attention sinks] in ``seqpar.numerics``), dq/dk/dv back in one
collective with the replicated KV heads' partials summed. ``Sandwich`` is the engine both methods build.

Note [Ulysses gradient wire]
    dq, and dk/dv without KV replication, are complete gradients when they leave the engine: the
    all-to-all only permutes them, so casting to the input dtype before the move gives bitwise the result
    of casting after, at half the bytes of fp32 for bf16 inputs. Only replicated KV heads (Hkv < U) return
    partials; then the whole buffer travels in ``grad_dtype`` (fp32 by default) and the replicas are summed
    in fp32 before the one final cast.

Note [Head-group pipeline]
    Plain, the three phases are serial: the packed q/k/v all-to-all, the engine, the out/lse all-to-all all
    sit on the critical path (ALGORITHMS.md §5.5). With ``head_chunks = c`` the sandwich runs on c head
    groups: group i holds query heads ``[i H/c, (i+1) H/c)`` and KV heads ``[i Hkv/c, (i+1) Hkv/c)``
    (query head h uses KV head ``h // G``, so a group owns exactly the KV heads its queries use, and each
    group must keep the slot rules of Note [GQA head slots] on its own). Forward, on every rank::

        post in(0)
        i = 0:  post in(1)    wait in(0)  engine(0)  post out(0)
        i = 1:  post in(2)    wait in(1)  engine(1)  post out(1)  wait out(0) -> write group 0's heads
        ...
        i = c-1:              wait in(c-1)  engine(c-1)  post out(c-1)  wait out(c-2) -> write
        wait out(c-1) -> write

    so the inputs of group i+1 and the outputs of group i-1 move while group i's kernels run; only in(0)
    and out(c-1), 1/c of the bytes each, stay exposed. Each group's out and lse land in preallocated
    ``(B, L, H, D)`` / ``(B, H, L)`` tensors. Backward is the same pipeline over dO (and dlse), the
    engine's backward and the packed dq/dk/dv move, written into preallocated gradients.

    Streams and lifetimes: no side stream. Every collective is posted ``async_op=True`` on its process
    group; on NCCL it runs on the group's internal stream (ordered after the packing kernels already
    queued on the current stream) and ``Work.wait()`` makes the *current* stream wait for it - a
    device-side dependency, never a host sync. A ``Pending`` holds its send and receive buffers until
    ``wait()``, so the caching allocator cannot recycle memory a collective still reads or writes, and
    every posted collective is waited before the function returns (yunchang's asynchronous Ulysses posts
    raw collectives on a side stream with neither ``wait_stream`` nor ``record_stream`` and loses the
    gradients: PEERS.md §2, defect 10). One communicator runs its collectives in posting order, which is
    the same on every rank: in(0), in(1), out(0), in(2), out(1), ... USP's ring engine talks on the ring
    group meanwhile, also in the same order on every rank.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from ..comm import all_to_all as a2a
from ..comm import symmetric
from ..comm.loop import Loop, run_steps
from ..errors import rank_suffix
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator
from ..layouts.blocks import Rule, Task, plan
from ..layouts.contiguous import Contiguous
from ..memo import batch_memo
from ..numerics import GradRows, acc_dtype, apply_sinks, wire_dtype
from ._shared import head_groups
from .base import BackwardInputs, Call

__all__ = ["Inner", "LocalEngine", "Sandwich", "auto_head_chunks", "check_heads", "head_chunk_counts",
           "local_tasks", "resolve_head_chunks", "saved_meta"]


def check_heads(heads: int, kv_heads: int, degree: int, world: int | None = None) -> None:
    """Raise ValueError unless the Ulysses degree serves these heads (Note [GQA head slots]).

    The rules: ``degree`` divides ``heads``, and it divides ``kv_heads`` or is a multiple of it. The message
    names the valid degrees (only those dividing ``world`` when the degree comes from a mesh of that size).
    """
    if a2a.HeadSlots.is_valid(heads, kv_heads, degree):
        return
    valid = a2a.HeadSlots.valid_degrees(heads, kv_heads)
    if world is not None:
        valid = [d for d in valid if world % d == 0]
    if heads % degree:
        rule = f"divide heads={heads}"
    else:
        rule = f"divide kv_heads={kv_heads} or be a multiple of it (heads={heads})"
    raise ValueError(f"ulysses degree must {rule} (valid: {', '.join(map(str, valid))}"
                     f"{f' for {world} ranks' if world is not None else ''}), got {degree}{rank_suffix()}")


def head_chunk_counts(heads: int, kv_heads: int, degree: int) -> list[int]:
    """Every head-group count c the pipeline serves (Note [Head-group pipeline]): c divides ``heads`` and
    ``kv_heads``, and each group's ``(heads/c, kv_heads/c)`` keeps the slot rules over ``degree`` ranks."""
    return [c for c in range(1, kv_heads + 1) if heads % c == 0 and kv_heads % c == 0
            and a2a.HeadSlots.is_valid(heads // c, kv_heads // c, degree)]


#: the most head groups ``head_chunks="auto"`` picks (more groups add collectives, hide little more)
AUTO_MAX_CHUNKS = 4


def auto_head_chunks(heads: int, kv_heads: int, degree: int) -> int:
    """``head_chunks="auto"``: the largest c <= ``AUTO_MAX_CHUNKS`` among ``head_chunk_counts`` such that

    * no group replicates KV heads (``kv_heads / c >= degree``): with ``kv_heads < degree`` the plain
      sandwich already replicates and every split would multiply the KV bytes on the wire, so 1;
    * every rank keeps at least 2 query heads per group (``heads / (c degree) >= 2``), so a group's
      kernel stays large enough to hide the next group's transfer;

    and 1 for ``degree == 1`` (no all-to-all to hide). Pure and shape-only: every rank picks the same c.
    ``seqpar.cost.model.auto_head_chunks`` mirrors this rule (a test keeps them equal).
    """
    if degree == 1:
        return 1
    valid = head_chunk_counts(heads, kv_heads, degree)
    for c in range(AUTO_MAX_CHUNKS, 1, -1):
        if c in valid and kv_heads // c >= degree and heads // (c * degree) >= 2:
            return c
    return 1


def resolve_head_chunks(value: object, heads: int, kv_heads: int, degree: int) -> int:
    """The ``head_chunks`` option as a group count, validated before any collective (same error on every rank).

    Raises:
        TypeError: ``value`` is neither a positive int nor "auto".
        ValueError: the heads do not split into ``value`` groups that each keep the slot rules; the
            message names the valid counts.
    """
    if isinstance(value, str) and value == "auto":
        return auto_head_chunks(heads, kv_heads, degree)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"head_chunks must be a positive int or 'auto', got {value!r}{rank_suffix()}")
    valid = head_chunk_counts(heads, kv_heads, degree)
    if value not in valid:
        raise ValueError(f"head_chunks must split heads={heads} and kv_heads={kv_heads} into groups that each "
                         f"keep the GQA slot rules over the ulysses degree {degree} (valid: "
                         f"{', '.join(map(str, valid))}), got {value!r}{rank_suffix()}")
    return value


def saved_meta(q_shape, k_shape, v_shape, dtype: torch.dtype, degree: int, chunks: int) -> list:
    """Shapes of what ``Sandwich.forward`` saves (``(q, k, v, out, lse)`` head-sharded, per head group)."""
    B, L, H, D = q_shape
    Hkv, Dv = k_shape[2], v_shape[-1]
    slots = a2a.HeadSlots(H // chunks, Hkv // chunks, degree)
    hq, hk, S = slots.q_per_rank, slots.kv_per_rank, L * degree
    one = [((B, S, hq, D), dtype), ((B, S, hk, D), dtype), ((B, S, hk, Dv), dtype), ((B, S, hq, Dv), dtype),
           ((B, hq, S), acc_dtype(dtype))]
    return one * chunks


class Inner(Protocol):
    """Attention on head-sharded tensors ``(B, S_group, h, D)``: what runs between the two all-to-alls."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out in q.dtype, lse (B, h, S_group) fp32)``."""
        ...

    def backward(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)``: partial sums in the accumulation dtype (fp32; fp64 for fp64 inputs), complete
        ones in it or in the input dtype (the all-to-all casts to its wire dtype while packing)."""
        ...


@batch_memo()
def local_tasks(seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None, valid_len: int | None
                ) -> tuple[Task, ...]:
    """The kernel calls of the whole sequence against itself: windows, documents and padding included."""
    segs = Contiguous(1).segments(0, seq_len).cut(doc_bounds, valid_len)
    return plan(segs, segs, rule)


class LocalEngine:
    """One rank holds the whole sequence for its heads: the block planner's tasks of the full sequence.

    With ring degree 1 every layout is the identity order, so this is also USP's inner engine then (no ring
    code, no merge of remote blocks).
    """

    def __init__(self, call: Call):
        cfg = call.cfg
        self.tasks = local_tasks(call.seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)
        self.runner = TaskRunner.of(call)

    def direct(self, call: Call):
        return self.runner.direct(self.tasks, call.q_shape, call.k_shape, call.v_shape, call.dtype, call.device)

    def forward(self, q, k, v):
        acc = Accumulator(q, v.shape[-1], defer=True)
        for t, res in self.runner.forward_each(self.tasks, q, k, v):
            acc.add(t.q, *res, t.covered)
        return acc.result(q.dtype)

    def backward(self, rows, q, k, v, lse):
        return self.runner.backward_all(rows, q, k, v, lse, self.tasks)


def _grad_wire(dtype: torch.dtype, kv_heads: int, degree: int, grad_dtype: torch.dtype) -> torch.dtype:
    """The gradient all-to-all's dtype (Note [Ulysses gradient wire]): the input dtype unless KV heads are
    replicated, then ``grad_dtype`` (fp32 becomes the accumulation dtype, fp64 for fp64 inputs)."""
    if max(degree // kv_heads, 1) == 1:
        return dtype
    return wire_dtype(grad_dtype, dtype)


class Sandwich:
    """The Ulysses engine: all-to-all in, ``inner`` on H/U heads, all-to-all out (Notes above).

    ``chunks`` head groups pipeline the transfers behind the neighbouring groups' kernels (Note [Head-group
    pipeline]); one group is the plain sandwich, every phase in sequence. ``transport="copy_engine"`` moves the
    all-to-alls on copy engines (Note [Copy-engine all-to-all] in ``seqpar.comm.symmetric``).
    """

    saves = True

    def __init__(self, call: Call, axis: str, inner: Inner, chunks: int, transport: str = "nccl"):
        self.groups, self.axis, self.inner, self.chunks = call.groups, axis, inner, chunks
        group = self.group
        self.degree = dist.get_world_size(group)
        self.u = dist.get_rank(group)
        self.pulls = symmetric.Pulls(call.device) if transport == "copy_engine" and self.degree > 1 else None
        self.parts = head_groups(call.q_shape[2], call.k_shape[2], chunks)
        self.kv_heads, self.grad_dtype = call.k_shape[2], call.cfg.grad_dtype
        self.shapes = (tuple(call.q_shape), tuple(call.k_shape), tuple(call.v_shape))

    def direct(self, call: Call):
        """At Ulysses degree 1 (and one head group) the whole call is the inner engine's direct call."""
        inner = getattr(self.inner, "direct", None)
        return inner(call) if self.degree == 1 and self.chunks == 1 and inner is not None else None

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The Ulysses group (``groups.group`` for Ulysses, ``groups.ulysses`` for USP), looked up per call."""
        return getattr(self.groups, self.axis)

    @property
    def stages(self) -> bool:
        """Whether a call's first and last copies can run outside its graph (Note [Staged calls] in
        ``seqpar.runtime.graphs``): the plain sandwich over several ranks on NCCL (on copy engines the first copy
        writes the lane, so it stays in the call)."""
        return self.chunks == 1 and self.degree > 1 and self.pulls is None

    def stage_shape(self) -> tuple[int, ...]:
        """The shape of ``stage``'s buffer."""
        return a2a.packed_qkv_shape(*self.shapes, self.degree)

    def stage(self, q, k, v, out: torch.Tensor | None = None) -> torch.Tensor:
        """q, k and v packed for the all-to-all (into ``out`` where given): the first copy of a staged call."""
        return a2a.pack_qkv(q, k, v, self.group, out=out)

    def forward_staged(self, send: torch.Tensor):
        """``forward`` from ``stage``'s buffer up to out's receive buffer: ``(raw out, lse, saved)``."""
        (_, _, H, D), (_, _, Hkv, _), _ = self.shapes
        loop = Loop()
        with loop:
            ins = loop.post(a2a.post_packed_qkv(send, H, Hkv, D=D, group=self.group))
            loop.wait(ins)
            q_h, k_h, v_h = ins[0].result
            out_h, lse_h = self.inner.forward(q_h, k_h, v_h)
            outs = loop.post([a2a.post_heads_to_seq_raw(out_h, self.group),
                              a2a.post_heads_to_seq(lse_h, self.group, seq_dim=2, head_dim=1)])
            loop.wait(outs)
            raw, lse = (p.result for p in outs)
        return raw, lse, (q_h, k_h, v_h, out_h, lse_h)

    def unstage(self, raw: torch.Tensor) -> torch.Tensor:
        """out laid out from its receive buffer, a new tensor: the last copy of a staged call."""
        return a2a.unpack_heads(raw)

    def forward(self, q, k, v):
        """``(out (B, L, H, Dv), lse (B, H, L), saved)``; saved: each group's head-sharded (q, k, v, out, lse)."""
        if self.stages:
            raw, lse, saved = self.forward_staged(self.stage(q, k, v))
            return self.unstage(raw), lse, saved
        if self.pulls is None:
            return self._forward(q, k, v, self.group)
        with self.pulls.call(self.group) as pulls:      # copy engines (Note [Copy-engine all-to-all])
            return self._forward(q, k, v, pulls)

    def _forward(self, q, k, v, group):
        B, L, H, _ = q.shape
        out = q.new_empty(B, L, H, v.shape[-1]) if self.chunks > 1 else None
        lse = torch.empty(B, H, L, dtype=acc_dtype(q.dtype), device=q.device) if self.chunks > 1 else None
        saved: list[torch.Tensor] = []
        ins: list = []
        outs: list = []
        res: list = []
        loop = Loop()

        def post_in(i: int) -> None:          # group i+1's inputs move behind group i's kernels
            hq, hk = self.parts[i]
            ins.append(loop.post(a2a.post_qkv_seq_to_heads(q[:, :, hq], k[:, :, hk], v[:, :, hk], group)))

        def compute(i: int) -> None:
            (pending,) = ins[i]
            loop.wait(ins[i])
            q_h, k_h, v_h = pending.result
            out_h, lse_h = self.inner.forward(q_h, k_h, v_h)
            outs.append(loop.post([a2a.post_heads_to_seq(out_h, group),
                                   a2a.post_heads_to_seq(lse_h, group, seq_dim=2, head_dim=1)]))
            saved.extend((q_h, k_h, v_h, out_h, lse_h))
            if i > 0:                         # group i-1's outputs moved behind group i's kernels
                land_out(i - 1)

        def land_out(i: int) -> None:
            loop.wait(outs[i])
            o, l = (p.result for p in outs[i])
            if self.chunks == 1:
                res.extend((o, l))
            else:
                hq = self.parts[i][0]
                out[:, :, hq], lse[:, hq] = o, l

        with loop:
            post_in(0)
            run_steps(self.chunks, post=lambda i: post_in(i + 1) if i + 1 < self.chunks else None,
                      compute=compute, loop=loop)
            land_out(self.chunks - 1)
        if self.chunks == 1:
            return res[0], res[1], tuple(saved)
        return out, lse, tuple(saved)

    def _local_heads(self, hq: slice) -> slice:
        """This rank's heads of the query-head group ``hq`` (global head indices)."""
        n = (hq.stop - hq.start) // self.degree
        return slice(hq.start + self.u * n, hq.start + (self.u + 1) * n)

    def backward(self, b: BackwardInputs):
        """From the final rows: dO (and dlse when lse is returned) to head-sharded, the inner backward, back."""
        if self.pulls is None:
            return self._backward(b, self.group)
        with self.pulls.call(self.group) as pulls:
            return self._backward(b, pulls)

    def _backward(self, b: BackwardInputs, group):
        do, dlse = b.rows.do, b.dlse
        B, L, H, Dv = do.shape
        D = b.saved[0].shape[-1]
        dq = do.new_empty(B, L, H, D) if self.chunks > 1 else None
        dk = do.new_empty(B, L, self.kv_heads, D) if self.chunks > 1 else None
        dv = do.new_empty(B, L, self.kv_heads, Dv) if self.chunks > 1 else None
        wire = _grad_wire(do.dtype, self.kv_heads // self.chunks, self.degree, self.grad_dtype)
        ins: list = []
        outs: list = []
        res: list = []
        loop = Loop()

        def post_in(i: int) -> None:
            hq = self.parts[i][0]
            ins.append(loop.post([a2a.post_seq_to_heads(do[:, :, hq], group),
                                  None if dlse is None else a2a.post_seq_to_heads(dlse[:, hq], group, seq_dim=2,
                                                                                  head_dim=1)]))

        def compute(i: int) -> None:
            loop.wait(ins[i])
            do_h, *dlse_h = (p.result for p in ins[i])
            q_h, k_h, v_h, out_h, lse_h = b.saved[5 * i: 5 * i + 5]
            if b.sinks is not None:           # the final rows of these heads (Note [Attention sinks])
                out_h, lse_h = apply_sinks(out_h, lse_h, b.sinks[self._local_heads(self.parts[i][0])])
            grads = self.inner.backward(GradRows(do_h, out_h, dlse_h[0] if dlse_h else None), q_h, k_h, v_h, lse_h)
            outs.append(loop.post(a2a.post_grads_heads_to_seq(*grads, self.kv_heads // self.chunks, group, wire)))
            if i > 0:
                land(i - 1)

        def land(i: int) -> None:
            loop.wait(outs[i])
            gq, gk, gv = outs[i][0].result
            if self.chunks == 1:
                res.extend((gq, gk, gv))
            else:                             # replica sums (fp32) cast here, once
                hq, hk = self.parts[i]
                dq[:, :, hq], dk[:, :, hk], dv[:, :, hk] = gq, gk, gv

        with loop:
            post_in(0)
            run_steps(self.chunks, post=lambda i: post_in(i + 1) if i + 1 < self.chunks else None,
                      compute=compute, loop=loop)
            land(self.chunks - 1)
        if self.chunks == 1:
            gq, gk, gv = res
            return gq.to(do.dtype), gk.to(do.dtype), gv.to(do.dtype)
        return dq, dk, dv
