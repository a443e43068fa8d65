"""Helpers shared by the point-to-point schedules (tokenring, tasp, double_ring): planning and buffer views.

Private: methods never import each other. Everything here is either host-side planning on ``Segments``
(run once per schedule and cached by the callers) or a view/dtype rule.

Note [Sequence-major wire buffers]
    Tensors that travel in row ranges (TokenRing's Q bundle after the zigzag wrap, TASP's KV pieces) are
    kept sequence-major, ``x_SBHD`` (rows first), so any row range ``x_SBHD[a:b]`` is one contiguous
    message whatever the batch size - never a strided slice handed to send, and no copy per step. Kernels
    see them through ``bshd(x_SBHD)``, a ``(B, S, H, D)`` view (last dim contiguous, as kernels require);
    lse-like ``(S, B, H)`` buffers through ``bhs``. With a batch of one the caller's tensor already is
    sequence-major: pass-Q's queries and backward bundle then start as the caller's tensors, sent as they lie and
    never received into (``Double.starting``), each bundle part a message of the hop's exchange.

Note [One KV message]
    K and V travel together (the pass-KV ring and the all-gather now send the forward's K and V as two messages of
    one exchange instead, with no pack: Note [K and V apart] in ``seqpar.methods.allgather``; their dK/dV still
    travel packed, as do TASP's and the double ring's K and V). With one head dim they are stacked, ``kv (2, B, L,
    Hkv, D)``, so each is a contiguous tensor for the kernels; with a value head dim Dv != D (MLA) they are
    concatenated on the last dim, ``kv (..., Hkv, D + Dv)``, and read back as last-dim slices (row stride D + Dv).
    Sequence-major buffers (``seq_dim=0``) always concatenate. ``unpack_kv`` tells the two apart by rank.

Note [Hiding the tail]
    A schedule whose last transfer returns results (a partial output, a dQ or dK/dV partial) to their
    owner would leave that transfer exposed. The owner's own (diagonal) block is split in two: one part
    runs at step 0 (hiding the first hop), the other after the last return is posted, so the final
    transfer overlaps compute (ALGORITHMS.md §7.2 "Hide the tail"). The split is by key rows
    (``split_own``): for a causal block each part is one top-left causal kernel call, where halves of the
    query rows took three calls between them (the back rows' diagonal sits at an offset, which cuDNN
    cannot align) - each call of a backward also runs cuDNN's passes over its query rows (dO . O, dQ's
    conversion): TokenRing's and TASP's forward+backward at 2K-4K tokens per rank took 0.5-2% less time
    emulated on an H100 (``benchmarks/results/2026-11-26-h100-own-split-keys``).
"""

from __future__ import annotations

import itertools

import torch

from ..kernels import combine
from ..kernels.merge import RowSum
from ..layouts.blocks import Rule, Segments, Task, plan, slice_rows
from ..numerics import acc_dtype

__all__ = ["backward_parts", "bhs", "bshd", "exact_partial", "head_groups", "hold_own", "home_partial", "hull",
           "key_hull", "land_home", "pack_kv", "receipt", "row_hull", "seq_major", "shift", "split_own", "swap_partial",
           "unpack_kv"]

Rows = tuple[int, int] | None


