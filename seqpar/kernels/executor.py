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

Note [Split bands as tasks]
    A block of full keys and a top-left causal rest (a band with ``lo`` unbounded and ``hi`` > 0: a query chunk
    against every earlier key in all-gather's buffer, pass-Q's back chunk against the whole own block) runs on
    cuDNN, the efficient kernel and CPU flash as two calls (``Kernel.splits_bands``, ``sdpa.causal_parts``).
    Inside the kernel the two partials became one fp32 block result (Note [Split bands in one pass] in
    ``seqpar.kernels.sdpa``) that the schedule's merge read again, and the backward concatenated the two calls'
    dK/dV (a copy) before the schedule added them. ``prepare`` now hands such a kernel the two blocks as tasks of
    their own, so their partials go straight to the call's one merge (Note [One merge per call] in
    ``seqpar.kernels.combine``) and their gradients straight to its sums. The kernel's own split stays for callers
    that run a kernel on a band directly.

Note [Bands on flex]
    PyTorch's FA2 is an Ampere kernel. On an H100 its sliding-window (band) forward took 3.34 ms of seqpar's
    3.62 ms sink window (16K tokens, window 4095 + 4 sinks, GQA 32/8, D 128, bf16), where compiled flex ran the
    whole mask - band and sink columns - in 2.61 ms (forward+backward 11.2 ms against seqpar's 14.2 ms;
    ``benchmarks/results/2026-11-25-h100-hardening``, run2). So, with no FlashAttention-3 to ask:
    1. Flex ranks above both FA2s for a wide windowed band - mask kind "band" (``lo`` and ``hi`` bounded; a band
       open to the right, kind "open", goes to cuDNN read backwards: Note [Open bands backwards]) with at least
       ``WIDE_ROWS`` query rows (``KernelCall.wide``) - on ``BAND_ARCHS`` (sm90) when the block belongs to a
       training call with fixed shapes (``KernelCall.training``: a planned call a backward follows, and not
       ``shapes_vary``) or to a call without a backward (5.). Flex compiles once per block shape for training
       (Note [Flex recompiles]: seconds, and at most ``RECOMPILES`` variants): a training run pays it once, its
       signature recurring step after step. Packed documents in training, deterministic calls and other GPUs
       keep FA2. A plain ``window_size=`` call is the same band and moves too. Full and causal blocks stay on
       cuDNN, faster than flex (1.77 against 2.82 ms for two 8K causal chunks). The choice is the declaration's,
       logged like every other (``seqpar.kernels``, INFO).
    2. Only wide bands: flex wins on a band's cells and loses on its call. On one H200
       (``benchmarks/results/2026-11-25-h200-masks``: W = 1, GQA 32/8, D 128, bf16; seqpar over flex called
       directly, training forward / forward+backward) the wide bands won: the sink window 1.04 / 1.06 at 16K and
       1.02 / 1.06 at 128K (FA2: 1.27 forward+backward, on the H100), ``window_size=(4095, 0)`` 1.07 / 1.04 and
       1.05 / 1.03, its forward+backward 9.99 and 85.27 ms against FA2's 11.82 and 101.79 ms - 0.11 to 0.13 us
       saved per row of a 4095-key band. The narrow ones lost: spans' 16 images of 256 tokens (bands of 255 rows)
       went from 0.81 to 0.92 of flex's forward+backward and block_causal's 32 frames (511 rows) from 0.91 to 0.96
       (H100 before, H200 now: ratios to flex on the same card), about 2.2 and 1.0 ms of the H200's 20.3 and 20.0
       ms, for one joined flex call - a compiled call's host dispatch, and a backward that recomputes its forward
       (the engine path; both wins above ran the direct path, 4.) - in place of one FA2 varlen call.
       ``WIDE_ROWS`` is 4096, between the 511 rows that lost and the 16380 that won: ``GROUP_ROWS``, the size
       from which a block is no longer launch-bound and keeps its own call, so a narrow band gets back the plan
       it had, packed with its siblings into one FA2 varlen call; and below it flex saves under 0.5 ms on a
       4095-key band (0.11 us a row), less than the narrow bands' call cost. It is the least size that could win,
       not a measured break-even: bands of 4K to 16K rows (block_causal's frames at 128K have 4095) are the
       bench's next rows. ``wide`` is one coarse bit, not the size: selection is cached per ``KernelCall``, where
       a size would make an entry per block shape.
    3. When flex serves a step's wide band, the runner joins the step's blocks into one flex call (a ``Joined``
       mask over their bounding box, ``_join``): every band flex serves, plus every full or causal block and
       every narrow band thin enough that a call of its own costs more than flex computing it. Apart, a block
       costs a launch and a merge of its rows (~5 ns per row: the H100 profile's merge of the sink columns took
       82 us for 16K rows); joined, flex spends ~16 ps per (row, key) cell more than cuDNN ((2.82 - 1.77) ms over
       67M cells above), so blocks of at most ``JOIN_KEYS`` keys per row (5 ns / 16 ps), or of at most
       ``JOIN_PAIRS`` cells (a launch's ~15 us), join. The sink window is then one flex call with the tiles of
       flex's own block mask for it; windowed spans' images join their window's call; a thick block (a 4K
       prompt seen whole) keeps cuDNN and merges. A step without a wide band on flex is not joined: spans'
       images and block_causal's frames run as before, one FA2 varlen call beside the causal block on cuDNN.
       These are estimates from two profiles; the bench's table is the check.
    4. A joined block covering the whole call is the direct path (flex's own autograd op, Note [Direct calls]).
    5. Calls without a backward move too, on ``FlexKernel.for_call``'s variant (Note [Flex recompiles] in
       ``seqpar.kernels.flex``): nothing a runner sees tells a no-grad call whose signature recurs (evaluation)
       from serving's prefill, which meets every prompt length (the cache fills through ``seqpar.attention``,
       ``seqpar.inference.attend._fill``, like any caller). Its first ``STATIC_SHAPES`` shapes compile per shape,
       later ones run flex compiled once for every shape, so a server compiles a bounded number of times (eleven
       prompt lengths: eight per-shape compiles, then one for every shape) and never meets ``RECOMPILES``. The
       no-grad forward went from 1.33-1.44x of flex called directly (FA2) to 0.96-1.04x at 16K and 1.00-1.02x at
       128K (H100, ``benchmarks/results/2026-11-26-h100-flex-dynamic/run2-adaptive``). Blocks
       whose shapes come from the batch take the same variant wherever flex serves them (a mask_mod's blocks
       under packed documents); their wide bands in training calls still keep FA2 (unmeasured there).
    ``benchmarks/gpu/masks_1gpu.py`` measures it (the w1 section: every named mask, and ``window_size=`` on auto
    against the same call on FA2, against flex called directly); ``BAND_ARCHS`` and ``WIDE_ROWS`` are the places
    to change if a GPU says otherwise. Measured since at the threshold (``benchmarks/gpu/probe_wide_rows.py``,
    ``benchmarks/results/2026-11-26-h100-wide-rows``, H100): the sink window's rank at 16K tokens per rank holds a
    4095-row band against its neighbour's keys; with ``WIDE_ROWS`` at 2048 that band ran on flex and the rank's
    forward went 3.84 -> 3.64 ms but its forward+backward 18.2 -> 22.6 ms (a band apart from its step's other
    blocks is a flex call of its own, whose backward recomputes its forward), so 4096 stays.

