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

__all__ = ["Engine", "LocalEngine", "backward", "check_heads", "forward", "local_tasks"]

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
        acc = acc_dtype(q.dtype)
        tasks = runner.prepare(self.tasks, q, k)
        S = q.shape[1]
        if len(tasks) == 1 and tasks[0].rows == S and tasks[0].cols == S:     # the common case: no copies
            return runner.backward(do, q, k, v, out, lse, tasks[0], delta)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v))
        for t in tasks:
            gq, gk, gv = runner.backward(do, q, k, v, out, lse, t, delta)
            dq[:, t.q] += gq
            dk[:, t.k] += gk
            dv[:, t.k] += gv
        return dq, dk, dv


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
    delta_h = None
    if dlse_p is not None:      # d lse_i / d s_ij = P_ij: a gradient on lse shifts Delta by -dlse
        acc = lse_h.dtype
        delta_h = (do_h.to(acc) * out_h.to(acc)).sum(-1).transpose(1, 2) - dlse_p.wait().to(acc)
    dq_h, dk_h, dv_h = engine.backward(do_h, q_h, k_h, v_h, out_h, lse_h, delta_h)
    replicas = max(dist.get_world_size(group) // kv_heads, 1)
    acc = acc_dtype(q_h.dtype)
    wire = q_h.dtype if replicas == 1 else (acc if grad_dtype == torch.float32 else grad_dtype)
    dq, dk, dv = a2a.post_grads_heads_to_seq(dq_h, dk_h, dv_h, kv_heads, group, wire).wait()  # cast on packing
    return dq.to(q_h.dtype), dk.to(k_h.dtype), dv.to(v_h.dtype)
