"""The Ulysses sandwich shared by ``ulysses`` and ``usp`` (ALGORITHMS.md §5, §6).

Private: methods never import each other. A sandwich is: all-to-all q/k/v to head-sharded inside the
Ulysses group (one packed collective, Note [Ulysses all-to-all] in ``seqpar.comm.all_to_all``), run an
*engine* on H/U heads of the group's whole sequence, all-to-all out and lse back. The engine is
``LocalEngine`` (one rank sees its whole sequence: Ulysses, and USP with ring degree 1) or USP's pass-KV
ring. Backward mirrors it: dO (and dlse) to head-sharded, the engine's block backward with the FINAL out
and lse, dq/dk/dv back in one collective with the replicated KV heads' partials summed.

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

import functools
from typing import Protocol

import torch
import torch.distributed as dist

from ..comm import all_to_all as a2a
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..kernels.executor import TaskRunner
from ..kernels.merge import Accumulator
from ..layouts.blocks import Rule, Task, plan
from ..layouts.contiguous import Contiguous

__all__ = ["Engine", "LocalEngine", "auto_head_chunks", "backward", "backward_pipelined", "check_heads", "forward",
           "forward_pipelined", "head_chunk_counts", "head_groups", "local_tasks", "resolve_head_chunks"]

Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


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
    ``seqpar.planner.cost.auto_head_chunks`` mirrors this rule (a test keeps them equal).
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


def head_groups(heads: int, kv_heads: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, KV heads) of each group; query head h uses KV head h // G, so groups stay aligned."""
    hq, hk = heads // chunks, kv_heads // chunks
    return [(slice(i * hq, (i + 1) * hq), slice(i * hk, (i + 1) * hk)) for i in range(chunks)]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class Engine(Protocol):
    """Attention on head-sharded tensors ``(B, S_group, h, D)``: what runs between the two all-to-alls."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out in q.dtype, lse (B, h, S_group) fp32)``."""
        ...

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)``: partial sums in the accumulation dtype (fp32; fp64 for fp64 inputs), complete
        ones in it or in the input dtype (the all-to-all casts to its wire dtype while packing)."""
        ...


@functools.lru_cache(maxsize=256)
def local_tasks(seq_len: int, rule: Rule, doc_bounds: tuple[int, ...] | None, valid_len: int | None
                ) -> tuple[Task, ...]:
    """The kernel calls of the whole sequence against itself: windows, documents and padding included."""
    segs = Contiguous(1).segments(0, seq_len).cut(doc_bounds, valid_len)
    return plan(segs, segs, rule)


class LocalEngine:
    """One rank holds the whole sequence for its heads: the block planner's tasks of the full sequence.

    With ring degree 1 every layout is the identity order, so this is also USP's engine then (no ring
    code, no merge of remote blocks).
    """

    def __init__(self, cfg: AttentionConfig, seq_len: int, head_dim: int):
        self.cfg, self.scale = cfg, cfg.scale(head_dim)
        self.tasks = local_tasks(seq_len, cfg.rule, cfg.cu_seqlens, cfg.valid_len)

    def _runner(self, needs_delta: bool = False) -> TaskRunner:
        return TaskRunner(self.cfg.kernel, self.scale, deterministic=self.cfg.deterministic,
                          needs_delta=needs_delta)

    def forward(self, q, k, v):
        runner = self._runner()
        acc = Accumulator(q)
        for t in runner.prepare(self.tasks, q, k):
            acc.add(t.q, *runner.forward(q, k, v, t))
        return acc.result(q.dtype)

    def backward(self, do, q, k, v, out, lse, delta):
        runner = self._runner(needs_delta=delta is not None)
        return runner.backward_all(do, q, k, v, out, lse, self.tasks, delta)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None, engine: Engine
            ) -> tuple[torch.Tensor, torch.Tensor, Saved]:
    """The sandwich's forward: ``(out (B, L, H, D), lse (B, H, L), saved for backward)``.

    ``group`` is the Ulysses group, in sequence-piece order (one rank: no all-to-all at all).
    """
    q_h, k_h, v_h = a2a.post_qkv_seq_to_heads(q, k, v, group).wait()
    out_h, lse_h = engine.forward(q_h, k_h, v_h)
    out_p = a2a.post_heads_to_seq(out_h, group)                      # both posted, then both awaited
    lse_p = a2a.post_heads_to_seq(lse_h, group, seq_dim=2, head_dim=1)
    return out_p.wait(), lse_p.wait(), (q_h, k_h, v_h, out_h, lse_h)


def backward(do: torch.Tensor, dlse: torch.Tensor | None, saved: Saved, kv_heads: int,
             group: dist.ProcessGroup | None, engine: Engine, grad_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sandwich's backward from ``do (B, L, H, D)`` and optional ``dlse (B, H, L)``: ``(dq, dk, dv)``.

    Gradients come back in the input dtypes (Note [Ulysses gradient wire]).
    """
    q_h, k_h, v_h, out_h, lse_h = saved
    do_p = a2a.post_seq_to_heads(do, group)
    dlse_p = None if dlse is None else a2a.post_seq_to_heads(dlse, group, seq_dim=2, head_dim=1)
    do_h = do_p.wait()
    delta_h = None if dlse_p is None else _delta(do_h, out_h, lse_h, dlse_p.wait())
    dq_h, dk_h, dv_h = engine.backward(do_h, q_h, k_h, v_h, out_h, lse_h, delta_h)
    wire = _grad_wire(q_h.dtype, kv_heads, dist.get_world_size(group), grad_dtype)
    dq, dk, dv = a2a.post_grads_heads_to_seq(dq_h, dk_h, dv_h, kv_heads, group, wire).wait()  # cast on packing
    return dq.to(q_h.dtype), dk.to(k_h.dtype), dv.to(v_h.dtype)