Note [Short steps join]
    At 2K tokens per rank the sink window's all-gather ran its rank's band on FA2, below ``WIDE_ROWS``: one
    emulated rank of 8 at 16K (rank 3, contiguous, one H200, calls back to back;
    ``benchmarks/results/2026-11-28-h200-thirtieth/``) spent 518 us in FA2's windowed kernel and 251 us in cuDNN
    for what flex at W = 1 computes in 346 us per 2K rows. With the band counted wide the step joined - band,
    local causal block, sink columns - into one flex call of 341 us: the forward went 0.630 -> 0.433 ms and
    forward+backward 2.395 -> 2.001 ms; on zigzag (1K-row chunks, the line at 1024) 0.530 -> 0.430 and 2.074 ->
    1.809. The same change at 16K tokens per rank lost: the ring's rank 1 joined its 4095-row neighbour band with
    the sink columns of all its 16K rows, and forward+backward went 12.04 -> 14.13 ms (flex's backward runs a key
    tile's dK/dV down every query row of the box: the sink tile's 128 query tiles one after another), where
    apart the band's backward is FA2's and the sinks' cuDNN's. A band alone in its step (the ring's at 2K)
    gained nothing (0.507 -> 0.497 ms forward, 1.848 -> 1.859 forward+backward).
    So a band is wide (``_wide``) with ``WIDE_ROWS`` rows of its own, or with ``JOIN_ROWS`` (1024) rows in a step
    spanning at most ``WIDE_ROWS`` query rows - where a joined call replaces several launch-bound calls and their
    merge and no key tile's backward runs down a long box; ``_apart`` asks the same of a joined call's own rows,
    so its backward stays joined. A band without a block to join keeps its kernel by its own rows (``_join``
    joins two or more). Spans' images (255 rows) and block_causal's frames (511) stay under ``JOIN_ROWS``: they
    lost on flex (Note [Bands on flex], 2.) before flex's backward ran from the final rows, unmeasured since.

Note [Band backward on few KV heads]
    Flex's backward of a grouped-query band loses where the KV heads are few: Ulysses hands each rank H / U query
    heads and Hkv / U KV heads, 4 / 1 for GQA 32/8 over 8. The sink window (4095 + 4 sinks) at W = 1 on one H100,
    forward+backward in ms, flex's own op -> flex forward with the backward on FA2
    (``benchmarks/gpu/probe_band_backward.py``, ``benchmarks/results/2026-11-27-h100-twenty-first/band-backward``):
    at 128K, 4/1 30.6 -> 18.6 (FA2 both ways 24.0), 8/2 40.5 -> 31.8, 16/4 62.7 -> 57.9, 32/8 107.0 -> 111.9; at
    16K, 4/1 4.03 -> 3.47, 8/2 4.97 -> 4.79, 16/4 7.51 -> 7.20, 32/8 12.3 -> 13.3; MHA keeps flex ahead (128K, 4/4
    15.1 -> 19.5, 16/16 47.7 -> 61.1). Flex's forward stays ahead of FA2's everywhere (3.3 against 4.5 ms at 4/1).
    So a wide band's backward has a kernel of its own: ``KernelCall.backward`` marks the backward's choice, and
    flex declines a grouped-query band's backward with at most ``BAND_BWD_KV_HEADS`` (4) KV heads
    (``FlexKernel.rank``), which goes to FA2. Forward and backward are independent calls already (a block's
    backward reads the final out and lse, whichever kernel made them), so:
    1. a plain wide band runs its forward on flex and its backward on FA2;
    2. a joined step (Note [Bands on flex]) runs its forward as one flex call and its backward apart
       (``_apart``): each block it joined on its own backward kernel (the band on FA2, the sink columns on
       cuDNN), their gradients summed into the joined block's rows and keys in the accumulation dtype
       (``grads_in_input_dtype`` says so, for the pass-KV family's exact partials);
    3. a training call whose backward would leave its forward's kernel takes no direct path (flex's own op
       differentiates with flex).
    Under Ulysses at 128K, emulated (rank 0, fake group, the pool seeded), the sink window's forward+backward went
    from 0.37 to 0.69 of the one-GPU call's share over 8 and from 0.52 to 0.82 over 4. The training forward runs the
    same calls both ways (Ulysses over several ranks has no direct path): 0.78 and 0.73 over 8, 0.88 and 0.89 over
    4, one run each. Causal, in the same run: 1.09-1.11 / 1.00-1.02 over 8, 1.12 / 1.04-1.05 over 4.

Note [Long causal calls in halves]
    Ulysses runs one causal call of H / U heads over the whole sequence. At 128K tokens cuDNN's causal forward is
    not at its best as one call: as three - rows [0, h) against keys [0, h) causal, rows [h, S) against keys
    [0, h) full, rows [h, S) against keys [h, S) causal, h = S / 2 - with the full block (half the work) on the
    current stream and the two causal halves launched first beside it (Note [Calls side by side] in
    ``seqpar.kernels.side``), each stream fills the other's idle end, and the full block runs without a mask.
    One H100, bf16, D 128, the merge included (``benchmarks/gpu/probe_causal_split.py``,
    ``benchmarks/results/2026-11-27-h100-twentieth/halves``): at 128K the forward gained 6.2% with 4 / 1 heads,
    2.8% with 8 / 2, 5.9% with 16 / 4 and 7.4% with 32 / 8; at 64K -3% to +1.4% and at 32K -5% to +3%. The
    backward cut the same way (the back rows' dQ and the front keys' dK/dV summed in fp32) moved -1.3% to +2.8% at
    128K and nothing shorter, so it stays one call, exact from the final rows. Hence a square causal block of
    ``HALVES_ROWS`` rows or more whose kernel is cuDNN runs its forward in halves (``TaskRunner.forward_each``):
    Ulysses' forward at 128K, emulated W = 8 and 4, went from 0.89-0.96 to 0.98-1.05 of the one-GPU call's share.
    The three partials hold 1.5x the block's output until the call's one merge (Note [One merge per call]).

Note [Equal blocks as a batch]
    Llama 4's chunks make Ulysses' whole-sequence call a row of equal causal blocks on the diagonal: two of 8K at 16K
    tokens, sixteen at 128K, each on H / U heads - 4 / 1 over 8 for GQA 32/8, so one 8K causal call fills 256 of an
    H200's tiles, under two waves. They ran one cuDNN call each (blocks of ``GROUP_ROWS`` rows or more stay out of
    varlen packing, and cuDNN has no varlen from Python), and at 2K tokens per rank over 8 (emulated, one H200,
    ``benchmarks/results/2026-11-28-h200-thirtieth/4-short-steps``) Ulysses' forward+backward under the chunks held
    the GPU 1.45 ms against 1.77 ms for causal, which has twice the pairs. The blocks are independent and equal, so
    they are one call with the blocks as its batch: rows ``a + i n`` to ``a + (i + 1) n`` of ``(1, c n, h, d)`` are
    the view ``(c, n, h, d)`` (a copy only for a batch of several sequences over part of their rows), the output
    comes back as a view, and the lse ``(c, h, n)`` is one small copy into ``(1, h, c n)`` (the backward's lse and
    Delta the other way). ``stacked`` finds the runs - two or more full or top-left causal blocks of the same shape,
    each one's rows and keys starting where the last one's stop - after ``prepare`` (documents already packed into
    varlen calls keep them), and the runner serves a ``Stacked`` task with the kernel its block would get alone
    (``_kernel``), forward (``forward_each``) and backward (``backward_all``): Ulysses', USP's inner call and the
    ring's own step at one rank. Equal packed documents (fixed-length samples) and bidirectional chunks take it
    too. The other schedules call ``prepare`` and keep one call per block. Not measured yet:
    ``benchmarks/gpu/stacked_blocks.sh`` times it against one call per block in one process (the session that wrote
    it had no device time left).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ..errors import UnsupportedInputError