def head_groups(heads: int, kv_heads: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, KV heads) of each of ``chunks`` groups; query head h uses KV head h // G, so groups stay
    aligned."""
    hq, hk = heads // chunks, kv_heads // chunks
    return [(slice(i * hq, (i + 1) * hq), slice(i * hk, (i + 1) * hk)) for i in range(chunks)]


def exact_partial(runner, tasks, spans, q: torch.Tensor, k: torch.Tensor, dv: int) -> bool:
    """Whether a partial assembled from ``tasks``' gradients is exact in the inputs' dtype (Note [Partials home] in
    ``_passkv``): no row in two of ``spans`` (each task's ``(start, stop)`` rows of the partial), and every task's
    kernel returns its gradients in that dtype (``Kernel.grads_in_input_dtype``) or the inputs are in the
    accumulation dtype already. Both ends of a transfer decide it from the same prepared tasks."""
    ordered = sorted(spans)
    if any(b > c for (_, b), (c, _) in itertools.pairwise(ordered)):
        return False
    return q.dtype == acc_dtype(q.dtype) or all(runner.grads_in_input_dtype(q, k, t, dv) for t in tasks)


def shift(tasks: tuple[Task, ...], dq: int = 0, dk: int = 0) -> tuple[Task, ...]:
    """The same tasks with query rows moved by ``dq`` and key rows by ``dk``."""
    return tuple(Task(t.q_start + dq, t.q_stop + dq, t.k_start + dk, t.k_stop + dk, t.mask) for t in tasks)


def row_hull(tasks: tuple[Task, ...]) -> Rows:
    """``(first, stop)`` of the query rows the tasks touch, or None when there are no tasks."""
    if not tasks:
        return None
    return min(t.q_start for t in tasks), max(t.q_stop for t in tasks)


def hull(a: Rows, b: Rows) -> Rows:
    if a is None:
        return b
    if b is None:
        return a
    return min(a[0], b[0]), max(a[1], b[1])


def split_own(seg: Segments, rule: Rule, front_first: bool) -> tuple[tuple[Task, ...], tuple[Task, ...]]:
    """The own block (``seg`` against itself) as (early, late) tasks split at local key row L // 2: every query
    against the front keys, and against the back keys (Note [Hiding the tail]).

    ``front_first``: the front keys' part runs early. For zigzag and contiguous causal it holds 3/4 of the block,
    and each part is one top-left causal call (all queries x front keys: the front rows' diagonal above full back
    rows; back rows x back keys: a diagonal), where a split by query rows leaves the back rows a diagonal at an
    offset - two cuDNN calls, as cuDNN aligns its masks top-left (``../shared/reference/KERNELS.md``).
    """
    L = seg.length
    mid = L // 2
    if mid == 0:
        return plan(seg, seg, rule), ()
    front = plan(seg, slice_rows(seg, 0, mid), rule)
    back = shift(plan(seg, slice_rows(seg, mid, L), rule), dk=mid)
    return (front, back) if front_first else (back, front)


def pack_kv(k: torch.Tensor, v: torch.Tensor, *, seq_dim: int = 1) -> torch.Tensor:
    """K and V in ONE buffer, a single message (Note [One KV message]); a copy."""
    if k.shape[-1] == v.shape[-1] and seq_dim == 1:
        return torch.stack((k, v))
    return torch.cat((k, v), -1)


def unpack_kv(kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views of a ``pack_kv`` buffer (or of any buffer of its layout)."""
    if kv.dim() == 5:
        return kv[0], kv[1]
    return kv[..., :head_dim], kv[..., head_dim:]


def seq_major(x_BSHD: torch.Tensor) -> torch.Tensor:
    """A sequence-major COPY ``(S, B, H, D)`` (Note [Sequence-major wire buffers]).

    Always a copy: with B = 1 the transpose is already "contiguous", and a view would let a receive into
    the buffer overwrite the caller's tensor.
    """
    return x_BSHD.transpose(0, 1).clone(memory_format=torch.contiguous_format)


def bshd(x_SBHD: torch.Tensor) -> torch.Tensor:
    """``(S, B, H, D)`` -> ``(B, S, H, D)`` view."""
    return x_SBHD.transpose(0, 1)


def bhs(x_SBH: torch.Tensor) -> torch.Tensor:
    """``(S, B, H)`` -> ``(B, H, S)`` view."""
    return x_SBH.permute(1, 2, 0)


def key_hull(tasks) -> tuple[int, int]:
    """``(first, stop)`` of the key rows the tasks touch."""
    return min(t.k_start for t in tasks), max(t.k_stop for t in tasks)


def home_partial(parts, kdt: torch.dtype, vdt: torch.dtype, wire: torch.dtype, keys: tuple[int, int], exact: bool):
    """One step's dK/dV partial over ``keys`` = ``(a, b)``, the hull of its tasks' keys, as ``((a, b), dk rows, dv
    rows)`` (Note [Partials home] in ``_passkv``): the kernel's own output when one task's output is exact
    (``exact_partial``); else the tasks' outputs summed in one pass (fp32 inside, rows no task covers 0) into
    buffers of the inputs' dtype when exact, else of the wire's."""
    a, b = keys
    if len(parts) == 1 and exact:
        _, (_, gk, gv) = parts[0]
        return (a, b), gk.contiguous(), gv.contiguous()
    bufs = []
    for i, like in ((1, kdt), (2, vdt)):
        x = parts[0][1][i]
        shape = (x.shape[0], b - a, *x.shape[2:])
        buf = torch.empty(shape, dtype=like if exact else wire, device=x.device)
        bufs.append(combine.sum_parts([(slice(t.k_start - a, t.k_stop - a), g[i]) for t, g in parts], shape,
                                      buf.dtype, out=buf))
    return (a, b), *bufs


def backward_parts(runner, rows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, tasks,
                   dq: RowSum) -> list:
    """One step's gradients ``[(task, (dq, dk, dv))]`` over its prepared ``tasks``, each dQ partial held in ``dq``
    (the pass-KV family's backward step, Note [Partials home] in ``_passkv``)."""
    parts = [(t, runner.backward(rows, q, k, v, lse, t)) for t in runner.prepare(tasks, q, k)]
    for t, (gq, _, _) in parts:
        dq.add(t.q, gq, t.covered)
    return parts


def hold_own(parts: list, dk: RowSum, dv: RowSum) -> None:
    """A step's dK/dV partials of a block this rank sums itself, held in ``dk`` and ``dv``."""
    for t, (_, gk, gv) in parts:
        dk.add(t.k, gk)
        dv.add(t.k, gv)


def swap_partial(ex, partial, to: int, theirs, frm: int, k: torch.Tensor, v: torch.Tensor, wire: torch.dtype):
    """Queue a step's dK/dV partial (``home_partial``'s form, or None) to rank ``to`` on exchange ``ex``, and the
    receipt of this rank's own from ``frm``: ``theirs`` is its ``((a, b), exact)`` - the rows and dtype both ends
    plan from the sender's tasks - or None (nothing comes). Returns the receipt's form or None."""
    if partial is not None:
        _, pk, pv = partial
        ex.send(pk, to).send(pv, to)
    got = receipt(theirs, k, v, wire)
    if got is None:
        return None
    rows, specs = got
    bufs = [torch.empty(shape, dtype=dtype, device=k.device) for shape, dtype in specs]
    for x in bufs:
        ex.recv(x, frm)
    return rows, *bufs


def receipt(theirs, k: torch.Tensor, v: torch.Tensor, wire: torch.dtype):
    """What comes home for ``theirs`` (``((a, b), exact)`` or None): ``((a, b), [(shape, dtype)] for dK and dV)`` -
    the key rows ``a:b`` of the block, in the inputs' dtype when exact, else the wire's - or None."""
    if theirs is None:
        return None
    (a, b), exact = theirs
    return (a, b), [((x.shape[0], b - a, *x.shape[2:]), x.dtype if exact else wire) for x in (k, v)]


def land_home(got: list, dk: RowSum, dv: RowSum) -> None:
    """Hold what came home (``got[0]``: ``((a, b), dk rows, dv rows)`` or None): summed once, with the own block's
    partials, at the end (Note [Partials home] in ``_passkv``)."""
    if got[0] is not None:
        (a, b), bk, bv = got[0]
        dk.add(slice(a, b), bk)
        dv.add(slice(a, b), bv)
        got[0] = None
