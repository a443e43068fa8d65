"""Run planned tasks through the chosen kernels: slicing, selection per mask kind, varlen grouping.

Methods hand a ``TaskRunner`` a task (rows of the local queries, rows of a key block, a mask) and the whole
tensors; the runner slices views and calls the kernel chosen for that kind of block. A runner belongs to one
planned call (``seqpar.runtime``), so its shapes are fixed: each kind of block resolves its kernel once
(``select`` with its reasons), and a steady-state call only slices and launches. A step with three or more
tasks (documents) is packed into varlen calls when a kernel serves them, so one launch covers all documents.

Backward takes a ``seqpar.numerics.GradRows`` of the final rows: a kernel with ``takes_delta`` gets Delta, the
others the (dO, O) pair with any lse gradient folded in (Note [Folding the lse gradient]).

Note [Varlen backward in row groups]
    A kernel's backward holds a workspace sized by its rows: FA2 keeps an fp32 dQ accumulator and, under GQA, dK
    and dV for every query head - 6.7 GiB beyond the inputs for a 128K-row call with 32/8 heads of 128, so a
    1M-row packed call does not fit an 80 GiB GPU although its forward does. Documents are independent, so a
    varlen call's backward is cut at document boundaries into consecutive calls of at most ``VARLEN_BWD_ROWS``
    rows (a longer document alone) whose gradients are disjoint row ranges of the result: no sums, no fp32
    buffers, the same values as one call (every document sees the same kernel on the same rows), and the
    workspace bounded by one group. The cost is the copy of each group's gradients into the whole tensors.

Note [Runner memos]
    The grouping of a step's tasks into varlen calls and the row groups of a varlen backward are computed once
    per runner, not in module-level caches: a runner belongs to one planned call, so what it derived for a
    packed batch goes when that batch's plan leaves the plan cache (Note [Bounded plan cache] in
    ``seqpar.runtime.call``) - a module-level cache keyed by task tuples kept hundreds of dead batches' tasks.
    A runner meets a handful of task tuples (its schedule's steps); ``MEMO_SIZE`` bounds the memo anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ..errors import UnsupportedInputError
from ..layouts.blocks import Task, group_varlen
from ..masks.forms import Band, Modded, Varlen
from ..numerics import GradRows, acc_dtype
from ..types import AttnOutput
from .base import Kernel, KernelCall, mask_kind, select

__all__ = ["GROUP_AT", "GROUP_ROWS", "MEMO_SIZE", "VARLEN_BWD_ROWS", "TaskRunner", "row_groups"]

GROUP_AT = 3
"""Tasks of one step from which ``TaskRunner.prepare`` packs them into varlen calls."""
GROUP_ROWS = 4096
"""Query rows from which a task stays out of varlen packing: a call that large is not launch-bound, and on the
H100 cuDNN runs a 16K causal call 1.5x faster than FA2 (``benchmarks/results/2026-11-23-h100-probe``), while
varlen runs on FA2 only (a 128K row of 8K chunks: FA2 varlen 1.20x flex, measured 2026-11-25)."""
VARLEN_BWD_ROWS = 1 << 18
"""Rows (batch x sequence) per varlen backward call (Note [Varlen backward in row groups])."""
MEMO_SIZE = 64
"""Entries of one runner's memo (Note [Runner memos])."""


def row_groups(task: Task, most: int) -> tuple[Task, ...]:
    """``task`` (varlen) cut at document boundaries into consecutive tasks of at most ``most`` query rows each
    (a longer document alone), covering its rows and keys (Note [Varlen backward in row groups])."""
    m = task.mask
    assert isinstance(m, Varlen)
    cq, ck, n = m.cu_q, m.cu_k, len(m.cu_q) - 1
    out, a = [], 0
    while a < n:
        b = a + 1
        while b < n and cq[b + 1] - cq[a] <= most:
            b += 1
        out.append(Task(task.q_start + cq[a], task.q_start + cq[b], task.k_start + ck[a], task.k_start + ck[b],
                        Varlen(tuple(x - cq[a] for x in cq[a:b + 1]), tuple(x - ck[a] for x in ck[a:b + 1]),
                               m.window)))
        a = b
    return tuple(out)


def _all_visible(b, h, q_idx, kv_idx):
    """A ``mask_mod`` that hides nothing (the probe block of ``takes_delta``)."""
    return kv_idx >= 0