from ..layouts.blocks import Task, group_varlen
from ..masks.forms import Band, Joined, Modded, Stacked, Varlen
from ..numerics import GradRows, acc_dtype
from ..types import AttnOutput
from . import combine
from .base import Kernel, KernelCall, device_arch, mask_kind, select
from .side import beside_largest

__all__ = ["GROUP_AT", "GROUP_ROWS", "HALVES_ROWS", "JOIN_KEYS", "JOIN_PAIRS", "JOIN_ROWS", "MEMO_SIZE",
           "VARLEN_BWD_ROWS", "WIDE_ROWS", "TaskRunner", "halves", "row_groups", "stacked"]

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
JOIN_KEYS = 320
"""Keys per query row up to which a full or causal block joins its step's flex call (Note [Bands on flex])."""
JOIN_PAIRS = 1 << 20
"""Cells (rows x keys) up to which a block joins its step's flex call whatever its width: a launch's worth."""
WIDE_ROWS = 4096
"""Query rows from which a block is wide (``KernelCall.wide``): a windowed band that wide runs on flex in an sm90
training call, a narrower one keeps FA2 (Note [Bands on flex]: bands of 255 and 511 rows lost on flex, of 16380
and more won; ``GROUP_ROWS``, from which a block keeps its own call)."""
JOIN_ROWS = 1024
"""Query rows from which a band in a short step (``WIDE_ROWS`` rows or fewer in all) anchors a joined flex call
(Note [Short steps join])."""
HALVES_ROWS = 1 << 17
"""Rows from which a square causal block on cuDNN runs its forward as three calls on two streams (Note [Long causal
calls in halves]: 128K gained 3-7%, 64K nothing)."""