def _delta(do_h: torch.Tensor, out_h: torch.Tensor, lse_h: torch.Tensor, dlse_h: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * O) - dlse`` (B, h, S): d lse_i / d s_ij = P_ij, so a gradient on lse shifts Delta by -dlse."""
    acc = lse_h.dtype
    return (do_h.to(acc) * out_h.to(acc)).sum(-1).transpose(1, 2) - dlse_h.to(acc)


def _grad_wire(dtype: torch.dtype, kv_heads: int, degree: int, grad_dtype: torch.dtype) -> torch.dtype:
    """The gradient all-to-all's dtype (Note [Ulysses gradient wire]): the input dtype unless KV heads are
    replicated, then ``grad_dtype`` (fp32 becomes the accumulation dtype, fp64 for fp64 inputs)."""
    if max(degree // kv_heads, 1) == 1:
        return dtype
    return acc_dtype(dtype) if grad_dtype == torch.float32 else grad_dtype


# --- head-group pipeline (Note [Head-group pipeline]) -------------------------------------------------------

def forward_pipelined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                      engine: Engine, chunks: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The sandwich over ``chunks`` head groups, transfers behind the neighbouring groups' kernels.

    Args:
        q: ``(B, L, H, D)``; k, v: ``(B, L, Hkv, D)``: this rank's rows, all heads.
        group: the Ulysses group, in sequence-piece order.
        engine: runs one group's head-sharded ``(B, U L, H/(c U), D)`` tensors.
        chunks: c, from ``resolve_head_chunks``.

    Returns:
        ``out (B, L, H, D)``, ``lse (B, H, L)`` (fp32; fp64 for fp64 inputs) and, for backward, each
        group's head-sharded ``(q, k, v, out, lse)`` one after the other (5 c tensors).
    """
    parts = head_groups(q.shape[2], k.shape[2], chunks)
    B, L, H, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, H, L, dtype=acc_dtype(q.dtype), device=q.device)

    def post_in(i: int) -> a2a.Pending[tuple[torch.Tensor, ...]]:
        hq, hk = parts[i]
        return a2a.post_qkv_seq_to_heads(q[:, :, hq], k[:, :, hk], v[:, :, hk], group)

    def write(hq: slice, out_p: a2a.Pending[torch.Tensor], lse_p: a2a.Pending[torch.Tensor]) -> None:
        out[:, :, hq] = out_p.wait()
        lse[:, hq] = lse_p.wait()

    saved: list[torch.Tensor] = []
    nxt, prev = post_in(0), None
    for i, (hq, _) in enumerate(parts):
        cur, nxt = nxt, (post_in(i + 1) if i + 1 < chunks else None)    # group i+1's inputs move behind group i
        q_h, k_h, v_h = cur.wait()
        out_h, lse_h = engine.forward(q_h, k_h, v_h)
        posted = (hq, a2a.post_heads_to_seq(out_h, group), a2a.post_heads_to_seq(lse_h, group, seq_dim=2, head_dim=1))
        if prev is not None:                    # group i-1's outputs moved behind group i's kernels
            write(*prev)
        prev = posted
        saved += (q_h, k_h, v_h, out_h, lse_h)
    write(*prev)
    return out, lse, tuple(saved)


