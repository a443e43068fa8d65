"""Run planned tasks through the chosen kernel: slicing, selection per mask kind, varlen grouping.

Methods hand a ``TaskRunner`` a task (rows of the local queries, rows of a key block, a mask) and the whole
tensors; the runner slices views, asks ``select`` for the kernel (cached per signature), and returns the
block result. A step with three or more tasks (documents) is packed into varlen calls when a kernel
serves them, so one launch covers all documents.
"""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedInputError
from ..layouts.blocks import Task, group_varlen
from ..masks import Varlen
from ..types import AttnOutput
from .base import Kernel, KernelCall, select

__all__ = ["TaskRunner"]

_GROUP_AT = 3


@functools.lru_cache(maxsize=1024)
def _grouped(tasks: tuple[Task, ...]) -> tuple[Task, ...]:
    return group_varlen(tasks)


class TaskRunner:
    """Executes tasks with kernel ``kernel`` ("auto" or a name) at ``scale``."""

    def __init__(self, kernel: str, scale: float, *, deterministic: bool = False, needs_delta: bool = False):
        self.kernel, self.scale = kernel, scale
        self.deterministic, self.needs_delta = deterministic, needs_delta

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, task: Task) -> Kernel:
        return select(self.kernel, KernelCall.of(q, k, task.mask, self.deterministic, self.needs_delta))

    def prepare(self, tasks: tuple[Task, ...], q: torch.Tensor, k: torch.Tensor) -> tuple[Task, ...]:
        """Pack many per-document tasks into varlen calls where a kernel serves varlen."""
        if len(tasks) < _GROUP_AT:
            return tasks
        grouped = _grouped(tasks)
        try:
            for t in grouped:
                if isinstance(t.mask, Varlen):
                    self.kernel_for(q, k, t)
        except UnsupportedInputError:
            return tasks
        return grouped

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, task: Task) -> AttnOutput:
        qs, ks, vs = q[:, task.q], k[:, task.k], v[:, task.k]
        return self.kernel_for(qs, ks, task).forward(qs, ks, vs, task.mask, self.scale)

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None, lse: torch.Tensor, task: Task, delta: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qs, ks, vs = q[:, task.q], k[:, task.k], v[:, task.k]
        kern = self.kernel_for(qs, ks, task)
        return kern.backward(do[:, task.q], qs, ks, vs, None if out is None else out[:, task.q],
                             lse[:, :, task.q], task.mask, self.scale,
                             delta=None if delta is None else delta[:, :, task.q], deterministic=self.deterministic)

    def backward_all(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor | None, lse: torch.Tensor, tasks: tuple[Task, ...],
                     delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every task's gradients summed over the whole q, k, v (fp32, fp64 for fp64 inputs); one task that
        covers everything returns the kernel's own gradients, with no sums and no copies."""
        tasks = self.prepare(tasks, q, k)
        if len(tasks) == 1 and tasks[0].rows == q.shape[1] and tasks[0].cols == k.shape[1]:
            return self.backward(do, q, k, v, out, lse, tasks[0], delta)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (q, k, v))
        for t in tasks:
            gq, gk, gv = self.backward(do, q, k, v, out, lse, t, delta)
            dq[:, t.q] += gq
            dk[:, t.k] += gk
            dv[:, t.k] += gv
        return dq, dk, dv