Sig = tuple[int, int, int, torch.dtype, torch.device]
"""What a kernel choice depends on besides the block: (heads, KV heads, head dim, dtype, device)."""


def _sig(q: torch.Tensor, k: torch.Tensor) -> Sig:
    return q.shape[2], k.shape[2], q.shape[-1], q.dtype, q.device


def _is_band(t: Task) -> bool:
    """A windowed band (mask kind "band", or "open" when ``hi`` is unbounded), the block a joining kernel may be
    preferred for."""
    return isinstance(t.mask, Band) and t.mask.lo is not None


def _wide(t: Task, rows: int) -> bool:
    """Whether band ``t`` is wide in a step - or a joined call - spanning ``rows`` query rows: ``WIDE_ROWS`` rows of
    its own, or ``JOIN_ROWS`` in a short step (Note [Short steps join])."""
    return t.rows >= WIDE_ROWS or (rows <= WIDE_ROWS and t.rows >= JOIN_ROWS)


def split_band(t: Task) -> bool:
    """Whether ``t`` is full keys and a top-left causal rest, which some kernels serve as two calls (Note [Split
    bands as tasks])."""
    m = t.mask
    return type(m) is Band and m.lo is None and m.hi is not None and 0 < m.hi < t.cols


def halves(t: Task) -> tuple[Task, ...]:
    """A square causal block as its front rows causal, its back rows against the front keys (full) and its back rows
    causal (Note [Long causal calls in halves]); any other block as itself."""
    m = t.mask
    if type(m) is not Band or m.lo is not None or m.hi != 0 or t.rows != t.cols or t.rows < 2:
        return (t,)
    q, k, h = t.q_start, t.k_start, t.rows // 2
    return (Task(q, q + h, k, k + h, m), Task(q + h, t.q_stop, k, k + h, Band()),
            Task(q + h, t.q_stop, k + h, t.k_stop, m))


def _stackable(t: Task) -> bool:
    """A full or top-left causal block of two rows or more: what ``stacked`` may batch."""
    return type(t.mask) is Band and t.mask.lo is None and t.mask.hi in (None, 0) and t.rows >= 2


def stacked(tasks: tuple[Task, ...]) -> tuple[Task, ...]:
    """``tasks`` with every run of two or more equal blocks one after another on a diagonal (the same full or causal
    band and shape, each block's rows and keys starting where the previous one's stop) as one ``Stacked`` task
    (Note [Equal blocks as a batch]); ``tasks`` itself when no run has two."""
    out: list[Task] = []
    run: list[Task] = []

    def flush() -> None:
        if len(run) > 1:
            a, b = run[0], run[-1]
            out.append(Task(a.q_start, b.q_stop, a.k_start, b.k_stop, Stacked(len(run), a.mask)))
        else:
            out.extend(run)
        run.clear()

    for t in sorted(tasks, key=lambda t: (t.q_start, t.k_start)):
        if not _stackable(t):
            flush()
            out.append(t)
            continue
        last = run[-1] if run else None
        if last is not None and not (t.mask == last.mask and (t.rows, t.cols) == (last.rows, last.cols)
                                     and t.q_start == last.q_stop and t.k_start == last.k_stop):
            flush()
        run.append(t)
    flush()
    return tuple(out) if len(out) < len(tasks) else tasks