def backward_pipelined(do: torch.Tensor, dlse: torch.Tensor | None, saved: tuple[torch.Tensor, ...], kv_heads: int,
                       group: dist.ProcessGroup | None, engine: Engine, grad_dtype: torch.dtype, chunks: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``forward_pipelined`` from ``do (B, L, H, D)`` and optional ``dlse (B, H, L)``.

    Group i+1's dO (and dlse) move behind group i's backward kernels, group i-1's dq/dk/dv behind them
    too; gradients come back in the input dtypes (Note [Ulysses gradient wire], per group).
    """
    B, L, H, D = do.shape
    parts = head_groups(H, kv_heads, chunks)
    q_h, k_h = saved[0], saved[1]
    dq = torch.empty(B, L, H, D, dtype=q_h.dtype, device=do.device)
    dk = torch.empty(B, L, kv_heads, D, dtype=k_h.dtype, device=do.device)
    dv = torch.empty(B, L, kv_heads, D, dtype=saved[2].dtype, device=do.device)
    wire = _grad_wire(q_h.dtype, kv_heads // chunks, dist.get_world_size(group), grad_dtype)

    def post_in(i: int) -> tuple[a2a.Pending[torch.Tensor], a2a.Pending[torch.Tensor] | None]:
        hq = parts[i][0]
        return (a2a.post_seq_to_heads(do[:, :, hq], group),
                None if dlse is None else a2a.post_seq_to_heads(dlse[:, hq], group, seq_dim=2, head_dim=1))

    def write(hq: slice, hk: slice, grads_p: a2a.Pending[tuple[torch.Tensor, ...]]) -> None:
        gq, gk, gv = grads_p.wait()
        dq[:, :, hq], dk[:, :, hk], dv[:, :, hk] = gq, gk, gv        # replica sums (fp32) cast here, once

    nxt, prev = post_in(0), None
    for i, (hq, hk) in enumerate(parts):
        (do_p, dlse_p), nxt = nxt, (post_in(i + 1) if i + 1 < chunks else None)
        q_h, k_h, v_h, out_h, lse_h = saved[5 * i: 5 * i + 5]
        do_h = do_p.wait()
        delta_h = None if dlse_p is None else _delta(do_h, out_h, lse_h, dlse_p.wait())
        dq_h, dk_h, dv_h = engine.backward(do_h, q_h, k_h, v_h, out_h, lse_h, delta_h)
        posted = (hq, hk, a2a.post_grads_heads_to_seq(dq_h, dk_h, dv_h, kv_heads // chunks, group, wire))
        del dq_h, dk_h, dv_h
        if prev is not None:
            write(*prev)
        prev = posted
    write(*prev)
    return dq, dk, dv