class TaskRunner:
    """Executes tasks with kernel ``kernel`` ("auto" or a name) at ``scale``, score cap ``softcap``."""

    def __init__(self, kernel: str, scale: float, *, deterministic: bool = False, softcap: float = 0.0,
                 shapes_vary: bool = False):
        self.kernel, self.scale, self.softcap = kernel, scale, float(softcap)
        self.deterministic = deterministic
        self.shapes_vary = shapes_vary
        self._chosen: dict[tuple, Kernel] = {}
        self._memo: OrderedDict[tuple, Any] = OrderedDict()

    @classmethod
    def of(cls, call: Any) -> TaskRunner:
        """The runner of a planned call (``methods.base.Call``): its kernel, scale and options; its blocks' shapes
        vary batch to batch when it has several documents or a valid length (Note [Plans per shape]); one
        document over the whole sequence (a balanced layout's ``(0, S)``) keeps fixed shapes."""
        cfg = call.cfg
        docs = cfg.cu_seqlens
        return cls(cfg.kernel, call.scale, deterministic=cfg.deterministic, softcap=cfg.softcap,
                   shapes_vary=(docs is not None and len(docs) > 2) or cfg.valid_len is not None)

    def _memoized(self, key: tuple, make) -> Any:
        """``make()``, computed once per ``key`` for this runner (Note [Runner memos])."""
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = make()
            if len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        return hit

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, task: Task, dv: int | None = None) -> Kernel:
        """The kernel for this kind of block (``dv``: the value head dim, default q's)."""
        single = task.rows == 1 and task.cols == 1
        kind = mask_kind(task.mask)
        key = (kind, single, q.shape[2], k.shape[2], q.shape[-1], dv, q.dtype, q.device.type)
        kern = self._chosen.get(key)
        if kern is None:
            call = KernelCall(q.device.type, q.dtype, q.shape[-1], q.shape[2], k.shape[2], kind, self.deterministic,
                              single, 0 if dv is None or dv == q.shape[-1] else dv, self.softcap > 0,
                              self.shapes_vary)
            kern = self._chosen[key] = select(self.kernel, call)
        return kern

    def direct(self, tasks: tuple[Task, ...], q_shape, k_shape, v_shape, dtype: torch.dtype, device: torch.device):
        """``f(q, k, v) -> out`` for a call that is one whole block served by a kernel with a differentiable
        aten op (Note [Direct calls] in ``seqpar.kernels.base``), else None."""
        if len(tasks) != 1:
            return None
        t = tasks[0]
        if (t.q_start, t.q_stop, t.k_start, t.k_stop) != (0, q_shape[1], 0, k_shape[1]):
            return None
        dv = v_shape[-1]
        call = KernelCall(device.type, dtype, q_shape[-1], q_shape[2], k_shape[2], mask_kind(t.mask),
                          self.deterministic, t.rows == 1 and t.cols == 1, 0 if dv == q_shape[-1] else dv,
                          self.softcap > 0, self.shapes_vary)
        try:
            kern = select(self.kernel, call)
        except UnsupportedInputError:
            return None
        if not kern.direct(t.mask) or (dv != q_shape[-1] and kern.name not in ("cudnn", "flex")):
            return None
        if self.softcap and not kern.direct_softcap:
            return None
        mask, scale, cap = t.mask, self.scale, self.softcap
        if cap:
            return lambda q, k, v: kern.autograd_forward(q, k, v, mask, scale, cap)
        return lambda q, k, v: kern.autograd_forward(q, k, v, mask, scale)

    def prepare(self, tasks: tuple[Task, ...], q: torch.Tensor, k: torch.Tensor) -> tuple[Task, ...]:
        """Pack many small per-document tasks into varlen calls where a kernel serves varlen (tasks of
        ``GROUP_ROWS`` rows or more keep their own call, unless their shapes vary batch to batch: Note [Plans per
        shape]); decided once per task tuple and kind of tensors."""
        if len(tasks) < GROUP_AT:
            return tasks
        key = ("prepared", tasks, q.shape[2], k.shape[2], q.shape[-1], q.dtype, q.device.type)
        return self._memoized(key, lambda: self._packed(tasks, q, k))

    def _packed(self, tasks: tuple[Task, ...], q: torch.Tensor, k: torch.Tensor) -> tuple[Task, ...]:
        most = float("inf") if self.shapes_vary else GROUP_ROWS
        big = tuple(t for t in tasks if t.rows >= most)
        small = tuple(t for t in tasks if t.rows < most)
        if len(small) < GROUP_AT:
            return tasks
        grouped = group_varlen(small) + big
        try:
            chosen = {self.kernel_for(q, k, t).name for t in grouped if isinstance(t.mask, Varlen)}
            alone = {self.kernel_for(q, k, t).name for t in tasks if isinstance(t.mask, Band)}
        except UnsupportedInputError:
            return tasks
        if "reference" in chosen and alone - {"reference"}:
            return tasks        # the reference kernel for varlen (CPU auto): one cpu_flash call per block is faster
        return grouped

    def takes_delta(self, q: torch.Tensor, k: torch.Tensor, kinds: frozenset[str], dv: int | None = None) -> bool:
        """Whether the kernels of every mask kind in ``kinds`` take a precomputed Delta (pass-Q's bundle)."""
        probe = {"full": (1, 1, None, None), "causal": (2, 2, None, 0), "band": (2, 2, 0, 0)}
        for kind in sorted(kinds):
            if kind == "varlen":
                task = Task(0, 2, 0, 2, Varlen((0, 2), (0, 2)))
            elif kind == "mod":
                task = Task(0, 2, 0, 2, Modded(Band(), _all_visible, ((0, 2),), ((0, 2),)))
            else:
                m, n, lo, hi = probe[kind]
                task = Task(0, m, 0, n, Band(lo, hi))
            if not self.kernel_for(q, k, task, dv).takes_delta:
                return False
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, task: Task) -> AttnOutput:
        qs = q if task.q_start == 0 and task.q_stop == q.shape[1] else q[:, task.q]   # no view when whole
        ks, vs = (k, v) if task.k_start == 0 and task.k_stop == k.shape[1] else (k[:, task.k], v[:, task.k])
        return self.kernel_for(qs, ks, task, v.shape[-1]).forward(qs, ks, vs, task.mask, self.scale,
                                                                   softcap=self.softcap)

    def backward(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                 task: Task) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One task's (dq, dk, dv) from the final rows ``rows`` (full local rows; sliced here)."""
        sq, sk = task.q, task.k
        qs, ks, vs = q[:, sq], k[:, sk], v[:, sk]
        kern = self.kernel_for(qs, ks, task, v.shape[-1])
        if kern.takes_delta:
            do, out, delta = rows.do[:, sq], None, rows.delta[:, :, sq]
        else:
            do_f, out_f = rows.folded
            do, out, delta = do_f[:, sq], out_f[:, sq], None
        return kern.backward(do, qs, ks, vs, out, lse[:, :, sq], task.mask, self.scale, delta=delta,
                             softcap=self.softcap, deterministic=self.deterministic)

    def backward_all(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                     tasks: tuple[Task, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every task's gradients summed over the whole q, k, v (fp32, fp64 for fp64 inputs); one task that
        covers everything returns the kernel's own gradients, with no sums and no copies."""
        tasks = self.prepare(tasks, q, k)
        if len(tasks) == 1 and tasks[0].rows == q.shape[1] and tasks[0].cols == k.shape[1]:
            t = tasks[0]
            if isinstance(t.mask, Varlen) and q.shape[0] * t.rows > VARLEN_BWD_ROWS:
                most = VARLEN_BWD_ROWS // q.shape[0]
                groups = self._memoized(("rows", t, most), lambda: row_groups(t, most))
                return self._backward_groups(rows, q, k, v, lse, groups)
            return self.backward(rows, q, k, v, lse, t)
        acc = acc_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v))
        for t in tasks:
            gq, gk, gv = self.backward(rows, q, k, v, lse, t)
            dq[:, t.q] += gq
            dk[:, t.k] += gk
            dv[:, t.k] += gv
        return dq, dk, dv

    def _backward_groups(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         lse: torch.Tensor, groups: tuple[Task, ...]) -> tuple[torch.Tensor, ...]:
        """One varlen backward per row group, written into disjoint rows of the result (the kernel's dtype);
        keys of a group without queries keep a zero gradient."""
        out: list[torch.Tensor] = []
        for t in groups:
            if t.rows == 0:
                continue
            g = self.backward(rows, q, k, v, lse, t)
            if not out:
                out = [torch.zeros(x.shape, dtype=gx.dtype, device=x.device) for x, gx in zip((q, k, v), g)]
            out[0][:, t.q], out[1][:, t.k], out[2][:, t.k] = g
        return tuple(out) if out else tuple(torch.zeros_like(x) for x in (q, k, v))
