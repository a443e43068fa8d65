"""A second stream for calls that run beside the current stream's: fork, run, join.

    side = beside(device)            # None off CUDA: the caller runs everything in order
    with on(side):
        ...                          # work launched first, beside what the current stream runs next
    join(side, made)                 # the current stream waits for it; ``made`` there is marked as used here

    beside_largest(tasks, fn, device)  # fn(task) for each: the largest on the current stream, the rest beside it

Note [Calls side by side]
    A kernel call of a few thousand query rows leaves the GPU partly idle at its end: its last thread blocks run
    while the rest of the GPU waits (FA2's varlen forward over a balanced rank's pieces of documents: 0.47 ms for
    0.26 ms of its share of the one-GPU call at 4K tokens per rank over 8, ``benchmarks/gpu/probe_small_grids.py``),
    and a call of many short segments is mostly its thread blocks' fixed cost (0.13 ms for 0.02). Two such calls
    that share no output run on two streams, the smaller ones launched first: each fills the other's idle
    end. Long documents alone beside a varlen call (Note [Long documents in few heads] in ``long_docs``) and
    all-gather's calls of one round (Note [All-gather calls side by side] in ``seqpar.methods.allgather``) fork
    here (``beside_largest``), and so does a long causal call cut in three (Note [Long causal calls in halves] in
    ``seqpar.kernels.executor``). One stream per device, made once: under graph capture the fork and join are
    recorded like any stream wait.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["beside", "beside_largest", "join", "on"]


@functools.cache
def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def beside(device: torch.device) -> torch.cuda.Stream | None:
    """The second stream, made to wait for the current one's work so far; None off CUDA (run in order)."""
    if device.type != "cuda":
        return None
    side = _stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def on(side: torch.cuda.Stream | None):
    """Launch on ``side`` (``beside``'s stream), or on the current stream where it is None."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(side: torch.cuda.Stream | None, made: list[torch.Tensor]) -> None:
    """The current stream waits for ``side``; tensors made there are marked as used here, so their memory is not
    handed to the side stream's next work before this stream is done with them."""
    if side is None:
        return
    cur = torch.cuda.current_stream(side.device)
    cur.wait_stream(side)
    for t in made:
        t.record_stream(cur)


def beside_largest(tasks, fn, device: torch.device) -> list:
    """``fn(task)`` for every task (blocks with ``rows`` and ``cols``), in task order: the largest (by rows x keys)
    on the current stream, the others launched first on the side stream; what they return (tuples of tensors)
    joins the current stream."""
    if len(tasks) < 2:
        return [fn(t) for t in tasks]
    main = max(range(len(tasks)), key=lambda i: tasks[i].rows * tasks[i].cols)
    rest = [i for i in range(len(tasks)) if i != main]
    res: list = [None] * len(tasks)
    side = beside(device)
    with on(side):
        for i in rest:
            res[i] = fn(tasks[i])
    res[main] = fn(tasks[main])
    join(side, [x for i in rest for x in res[i]])
    return res