def _batch(x: torch.Tensor, rows: slice, count: int) -> torch.Tensor:
    """Rows ``rows`` of ``x (B, L, h, d)`` as ``(B * count, L' / count, h, d)``: a view where the strides allow it
    (one batch, or every row), else a copy."""
    xs = x[:, rows]
    return xs.reshape(xs.shape[0] * count, xs.shape[1] // count, *xs.shape[2:])


def _unbatch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``_batch``'s inverse on a result ``(B * count, n, h, d) -> (B, count * n, h, d)``."""
    return x.reshape(batch, -1, *x.shape[2:])


def _lse_batch(lse: torch.Tensor, count: int) -> torch.Tensor:
    """Row statistics ``(B, h, count * n) -> (B * count, h, n)`` (a copy: the rows move next to the batch)."""
    B, h, L = lse.shape
    return lse.reshape(B, h, count, L // count).transpose(1, 2).reshape(B * count, h, L // count)


def _lse_unbatch(lse: torch.Tensor, batch: int) -> torch.Tensor:
    """``_lse_batch``'s inverse: ``(B * count, h, n) -> (B, h, count * n)``."""
    Bc, h, n = lse.shape
    return lse.reshape(batch, Bc // batch, h, n).transpose(1, 2).reshape(batch, h, -1)


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
                 shapes_vary: bool = False, training: bool = False):
        self.kernel, self.scale, self.softcap = kernel, scale, float(softcap)
        self.deterministic = deterministic
        self.shapes_vary = shapes_vary
        self.training = training
        self._chosen: dict[tuple, Kernel] = {}
        self._memo: OrderedDict[tuple, Any] = OrderedDict()

    @classmethod
    def of(cls, call: Any) -> TaskRunner:
        """The runner of a planned call (``methods.base.Call``): its kernel, scale and options; its blocks' shapes
        vary batch to batch when it has several documents or a valid length short of the global one
        (``Call.shapes_vary``, Note [Plans per shape]); one document over the whole sequence (a balanced layout's
        ``(0, S)``) keeps fixed shapes. A call a backward follows is a training step (Note [Bands on flex])."""
        cfg = call.cfg
        return cls(cfg.kernel, call.scale, deterministic=cfg.deterministic, softcap=cfg.softcap,
                   shapes_vary=call.shapes_vary, training=bool(getattr(call, "grad", False)))

    def _memoized(self, key: tuple, make) -> Any:
        """``make()``, computed once per ``key`` for this runner (Note [Runner memos])."""
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = make()
            if len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        return hit

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, task: Task, dv: int | None = None, *,
                   backward: bool = False) -> Kernel:
        """The kernel for this kind of block (``dv``: the value head dim, default q's), of its forward or its
        ``backward``."""
        return self._kernel(task, _sig(q, k), dv, backward=backward)

    def _kernel(self, task: Task, sig: Sig, dv: int | None = None, *, wide: bool | None = None,
                backward: bool = False) -> Kernel:
        """The kernel of ``task``'s kind of block; ``wide`` (default: from its rows, ``WIDE_ROWS``) overrides the
        block's size class (``takes_delta`` asks for both); ``backward``: the kernel of its backward pass."""
        if isinstance(task.mask, Stacked):          # one call of its band's kernel on a block's shape
            c = task.mask.count
            task = Task(0, task.rows // c, 0, task.cols // c, task.mask.band)
        single = task.rows == 1 and task.cols == 1
        wide = task.rows >= WIDE_ROWS if wide is None else wide
        kind = mask_kind(task.mask)
        heads, kv_heads, head_dim, dtype, device = sig
        key = (kind, single, wide, backward, heads, kv_heads, head_dim, dv, dtype, device.type)
        kern = self._chosen.get(key)
        if kern is None:
            call = KernelCall(device.type, dtype, head_dim, heads, kv_heads, kind, self.deterministic, single,
                              0 if dv is None or dv == head_dim else dv, self.softcap > 0, self.shapes_vary,
                              device_arch(device), self.training, wide, backward)
            kern = self._chosen[key] = select(self.kernel, call)
        return kern

    def _apart(self, task: Task, sig: Sig, dv: int | None) -> tuple[Task, ...] | None:
        """The blocks a ``Joined`` task's backward runs as, each on its own backward kernel, when a band it joined
        is not on a joining kernel in the backward (Note [Band backward on few KV heads]); else None."""
        m = task.mask
        if not isinstance(m, Joined):
            return None

        def members() -> tuple[Task, ...] | None:
            parts = tuple(Task(task.q_start + q0, task.q_start + q1, task.k_start + k0, task.k_start + k1, band)
                          for q0, q1, k0, k1, band in m.parts)
            bands = [t for t in parts if _is_band(t)]
            if all(self._kernel(t, sig, dv, wide=_wide(t, task.rows), backward=True).joins for t in bands):
                return None
            return parts
        return self._memoized(("apart", task, sig, dv), members)

    def _calls(self, tasks: tuple[Task, ...], q: torch.Tensor, k: torch.Tensor) -> tuple[Task, ...]:
        """``prepare(tasks)`` with its equal blocks in a row as one call each (``stacked``: Note [Equal blocks as a
        batch]), once per task tuple and kind of tensors - one memo lookup a call, as ``prepare``'s own."""
        if len(tasks) < 2:
            return self.prepare(tasks, q, k)
        return self._memoized(("calls", tasks, _sig(q, k)), lambda: stacked(self.prepare(tasks, q, k)))

    def grads_in_input_dtype(self, q: torch.Tensor, k: torch.Tensor, task: Task, dv: int | None = None) -> bool:
        """Whether ``backward`` returns ``task``'s gradients in the inputs' dtype (``Kernel.grads_in_input_dtype``);
        a joined block run apart sums its blocks in the accumulation dtype."""
        if self._apart(task, _sig(q, k), dv) is not None:
            return False
        return self.kernel_for(q, k, task, dv, backward=True).grads_in_input_dtype

    def kernels(self, tasks: tuple[Task, ...], q_shape, k_shape, dtype: torch.dtype, device: torch.device
                ) -> tuple[tuple[Task, str], ...]:
        """The blocks one step of ``tasks`` runs as (``prepare``) and the kernel of each, for shapes ``(B, L, H, D)``
        and ``(B, L, Hkv, D)``: what ``auto`` chose, without tensors (tests, debugging)."""
        sig: Sig = (q_shape[2], k_shape[2], q_shape[-1], dtype, torch.device(device))
        return tuple((t, self._kernel(t, sig).name) for t in self._prepare(tasks, sig))

    def direct(self, tasks: tuple[Task, ...], q_shape, k_shape, v_shape, dtype: torch.dtype, device: torch.device):
        """``f(q, k, v) -> out`` for a call that is one whole block served by a kernel with a differentiable
        aten op (Note [Direct calls] in ``seqpar.kernels.base``), else None. A step whose blocks join into one
        (Note [Bands on flex]) is one block."""
        sig: Sig = (q_shape[2], k_shape[2], q_shape[-1], dtype, device)
        if len(tasks) > 1 and any(_is_band(t) for t in tasks):
            tasks = self._memoized(("joined", tasks, sig), lambda: self._join(tasks, sig))
        if len(tasks) != 1:
            return None
        t = tasks[0]
        if (t.q_start, t.q_stop, t.k_start, t.k_stop) != (0, q_shape[1], 0, k_shape[1]):
            return None
        dv = v_shape[-1]
        try:
            kern = self._kernel(t, sig, dv)
        except UnsupportedInputError:
            return None
        if not kern.direct(t.mask) or (dv != q_shape[-1] and kern.name not in ("cudnn", "flex")):
            return None
        if self.training and (self._kernel(t, sig, dv, backward=True).name != kern.name
                              or self._apart(t, sig, dv) is not None):
            return None                 # the backward runs elsewhere (Note [Band backward on few KV heads])
        if self.softcap and not kern.direct_softcap:
            return None
        if self.training and kern.trains_on_engine(t.mask, q_shape[1], device_arch(device), self.softcap):
            return None                 # Note [Flex on TMA]: its forward on TMA, its backward from the final rows
        mask, scale, cap = t.mask, self.scale, self.softcap
        if cap:
            return lambda q, k, v: kern.autograd_forward(q, k, v, mask, scale, cap)
        return lambda q, k, v: kern.autograd_forward(q, k, v, mask, scale)

    def prepare(self, tasks: tuple[Task, ...], q: torch.Tensor, k: torch.Tensor) -> tuple[Task, ...]:
        """A step's blocks as the calls that run them: joined into one flex call where flex serves its bands (Note
        [Bands on flex]); many small per-document tasks packed into varlen calls where a kernel serves varlen
        (tasks of ``GROUP_ROWS`` rows or more keep their own call, unless their shapes vary batch to batch: Note
        [Plans per shape]). Decided once per task tuple and kind of tensors."""
        if (len(tasks) < GROUP_AT and (len(tasks) < 2 or not any(_is_band(t) for t in tasks))
                and not any(split_band(t) for t in tasks)):
            return tasks
        return self._prepare(tasks, _sig(q, k))

    def _prepare(self, tasks: tuple[Task, ...], sig: Sig) -> tuple[Task, ...]:
        return self._memoized(("prepared", tasks, sig), lambda: self._prepared(tasks, sig))

    def _prepared(self, tasks: tuple[Task, ...], sig: Sig) -> tuple[Task, ...]:
        joined = self._join(tasks, sig)
        if joined is tasks:
            return self._split(self._packed(tasks, sig), sig)
        return joined[:1] + self._split(self._packed(joined[1:], sig), sig)

    def _split(self, tasks: tuple[Task, ...], sig: Sig) -> tuple[Task, ...]:
        """``tasks`` with each band its kernel serves as two calls replaced by those two blocks (Note [Split bands
        as tasks])."""
        out: list[Task] = []
        for t in tasks:
            try:
                two = split_band(t) and self._kernel(t, sig).splits_bands
            except UnsupportedInputError:
                two = False                     # the task's own call raises, by name
            if not two:
                out.append(t)
                continue
            cut = t.k_start + t.mask.hi
            out += [Task(t.q_start, t.q_stop, t.k_start, cut, Band()), Task(t.q_start, t.q_stop, cut, t.k_stop,
                                                                            Band(None, 0))]
        return tuple(out) if len(out) > len(tasks) else tasks

    def _join(self, tasks: tuple[Task, ...], sig: Sig) -> tuple[Task, ...]:
        """``tasks`` with the bands a joining kernel serves and the thin blocks (full, causal or a narrow band) as
        one ``Joined`` task first (Note [Bands on flex]), or ``tasks`` itself: a step none of whose bands is on a
        joining kernel (narrow bands, no-grad calls) is not joined."""
        rows = max(t.q_stop for t in tasks) - min(t.q_start for t in tasks)
        try:
            anchors = [t for t in tasks if _is_band(t) and self._kernel(t, sig, wide=_wide(t, rows)).joins]
        except UnsupportedInputError:
            return tasks
        if not anchors:
            return tasks
        members = [t for t in tasks if t in anchors or (isinstance(t.mask, Band)
                                                        and (t.cols <= JOIN_KEYS or t.rows * t.cols <= JOIN_PAIRS))]
        if len(members) < 2:
            return tasks
        q0, q1 = min(t.q_start for t in members), max(t.q_stop for t in members)
        k0, k1 = min(t.k_start for t in members), max(t.k_stop for t in members)
        joined = Task(q0, q1, k0, k1, Joined(tuple((t.q_start - q0, t.q_stop - q0, t.k_start - k0, t.k_stop - k0,
                                                    t.mask) for t in members)))
        try:
            if not self._kernel(joined, sig).joins:
                return tasks
        except UnsupportedInputError:
            return tasks
        return (joined, *(t for t in tasks if t not in members))

    def _packed(self, tasks: tuple[Task, ...], sig: Sig) -> tuple[Task, ...]:
        if len(tasks) < GROUP_AT:
            return tasks
        most = float("inf") if self.shapes_vary else GROUP_ROWS
        big = tuple(t for t in tasks if t.rows >= most)
        small = tuple(t for t in tasks if t.rows < most)
        if len(small) < GROUP_AT:
            return tasks
        grouped = group_varlen(small) + big
        try:
            chosen = {self._kernel(t, sig).name for t in grouped if isinstance(t.mask, Varlen)}
            alone = {self._kernel(t, sig).name for t in tasks if isinstance(t.mask, Band)}
        except UnsupportedInputError:
            return tasks
        if "reference" in chosen and alone - {"reference"}:
            return tasks        # the reference kernel for varlen (CPU auto): one cpu_flash call per block is faster
        return grouped

    def takes_delta(self, q: torch.Tensor, k: torch.Tensor, kinds: frozenset[str], dv: int | None = None) -> bool:
        """Whether the kernels of every mask kind in ``kinds``, narrow and wide blocks alike (a band's kernel
        depends on its rows: Note [Bands on flex]), take a precomputed Delta (pass-Q's bundle). A joined step whose
        wide band's backward does not join runs its blocks apart (Note [Band backward on few KV heads]): no."""
        probe = {"full": (1, 1, None, None), "causal": (2, 2, None, 0), "band": (2, 2, 0, 0), "open": (2, 2, 0, None)}
        band = Task(0, 2, 0, 2, Band(0, 0))
        if "joined" in kinds and not self._kernel(band, _sig(q, k), dv, wide=True, backward=True).joins:
            return False
        for kind in sorted(kinds):
            if kind == "varlen":
                task = Task(0, 2, 0, 2, Varlen((0, 2), (0, 2)))
            elif kind == "mod":
                task = Task(0, 2, 0, 2, Modded(Band(), _all_visible, ((0, 2),), ((0, 2),)))
            elif kind == "joined":
                task = Task(0, 2, 0, 2, Joined(((0, 2, 0, 2, Band()),)))
            else:
                m, n, lo, hi = probe[kind]
                task = Task(0, m, 0, n, Band(lo, hi))
            if not all(self._kernel(task, _sig(q, k), dv, wide=w, backward=True).takes_delta for w in (False, True)):
                return False
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, task: Task) -> AttnOutput:
        if isinstance(task.mask, Stacked):
            return self._forward_stacked(q, k, v, task)
        qs = q if task.q_start == 0 and task.q_stop == q.shape[1] else q[:, task.q]   # no view when whole
        ks, vs = (k, v) if task.k_start == 0 and task.k_stop == k.shape[1] else (k[:, task.k], v[:, task.k])
        return self.kernel_for(qs, ks, task, v.shape[-1]).forward(qs, ks, vs, task.mask, self.scale,
                                                                   softcap=self.softcap)

    def _forward_stacked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, task: Task) -> AttnOutput:
        """A ``Stacked`` task as one call of its band's kernel, its blocks as the batch (Note [Equal blocks as a
        batch])."""
        c, B = task.mask.count, q.shape[0]
        qs, ks, vs = _batch(q, task.q, c), _batch(k, task.k, c), _batch(v, task.k, c)
        res = self.kernel_for(qs, ks, task, v.shape[-1]).forward(qs, ks, vs, task.mask.band, self.scale,
                                                                  softcap=self.softcap)
        return AttnOutput(_unbatch(res.out, B), _lse_unbatch(res.lse, B))

    def _backward_stacked(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          lse: torch.Tensor, task: Task) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients of ``_forward_stacked``'s call, from the final rows."""
        c, B, sq = task.mask.count, q.shape[0], task.q
        qs, ks, vs = _batch(q, sq, c), _batch(k, task.k, c), _batch(v, task.k, c)
        kern = self.kernel_for(qs, ks, task, v.shape[-1], backward=True)
        if kern.takes_delta:
            do, out, delta = _batch(rows.do, sq, c), None, _lse_batch(rows.delta[:, :, sq], c)
        else:
            do_f, out_f = rows.folded
            do, out, delta = _batch(do_f, sq, c), _batch(out_f, sq, c), None
        g = kern.backward(do, qs, ks, vs, out, _lse_batch(lse[:, :, sq], c), task.mask.band, self.scale,
                          delta=delta, softcap=self.softcap, deterministic=self.deterministic)
        return tuple(_unbatch(x, B) for x in g)

    def forward_each(self, tasks: tuple[Task, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                     ) -> list[tuple[Task, AttnOutput]]:
        """Every call of ``tasks`` (``prepare``; equal blocks in a row as one batched call: Note [Equal blocks as a
        batch]) with its partial; a lone square causal block of ``HALVES_ROWS`` rows or more on cuDNN runs as three
        calls on two streams (Note [Long causal calls in halves])."""
        tasks = self._calls(tasks, q, k)
        if len(tasks) == 1 and q.device.type == "cuda" and tasks[0].rows >= HALVES_ROWS:
            t = tasks[0]
            cut = self._memoized(("halves", t), lambda: halves(t))
            if len(cut) > 1 and self.kernel_for(q, k, t, v.shape[-1]).name == "cudnn":
                return list(zip(cut, beside_largest(cut, lambda c: self.forward(q, k, v, c), q.device)))
        return [(t, self.forward(q, k, v, t)) for t in tasks]

    def backward(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                 task: Task) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One task's (dq, dk, dv) from the final rows ``rows`` (full local rows; sliced here)."""
        if isinstance(task.mask, Stacked):
            return self._backward_stacked(rows, q, k, v, lse, task)
        apart = self._apart(task, _sig(q, k), v.shape[-1])
        if apart is not None:
            return self._backward_apart(rows, q, k, v, lse, task, apart)
        sq, sk = task.q, task.k
        qs, ks, vs = q[:, sq], k[:, sk], v[:, sk]
        kern = self.kernel_for(qs, ks, task, v.shape[-1], backward=True)
        if kern.takes_delta:
            do, out, delta = rows.do[:, sq], None, rows.delta[:, :, sq]
        else:
            do_f, out_f = rows.folded
            do, out, delta = do_f[:, sq], out_f[:, sq], None
        return kern.backward(do, qs, ks, vs, out, lse[:, :, sq], task.mask, self.scale, delta=delta,
                             softcap=self.softcap, deterministic=self.deterministic)

    def _backward_apart(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                        task: Task, members: tuple[Task, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A joined task's gradients as the sum of its blocks' own backward calls, summed once each
        (``combine.sum_parts``, the accumulation dtype, the joined task's rows and keys)."""
        grads = [(t, self.backward(rows, q, k, v, lse, t)) for t in members]
        acc, B = acc_dtype(q.dtype), q.shape[0]
        q0, k0 = task.q_start, task.k_start
        return (combine.sum_parts([(slice(t.q_start - q0, t.q_stop - q0), g[0]) for t, g in grads],
                                  (B, task.rows, *q.shape[2:]), acc),
                *(combine.sum_parts([(slice(t.k_start - k0, t.k_stop - k0), g[i]) for t, g in grads],
                                    (B, task.cols, *x.shape[2:]), acc) for i, x in ((1, k), (2, v))))

    def backward_all(self, rows: GradRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                     tasks: tuple[Task, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every task's gradients summed over the whole q, k, v (fp32, fp64 for fp64 inputs); one task that
        covers everything returns the kernel's own gradients, with no sums and no copies."""
        tasks = self._calls(tasks, q, k)
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
