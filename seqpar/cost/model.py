"""The cost model's vocabulary and shared arithmetic: what every method's model is written in.

A method's cost model is ``(Problem, Candidate, Machine) -> Prediction`` and lives in its own module
(``Method.cost``); this module holds what those models share, and nothing that knows a method by name:

    Problem, Candidate, Prediction, Machine   the question, a configuration, the answer, the hardware
    Group                                     ranks placed on the topology (``topology.Group``)
    Tally, Cost                               one pass accumulated step by step (Note [Step time])
    steps, gather_blocks_of, whole            the critical rank's calls, dense or packed (Note [Packed batches])
    passkv                                    the pass-KV ring (ring, and USP's ring over R ranks)
    a2a_in, head_pipeline, ulysses_mem        Ulysses' all-to-alls, plain or pipelined over head groups
    ulysses_why_not                           Ulysses' head-count rules (ulysses, usp)
    base_mem, temps                           memory every schedule holds
    ccr, pass_bytes, single_gpu_ms            ALGORITHMS.md §7.1 and §12.3 quantities, the yardstick

It imports no method (``tests/test_layering.py``): methods import it, and the planner reaches the methods
only through the registry (``seqpar.methods``).

Note [Step time]
    On the device, an overlapped step (transfer posted before the compute it hides behind) lasts
    ``max(T_comp, T_comm) + δ·min(T_comp, T_comm)`` where δ is the profile's overlap loss for the
    pattern (NCCL kernels slow a concurrent attention kernel). A serial transfer (the schedule must wait
    for it) adds its whole time and counts as exposed; a transfer of few bytes costs the pattern's
    latency (Note [Link time]). ``T_comp`` is the kernel time ``FLOPs / rate(size)`` plus a launch, plus
    the step's share of the call's merge: ``merge_passes`` x rows x heads x D x 4 bytes at HBM bandwidth (the
    runtime merges a call's partials once, at its end, in one pass that reads each partial once and writes the
    output - Note [One merge per call] in ``seqpar.kernels.combine`` - so the share includes the output's
    write and is under one fp32 pass; the built-in profiles' figure is that kernel's measured time, Note
    [Merge share] in ``seqpar.planner.measured``). Summed over a pass, that is the pass's device time D.

    The fixed costs (Note [Fixed costs] in ``profile.py``) are host time. The call's ``call_us`` for the
    pass is serial - validation, the agreement round (which waits for the device) and setup come before
    the pass gives the device any work. The steps' costs H (the method's ``step_us`` α_m per step) are
    paid while the device works, so the two overlap: a pass lasts ``call + max(D, H) + κ·min(D, H)``
    with κ the profile's ``host_overlap_loss`` - 1 adds them (every fixed cost exposed), 0 hides the
    shorter completely. Large problems are device-bound (the step costs vanish behind the kernels),
    small ones host-bound.

Note [Modelled as implemented]
    The models follow the code where the code is written and the algorithm notes where it is not yet:
    pass-KV backward sends each step's dK/dV partial straight home with the next K/V hop while the partials fit
    ``PASSKV_HOME_BYTES`` (Note [Partials home] in ``seqpar.methods._passkv``: no running sum, one sum at the end,
    the last partial exposed); past it, it waits for the running dK/dV of a block before computing on it, so each
    dK/dV hop is exposed (``PASSKV_EXPOSED_DKV``); all-gather re-gathers K and V in backward (one chunk exposed, as in
    forward) and, on layouts other than contiguous, permutes each gathered chunk into global order and
    each fp32 dK/dV chunk back (``index_select``); Ulysses packs q, k, v into one all-to-all and returns
    out and lse in two (the second, a few hundred KB, costs about the a2a latency); pass-Q partial outputs
    travel in the input dtype (``PASSQ_PARTIAL_BYTES``). Steps of pass-Q and TASP take the busiest rank's
    bytes (lock-step), so TokenRing's "halves after the wrap" lower its total bytes but not its step
    time. Change the constants below when the code changes; ``seqpar.planner.validate`` shows the effect.
    Ulysses and USP with ``head_chunks`` > 1 pipeline their all-to-alls over head groups (Note
    [Head-group pipeline] in ``seqpar.methods._ulysses``): ``head_pipeline`` models that schedule.

Note [Packed batches]
    A packed batch (``Problem.documents``: the global ``cu_seqlens``, documents ``[a_d, b_d)``) changes the
    work, never the bytes: a token sees only its own document, so a ring step moves whole blocks (L tokens
    of KV, Q or partials, the bytes the dense model counts) while each rank's kernel work is what the
    block planner leaves of the block. With ``rule`` the mask and ``seg_r`` rank r's positions cut at the
    documents (``Segments.cut``):

        w_r        = layouts.work.work(layout, S, rule, cu)[r]           rank r's visible pairs in the pass
        p_r(s)     = M[0, r, src(r, s)], M = block_matrix(...)          rank r's pairs at step s
        T_comp(s)  = kernel(Block(rows, keys, max_r p_r(s))) (+ merges)  lock step: each step at its busiest rank
        imbalance  = max_r w_r / mean_r w_r      lockstep = sum_s max_r p_r(s) / mean_r w_r

    ``src(r, s)`` is the rank whose block r holds at step s: ``r - s`` on a ring (pass-KV; pass-Q visits
    the same pairs), the schedule's own map on a double ring. Pass-Q, TASP and the double ring price a step by
    Note [Step time] with that ``T_comp`` - a ring paying ``lockstep`` times the balanced compute; pass-KV times
    each rank's own calls (Note [Ring critical path]). ``rows`` and ``keys`` are the busiest rank's query rows
    and keys that see anything (``M[1]``, ``M[2]``): what its merges and its dK/dV accumulation touch, and the
    call size its kernel rate is looked up at. All-gather runs one call per rank against the gathered keys,
    ``Block(L, S, max_r w_r)``; Ulysses runs the whole sequence on H/U heads on every rank,
    ``Block(S, S, sum_r w_r)`` (balanced by construction). A single document covering the sequence is
    the dense model (``Problem`` drops it). ``M[0, r, k]`` is ``layouts.work.block_work``'s count for the
    block (r's queries, k's keys), all W x W blocks at once (``block_matrix``: each document's run pairs in
    closed form, vectorised). Cost per batch: ``W`` rank works (O(runs log D) each) and the sum over documents of
    their runs squared (a document split over every rank: 4 W^2; 64 sampled query ranks beyond 64 ranks),
    never O(S).

Note [Masked problems]
    A named mask (``Problem.mask``, ``seqpar.masks``) changes the work as documents do, and is planned the same way:
    ``Problem.shaped`` sends the critical rank's calls through ``packed_steps``, ``rank_work`` and ``balance``, with
    the mask in ``Problem.rule``. Its block matrix comes from the block planner itself (``_planned_block_matrix``:
    each query rank's plan against the whole sequence, cut at the ranks holding the keys, each piece's band counted
    in closed form: W plans), since a mask's blocks have no closed form over runs; the ranks' work is its row sums.
    The all-gather's bytes are its selective gather's (Note [Selective gather] in ``seqpar.methods.allgather``: the
    keys of the planned blocks), none where no rank reads another's keys (Note [Local keys]); a ring's steps end
    where no rank's blocks reach further (Llama 4's chunks inside ranks: one step). A generic ``mask_mod`` declares
    no blocks: the planner ranks such a call without it (an upper bound on its work). The plans cost host time
    growing with the pieces' related pairs, per layout and ring size the planner ranks (at 128K over 8: 0.22 s for
    32 video frames, 0.70 s for 64, 1.9 s for 128; Llama 4's chunks, each related only to itself, 0.34 s for 256 at
    1M and 2.0 s for 1024, on a 2-core CPU: ``benchmarks/planning_host_time.py``), so a mask of more than
    ``PLANNED_PIECES`` pieces (8x that for same-piece masks) is ranked without it too.

Note [Band rates]
    A windowed band runs on flex (sm90, Note [Bands on flex] in ``seqpar.kernels.executor``) or FA2, not on cuDNN,
    and flex's band ran at 391-401 TFLOP/s forward and 338-352 backward on an H100 and an H200 (a causal window of
    4095, GQA 32/8, D 128, 16K and 128K; ``benchmarks/results/2026-11-28-flex-bounds-tma/``), where cuDNN's causal
    curve reads 555-639 and 521-539: priced at the default kernel's causal rate, the window's W = 1 call and the
    emulated all-gather's rank over 8 came out 1.4-2.1x faster than they ran
    (``benchmarks/results/2026-11-28-cpu-planner-band-rates/``). So a masked call of a banded problem
    (``Problem.banded``) that is not a plain causal shape (``_is_band``) goes at the profile's ``band_tflops``
    where it has them. Bands narrower than flex's (FA2) are priced the same: not measured apart. A band open to
    the right runs on cuDNN since 2026-11-28 (Note [Open bands backwards] in ``seqpar.kernels.sdpa``): a square
    one is a causal square to ``_is_band`` and keeps the causal rate; a trimmed open band of another shape is
    still priced at the band rate, which over-prices it, and neither pays for its flips (copies in and out).
    A grouped-query band's backward on at most ``FEW_KV_HEADS`` KV heads per rank - Ulysses' share of GQA 32/8 over
    4 or 8 - runs on FA2 (Note [Band backward on few KV heads] in ``seqpar.kernels.executor``): at the band rate the
    sink window's Ulysses forward+backward came out 32-44% faster than it ran (emulated, one H200, 16K over 4 and
    8, four records of ``benchmarks/results/2026-11-28-h200-thirtieth`` and ``-thirty-first``). It goes at
    ``FEW_KV_BAND_BWD`` (0.5, fitted on those four rows: -8% to +14% after) of the band backward rate.

Note [Ring critical path]
    A pass-KV ring's ranks are not in lock step. Rank r's step s needs the block its left neighbour forwarded at
    step s - 1 (and its own hop to the right done), and posts its hops at the step's start: a rank with little
    work runs ahead until a hop holds it. Pricing every step at its busiest rank's call (``packed_steps``, the
    ``lockstep`` bound of Note [Packed batches]) charged work no rank does: the sink window at 128K over 8 on a
    contiguous layout has one 4-key sink block per rank, on a different step for each, and the lock-step sum
    priced six of them on every rank - 1.67x the emulated rank's measured forward and forward+backward
    (``benchmarks/results/2026-11-28-cpu-planner-band-rates/``). So a shaped problem of at most 64 ranks is timed
    by ``_ring_time``: with ``c_r(s)`` rank r's call (``rank_steps``), ``m_s`` step s's hop and δ the overlap loss,

        own_r   = start_r(s) + max(c_r(s), m_s) + δ min(c_r(s), m_s)
        hop_r   = max(start_r(s), start_r+1(s)) + m_s                 (rank r -> r + 1, posted by both ends)
        start_r(s + 1) = max(own_r, hop_r, hop_r-1),   the pass lasting max_r start_r(n)

    Equal ranks give the lock-step sum exactly (Note [Step time]); with free hops each rank runs its own sum of
    calls, held only by neighbours that have not reached the step before. The sink window's ring came to 1.09 /
    1.19x its measured forward / forward+backward (``benchmarks/results/2026-11-28-cpu-ring-critical-path/``). On
    the committed emulated packed records (8 H100 ranks, ``seqpar.planner.validate``) the ring's predictions moved
    by -17% to +1% (most on ``balanced_whole``, whose lock-step bound is the largest), 16 of 72 rows within 15% (19
    before): the lock-step bound had hidden some of the packed calls' under-priced host and per-call costs; auto's
    picks did not change (11 of 16 within 5% of the best, as before). ``lockstep``
    stays in the prediction as the bound it is.

Note [Query tiles of packed calls]
    FA2's varlen call runs a document's query rows in tiles of ``TILE_ROWS`` (128), one thread block each per head,
    whatever the rows: a balanced rank's pieces of ~100-400 rows pay whole tiles, and each tile a fixed cost beside
    its pairs. On one H100 (``benchmarks/results/2026-11-27-h100-nineteenth/grids*.jsonl``, GQA 32/8) a balanced
    ring's step - 3.6-3.9K rows in 23-27 segments of at most 416 - took 0.14 ms for 0.027 ms of its share of the
    one-GPU call's time, and all-gather's call over 27 segments 0.53 ms for 0.29. So a packed call (a ``Block`` with
    ``tiles``) is charged its pairs on whole tiles (``padded``: each run pair's pairs times its rows rounded up to
    tiles, over its rows) at the kernel's rate, plus ``Profile.tile_cost_us`` per query tile and head. A run pair
    counts its own tiles (a run seeing key runs of two ranks in one call counts twice: a bound); all-gather and
    Ulysses count each query run once (its keys are one range in global order). Dense calls keep the dense model,
    a named mask's blocks included (a problem without documents pays no tiles): charged tiles, the ring's steps
    under spans, prefix LM, block-causal and chunks came out 17-55% slower than they ran at 2K tokens per rank over 8
    (emulated, one H200), and within -17% to +7% without (``benchmarks/results/2026-11-28-cpu-planner-tiles/``).

Memory (``base_mem``, ``temps`` and each method's buffers) counts what one rank holds at the peak of the
pass: inputs, outputs, the tensors autograd saves, and the method's buffers (ALGORITHMS.md §12.2 "Memory");
kernel workspaces and the caching allocator's slack are not counted.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..layouts import Layout, Rule, make_layout
from ..layouts.blocks import Run, Segments, Task, plan, union_spans
from ..layouts.work import task_pairs, work
from .profile import Profile
from .topology import Group, Network
from .work import Block, causal_corner, count_pairs, gather_blocks, ring_steps, self_block

__all__ = ["BWD_FLOPS", "PASSKV_EXPOSED_DKV", "PASSKV_HOME_BYTES", "PASSQ_PARTIAL_BYTES", "TILE_ROWS", "Candidate",
           "Cost", "Group", "Machine", "Prediction", "Problem", "Tally", "a2a_in", "auto_head_chunks", "balance",
           "base_mem", "block_matrix", "ccr", "gather_blocks_of", "head_chunk_valid", "head_chunks", "head_pipeline",
           "kv_wire_heads", "note_ccr", "packed_steps", "partials_home", "pass_bytes", "passkv", "rank_work",
           "single_gpu_ms", "steps", "tallies", "temps", "ulysses_mem", "ulysses_why_not", "whole"]

#: pass-KV backward waits for the incoming dK/dV before the step's compute (``_passkv.backward``)
PASSKV_EXPOSED_DKV = True
#: pass-KV backward: while its partials fit, each step's dK/dV goes straight home (``_passkv.HOME_BYTES``)
PASSKV_HOME_BYTES = 2 << 30
#: bytes per element of a pass-Q partial output on the wire (None: the input dtype)
PASSQ_PARTIAL_BYTES: int | None = None
#: backward FLOPs per forward FLOP (five GEMMs against two)
BWD_FLOPS = 2.5
#: query rows of one FA2 varlen tile at head dim 128 (Note [Query tiles of packed calls])
TILE_ROWS = 128
#: pieces of a named mask up to which the model plans it by its blocks, 8x that for a mask relating each piece only
#: to itself (Llama 4's chunks): the plans' host time grows with the pieces' related pairs (Note [Masked problems])
PLANNED_PIECES = 64


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One attention layer's shape, globally: S tokens over ``world`` ranks."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    batch: int = 1
    world: int
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    dtype_bytes: int = 2
    grad_bytes: int = 4
    """Bytes per element of gradient partials on the wire (``grad_dtype``)."""
    documents: tuple[int, ...] | None = None
    """A packed batch's global ``cu_seqlens`` (0 first, the valid length last, at most ``seq_len``); None =
    one document of ``seq_len`` tokens, the dense model (Note [Packed batches])."""
    mask: Any = None
    """A named mask (``seqpar.masks``: declared pieces), planned by its blocks like a packed batch (Note [Masked
    problems]); None = causal and window only."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "heads", "kv_heads", "head_dim", "batch", "world", "dtype_bytes", "grad_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads must be a multiple of kv_heads, got {self.heads} and {self.kv_heads}")
        if self.documents is not None:
            docs = tuple(int(c) for c in self.documents)
            ordered = all(a <= b for a, b in itertools.pairwise(docs))
            if len(docs) < 2 or docs[0] != 0 or not ordered or docs[-1] > self.seq_len:
                raise ValueError(f"documents (cu_seqlens) must start at 0, be non-decreasing and end at most at "
                                 f"seq_len={self.seq_len}, got {docs[:4]}{'...' if len(docs) > 4 else ''}")
            object.__setattr__(self, "documents", None if docs == (0, self.seq_len) else docs)
        if self.mask is not None and Rule(mask=self.mask).pieces is None:
            raise TypeError(f"mask must be a named mask of seqpar.masks (declared pieces), got {self.mask!r}")

    @functools.cached_property
    def planned_mask(self) -> Any:
        """The mask the model plans by its blocks: ``mask`` when it has at most ``PLANNED_PIECES`` pieces (8x that
        for a mask of same-piece pairs only), else None (Note [Masked problems])."""
        if self.mask is None:
            return None
        most = PLANNED_PIECES * (8 if self.mask.same_piece_only else 1)
        return None if self.mask.pieces_within(self.seq_len, most) > most else self.mask

    @property
    def shaped(self) -> bool:
        """Whether the work is the block planner's, not the dense closed forms': packed documents or a named mask
        (Note [Packed batches], Note [Masked problems])."""
        return self.documents is not None or self.planned_mask is not None

    @property
    def banded(self) -> bool:
        """Whether the masked calls are windowed bands: a left window, a right one beyond causal, or a named mask
        with a window (Note [Band rates])."""
        left, right = self.window
        return left >= 0 or (right >= 0 and not self.causal) or getattr(self.mask, "window", -1) >= 0

    @property
    def group_ratio(self) -> int:
        return self.heads // self.kv_heads

    @property
    def rule(self) -> Rule:
        """The mask as the block planner reads it."""
        return Rule(self.causal, self.window, mask=self.planned_mask)

    def act(self, tokens: float, heads: float, nbytes: float | None = None) -> float:
        """Bytes of a ``(B, tokens, heads, D)`` tensor (input dtype unless ``nbytes``)."""
        return self.batch * tokens * heads * self.head_dim * (self.dtype_bytes if nbytes is None else nbytes)

    def rowstat(self, tokens: float, heads: float) -> float:
        """Bytes of a ``(B, heads, tokens)`` fp32 tensor (lse, Delta)."""
        return self.batch * tokens * heads * 4


#: how an option shows in a label: (before the layout, format); any other option shows as ``{name}{value}``
#: after the layout. These are the benchmark's names, which ``seqpar.planner.validate.parse_method`` reads back.
_LABEL_FORMS = {"schedule": (True, "{}"), "node_size": (True, "n{}"), "heads_k_stride": (False, "stride{}"),
                "head_chunks": (False, "head_chunks{}")}
#: option values a label leaves out (defaults that change nothing)
_UNSHOWN = {"heads_k_stride": None, "head_chunks": 1}


@dataclass(frozen=True)
class Candidate:
    """A method configuration: what ``seqpar.attention`` would be called with."""

    method: str
    layout: str = "zigzag"
    ulysses: int = 1
    """The Ulysses degree of a 2D method (its ring degree is ``world // ulysses``); 1 for 1D methods."""
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def label(self, world: int, show_layout: bool = True) -> str:
        """The benchmark's name for it: "ring/zigzag", "usp/u2r2/zigzag", "tasp/direct/zigzag", "ulysses"
        (``show_layout=False``: the planner leaves out the layout of a method that has only one)."""
        shown = [(k, v) for k, v in self.options if _UNSHOWN.get(k, object()) != v]
        before = [_LABEL_FORMS[k][1].format(v) for k, v in shown if _LABEL_FORMS.get(k, (False,))[0]]
        after = [_LABEL_FORMS[k][1].format(v) if k in _LABEL_FORMS else f"{k}{v}" for k, v in shown
                 if not _LABEL_FORMS.get(k, (False,))[0]]
        degrees = [f"u{self.ulysses}r{world // self.ulysses}"] if self.ulysses > 1 else []
        return "/".join([self.method, *degrees, *before, *([self.layout] if show_layout else []), *after])


@dataclass(frozen=True)
class Prediction:
    """Predicted cost of one call on one rank (times in ms, sizes in bytes)."""

    fwd_ms: float
    fwd_bwd_ms: float
    peak_mem_bytes: int
    """Peak bytes held by the rank during forward+backward."""
    comm_bytes: int
    """Bytes the rank sends in forward+backward."""
    exposed_comm_ms: float
    """Forward+backward time spent waiting for transfers (not hidden behind compute)."""
    notes: tuple[str, ...] = ()
    fwd_peak_mem_bytes: int = 0
    fwd_comm_bytes: int = 0
    fwd_exposed_comm_ms: float = 0.0
    compute_ms: float = 0.0
    """Forward+backward kernel and merge time (the part no schedule can remove)."""
    work_imbalance: float = 1.0
    """The busiest rank's attention work over the mean (Note [Packed batches]; 1 for the dense model)."""
    lockstep: float = 1.0
    """Summed over the steps, the busiest rank's work at each step, over the mean work: what a schedule whose
    steps wait for their slowest rank pays against a balanced one (Note [Packed batches])."""

    def time_ms(self, mode: str) -> float:
        return self.fwd_ms if mode == "fwd" else self.fwd_bwd_ms

    def peak_mem(self, mode: str) -> int:
        return self.fwd_peak_mem_bytes if mode == "fwd" else self.peak_mem_bytes

    def exposed_ms(self, mode: str) -> float:
        return self.fwd_exposed_comm_ms if mode == "fwd" else self.exposed_comm_ms

    def bytes(self, mode: str) -> int:
        return self.fwd_comm_bytes if mode == "fwd" else self.comm_bytes


@dataclass(frozen=True)
class Machine:
    """The profile (kernels, HBM, α, δ), the network it runs on, and the local kernel the methods use."""

    profile: Profile
    network: Network
    kernel: str

    def step_ms(self, method: str, direction: str) -> float:
        """Fixed cost of one schedule step of ``method`` (Note [Step time])."""
        return self.profile.step_cost_us(method, direction) * 1e-3

    def call_ms(self, direction: str) -> float:
        """Fixed cost of one call's ``direction`` pass (Note [Step time])."""
        return self.profile.call_cost_us(direction) * 1e-3

    def kernel_ms(self, p: Problem, blk: Block | None, heads: float, direction: str = "fwd") -> float:
        """One call's time: FLOPs over the profile's rate at the call's size and mask, plus a launch; a block of
        full keys and a causal corner at the rates of its parts (Note [Causal corners])."""
        if blk is None or blk.pairs == 0:
            return 0.0
        parts = causal_corner(blk) or (blk,)
        tiles = 0.0
        if p.documents is not None:                  # Note [Query tiles of packed calls]: packed calls only
            tiles = self.profile.tile_cost_us(direction) * 1e-3 * blk.tiles * heads * p.batch
        return sum(self._flops_ms(p, b, heads, direction) for b in parts) + self.profile.launch_us * 1e-3 + tiles

    def _flops_ms(self, p: Problem, blk: Block, heads: float, direction: str) -> float:
        mask = "causal" if blk.masked else "full"
        band = self.profile.band_rate(direction, blk.tokens) if p.banded and _is_band(blk) else None
        if band is not None and direction == "bwd" and _few_kv_heads(p, heads):
            band *= FEW_KV_BAND_BWD                         # Note [Band rates]: FA2's backward, few KV heads
        rate = band if band is not None else self.profile.rate_tflops(self.kernel, mask, direction, blk.tokens)
        pairs = (blk.padded or blk.pairs) if p.documents is not None else blk.pairs
        flops = 4.0 * p.batch * pairs * heads * p.head_dim * (BWD_FLOPS if direction == "bwd" else 1.0)
        return flops / (rate * 1e12) * 1e3

    def hbm_ms(self, nbytes: float) -> float:
        return nbytes / (self.profile.hbm_gbps * 1e9) * 1e3

    def permute_ms(self, elements: float) -> float:
        """A row permute (``index_select``) of ``elements`` elements."""
        rate = self.profile.permute_gelems or self.profile.hbm_gbps / 4
        return elements / (rate * 1e9) * 1e3

    def merge_ms(self, p: Problem, rows: float, heads: float) -> float:
        """One MERGE of ``rows`` query rows into the fp32 accumulator (Note [Step time])."""
        return self.hbm_ms(self.profile.merge_passes * p.act(rows, heads, 4))

    def comm_ms(self, pattern: str, nbytes: float, group: Group) -> float:
        return self.network.ms(pattern, nbytes, group)

    def loss(self, pattern: str) -> float:
        name = {"ring": "p2p", "ring2": "p2p_bidir", "cycles": "allpairs",
                "ring_copy": "p2p_copy"}.get(pattern, pattern)
        return self.profile.overlap(name)


@dataclass
class Tally:
    """Accumulates one pass (forward or backward) step by step (Note [Step time])."""

    m: Machine
    alpha: float = 0.0
    """The per-step fixed cost in ms (α_m of Note [Step time])."""
    ms: float = 0.0
    """Device time D."""
    host: float = 0.0
    """Host time H: the steps' fixed costs."""
    exposed: float = 0.0
    sent: float = 0.0
    compute: float = 0.0

    def step(self, comp: float, comm: float = 0.0, pattern: str = "ring", nbytes: float = 0.0) -> float:
        """One step; returns its device time."""
        t = max(comp, comm) + self.m.loss(pattern) * min(comp, comm)
        self.ms += t
        self.host += self.alpha
        self.exposed += max(0.0, comm - comp)
        self.sent += nbytes
        self.compute += comp
        return t

    def ring(self, comps: Sequence[Sequence[float]], comms: Sequence[float], pattern: str = "ring",
             nbytes: Sequence[float] = (), waits: Sequence[float] = ()) -> float:
        """The steps of a ring whose ranks' work differs step by step (Note [Ring critical path]): ``comps[r][s]``
        rank r's compute at step s, ``comms[s]`` the hop step s posts, ``waits[s]`` a transfer every rank waits
        for before step s's compute; returns the pass's device time."""
        n = len(comms)
        waits = tuple(waits) or (0.0,) * n
        t, t0 = _ring_time(comps, comms, waits, self.m.loss(pattern)), _ring_time(comps, (0.0,) * n, (0.0,) * n, 0.0)
        self.ms += t
        self.host += self.alpha * n
        self.exposed += t - t0
        self.sent += sum(nbytes)
        self.compute += max(sum(c) for c in comps)
        return t

    def wait(self, comm: float, nbytes: float = 0.0) -> None:
        """A transfer the schedule waits for with nothing to hide it."""
        self.ms += comm
        self.exposed += comm
        self.sent += nbytes

    def local(self, comp: float) -> None:
        """Compute outside any step (packing, conversions)."""
        self.ms += comp
        self.compute += comp

    def absorb(self, other: Tally) -> None:
        """Another tally's steps run after this one's, in the same pass."""
        self.ms += other.ms
        self.host += other.host
        self.exposed += other.exposed
        self.sent += other.sent
        self.compute += other.compute

    def total(self, call: float) -> float:
        """The pass's time with ``call`` ms of per-call fixed cost: ``call + max(D, H) + κ min(D, H)``."""
        return call + max(self.ms, self.host) + self.m.profile.host_overlap_loss * min(self.ms, self.host)


def tallies(m: Machine, method: str) -> tuple[Tally, Tally]:
    """Empty forward and backward tallies whose steps cost ``method``'s fixed step time."""
    return Tally(m, m.step_ms(method, "fwd")), Tally(m, m.step_ms(method, "bwd"))


@dataclass
class Cost:
    """A method's forward and backward tallies, peak memory per pass, notes and work balance, before they
    become a ``Prediction``."""

    fwd: Tally
    bwd: Tally
    fwd_mem: float
    bwd_mem: float
    notes: list[str] = field(default_factory=list)
    balance: tuple[float, float] = (1.0, 1.0)
    """``(work_imbalance, lockstep)`` of the prediction (``balance()``)."""

    def prediction(self) -> Prediction:
        f, b = self.fwd, self.bwd
        t_f, t_b = f.total(f.m.call_ms("fwd")), b.total(b.m.call_ms("bwd"))
        return Prediction(fwd_ms=t_f, fwd_bwd_ms=t_f + t_b, peak_mem_bytes=int(max(self.fwd_mem, self.bwd_mem)),
                          comm_bytes=int(f.sent + b.sent), exposed_comm_ms=f.exposed + b.exposed,
                          notes=tuple(self.notes), fwd_peak_mem_bytes=int(self.fwd_mem),
                          fwd_comm_bytes=int(f.sent), fwd_exposed_comm_ms=f.exposed, compute_ms=f.compute + b.compute,
                          work_imbalance=self.balance[0], lockstep=self.balance[1])


def base_mem(p: Problem) -> tuple[float, float]:
    """(forward, forward+backward) bytes of the call's own tensors on one rank: inputs, outputs, grads."""
    L, H, Hkv = p.seq_len / p.world, p.heads, p.kv_heads
    qkvo = 2 * p.act(L, H) + 2 * p.act(L, Hkv) + p.rowstat(L, H)
    return qkvo, qkvo + p.act(L, H) + p.act(L, H) + 2 * p.act(L, Hkv)      # + dO, dq, dk, dv


def temps(p: Problem, L: float, heads: float, kv_heads: float) -> float:
    """Backward temporaries every block schedule holds: one block's (dq, dk, dv) and Delta."""
    return p.act(L, heads) + p.act(L, 2 * kv_heads) + p.rowstat(L, heads)


# --- the critical rank's calls, dense or packed (Note [Packed batches]) ---------------------------------------
def steps(p: Problem, layout: str, ranks: int) -> tuple[Block | None, ...]:
    """The busiest rank's call at each step of a pass-KV ring of ``ranks`` ranks over ``layout`` (a pass-Q
    ring visits the same pairs): closed form for one document (``work.ring_steps``), else ``packed_steps``."""
    if not p.shaped:
        return ring_steps(layout, ranks, p.seq_len, p.causal, p.window)
    return packed_steps(p, layout, ranks, lambda r, s: (r - s) % ranks, ranks)


FEW_KV_BAND_BWD = 0.5
"""A grouped-query band's backward on at most ``FEW_KV_HEADS`` KV heads per rank, over the profile's band backward
rate (Note [Band rates])."""
FEW_KV_HEADS = 4
"""``seqpar.kernels.flex.BAND_BWD_KV_HEADS``: at most this many KV heads, flex declines a band's backward (FA2's)."""


def _few_kv_heads(p: Problem, heads: float) -> bool:
    """Whether a call on ``heads`` query heads per rank holds at most ``FEW_KV_HEADS`` KV heads under GQA."""
    return p.kv_heads < p.heads and heads * p.kv_heads / p.heads <= FEW_KV_HEADS


def _is_band(blk: Block) -> bool:
    """Whether a masked call of a banded problem is a band rather than a plain causal square or corner (those run
    on the default kernel): Note [Band rates]."""
    square = blk.rows == blk.cols and blk.pairs == blk.rows * (blk.rows + 1) // 2
    return blk.masked and not square and causal_corner(blk) is None


def packed_steps(p: Problem, layout: str, ranks: int, source: Callable[[int, int], int], n: int,
                 trim: bool = True) -> tuple[Block | None, ...]:
    """Step s's call of the busiest rank, rank r computing against the block of rank ``source(r, s)``: its
    visible pairs ``max_r p_r(s)``, on the query rows and keys that see any (``block_matrix``, at most L each;
    Note [Packed batches]); None where no rank computes. ``trim`` cuts the trailing steps no rank computes on
    (a schedule that ends early, as pass-KV does)."""
    blocks = block_matrix(make_layout(layout, ranks, p.documents), p.seq_len, p.rule, p.documents)
    L = p.seq_len // ranks
    out: list[Block | None] = []
    for s in range(n):
        pairs, rows, keys, tiles, padded = max(tuple(int(x) for x in blocks[:, r, source(r, s)])
                                               for r in _sample(ranks))
        out.append(Block(min(rows, L), min(keys, L), pairs, tiles, padded) if pairs else None)
    while trim and len(out) > 1 and out[-1] is None:
        out.pop()
    return tuple(out)


def rank_steps(p: Problem, layout: str, ranks: int, n: int) -> tuple[tuple[Block | None, ...], ...] | None:
    """Every rank's call at each of the first ``n`` steps of a pass-KV ring (rank r against rank ``r - s``'s block;
    ``block_matrix``), for Note [Ring critical path]; None for a problem of one shape on every rank (the closed
    form: its busiest rank is every step's) or past ``_sample``'s 64 ranks."""
    if not p.shaped or ranks > 64:
        return None
    blocks = block_matrix(make_layout(layout, ranks, p.documents), p.seq_len, p.rule, p.documents)
    cells = blocks.permute(1, 2, 0).tolist()          # [r][k] -> (pairs, rows, keys, tiles, padded), one host copy
    L = p.seq_len // ranks

    def call(r: int, s: int) -> Block | None:
        pairs, rows, keys, tiles, padded = (int(x) for x in cells[r][(r - s) % ranks])
        return Block(min(rows, L), min(keys, L), pairs, tiles, padded) if pairs else None
    return tuple(tuple(call(r, s) for s in range(n)) for r in range(ranks))


def _ring_time(comps: Sequence[Sequence[float]], comms: Sequence[float], waits: Sequence[float], loss: float
               ) -> float:
    """Device time of a ring pass (Note [Ring critical path]): each rank's step starts when its previous step is
    done and the hops it takes part in - from its left neighbour, to its right one, each posted once both ends
    reached the step - have landed."""
    W = len(comps)
    start = [0.0] * W
    for s, m in enumerate(comms):
        own = [start[r] + waits[s] + max(comps[r][s], m) + loss * min(comps[r][s], m) for r in range(W)]
        hop = [max(start[r], start[(r + 1) % W]) + waits[s] + m for r in range(W)]     # rank r -> r + 1
        start = [max(own[r], hop[r], hop[(r - 1) % W]) for r in range(W)]
    return max(start)


def gather_blocks_of(p: Problem, layout: str) -> tuple[Block, ...]:
    """The critical rank's calls against the whole gathered sequence (all-gather KV): closed form for one
    document, else one call with the busiest rank's work (Note [Packed batches])."""
    if not p.shaped:
        return gather_blocks(layout, p.world, p.seq_len, p.causal, p.window)
    w = rank_work(p, layout, p.world)
    r = max(range(p.world), key=lambda i: w[i])
    return (_tiled(p, layout, p.world, r, p.seq_len // p.world, p.seq_len, w[r]),) if w[r] else ()


def whole(p: Problem) -> Block:
    """The whole sequence against itself: Ulysses' local call and the single-GPU yardstick."""
    if not p.shaped:
        return self_block(p.seq_len, p.causal, p.window)
    return _tiled(p, "contiguous", 1, 0, p.seq_len, p.seq_len, sum(rank_work(p, "contiguous", 1)))


def _tiled(p: Problem, layout: str, ranks: int, r: int, rows: int, cols: int, pairs: int) -> Block:
    """Rank r's one packed call over ``layout`` (its query runs each once: Note [Query tiles of packed calls])."""
    n, tiles = _query_tiles(make_layout(layout, ranks, p.documents), p.seq_len, p.documents, r)
    return Block(rows, cols, pairs, tiles, pairs * tiles * TILE_ROWS // n if n else pairs)


@functools.lru_cache(maxsize=64)
def _query_tiles(layout: Layout, seq_len: int, documents: tuple[int, ...], r: int) -> tuple[int, int]:
    """``(rows, tiles)`` of rank r's runs in documents (padding excluded), each run in ``TILE_ROWS``-row tiles."""
    runs = [run.length for run in layout.segments(r, seq_len).cut(documents).runs if run.doc >= 0]
    return sum(runs), sum(-(-n // TILE_ROWS) for n in runs)


def rank_work(p: Problem, layout: str, ranks: int) -> tuple[int, ...]:
    """Each rank's visible (query, key) pairs over a whole pass (``layouts.work.work``)."""
    return _work(make_layout(layout, ranks, p.documents), p.seq_len, p.rule, p.documents)


@functools.lru_cache(maxsize=32)
def _work(layout: Layout, seq_len: int, rule: Rule, documents: tuple[int, ...] | None) -> tuple[int, ...]:
    if rule.mask is not None and layout.world <= 64:     # W plans, not layouts.work's W^2 (Note [Masked problems])
        return tuple(int(x) for x in block_matrix(layout, seq_len, rule, documents)[0].sum(1))
    return tuple(work(layout, seq_len, rule, documents))


def balance(p: Problem, layout: str, ranks: int, per_step: tuple[Block | None, ...] | None = None
            ) -> tuple[float, float]:
    """``(imbalance, lockstep)`` of Note [Packed batches] for ``ranks`` ranks over ``layout``; ``per_step``
    the schedule's busiest calls (None: one call per rank, lockstep = imbalance)."""
    w = rank_work(p, layout, ranks)
    mean = sum(w) / ranks
    if not mean:
        return 1.0, 1.0
    imbalance = max(w) / mean
    if per_step is None:
        return imbalance, imbalance
    return imbalance, sum(b.pairs for b in per_step if b is not None) / mean


@functools.lru_cache(maxsize=32)
def block_matrix(layout: Layout, seq_len: int, rule: Rule, documents: tuple[int, ...]) -> torch.Tensor:
    """For rank r's queries against rank k's keys: ``[0, r, k]`` the visible (query, key) pairs, ``[1, r, k]``
    the query rows and ``[2, r, k]`` the key rows that see any, ``[3, r, k]`` their query tiles and ``[4, r, k]``
    the pairs on whole tiles (Note [Query tiles of packed calls]), int64 ``(5, W, W)`` (rows of ranks outside
    ``_sample`` are zero beyond 64 ranks).

    Every rank's runs cut at the documents; for each document, every (query run, key run) pair of it counted
    in closed form (``work.run_pairs``, vectorised) and summed into its (rank, rank) cell. The pairs are
    ``layouts.work.block_work``'s count for every block at once (a test keeps them equal); the rows and keys
    are summed over run pairs too (a bound: a run seeing several runs of its document counts once per run),
    in O(sum over documents of runs^2) integer operations, never O(S).
    """
    W = layout.world
    if rule.mask is not None:
        return _planned_block_matrix(layout, seq_len, rule, documents)
    runs = [(r, run.doc, run.glob, run.length) for r in range(W)
            for run in layout.segments(r, seq_len).cut(documents).runs if run.doc >= 0]
    out = torch.zeros(5, W, W, dtype=torch.long)
    if not runs:
        return out
    stride = layout.segments(0, seq_len).stride
    rank, doc, start, length = torch.tensor(sorted(runs, key=lambda x: x[1]), dtype=torch.long).T.contiguous()
    first = torch.searchsorted(doc, doc)                              # each run's document's first run
    count = torch.searchsorted(doc, doc, right=True) - first          # ... and its number of runs
    sampled = torch.zeros(W, dtype=torch.bool)
    sampled[_sample(W)] = True
    q = torch.arange(len(doc))[sampled[rank]]                       # query runs
    n = count[q]                                                     # key runs (of its document) per query run
    qi = q.repeat_interleave(n)
    ki = first[qi] + torch.arange(int(n.sum())) - (torch.cumsum(n, 0) - n).repeat_interleave(n)
    pairs, rows, keys = _run_block_t(length[qi], length[ki], start[ki] - start[qi], stride, *rule.delta_bounds())
    tiles = -torch.div(-rows, TILE_ROWS, rounding_mode="floor")
    padded = torch.where(rows > 0, pairs * tiles * TILE_ROWS // rows.clamp(min=1), 0)
    for i, c in enumerate((pairs, rows, keys, tiles, padded)):
        out[i].index_put_((rank[qi], rank[ki]), c, accumulate=True)
    return out


def _planned_block_matrix(layout: Layout, seq_len: int, rule: Rule, documents: tuple[int, ...] | None
                          ) -> torch.Tensor:
    """``block_matrix`` under a named mask (Note [Masked problems]): each (sampled) query rank's plan against the
    whole sequence in global order - the blocks the runtime computes - cut at the ranks that hold the keys, each
    piece counted in closed form: its visible pairs, the rows and keys that see any, their query tiles and the
    pairs on whole tiles. W plans; a strided layout (stripe, whose ranks hold no runs of global order) plans every
    rank pair."""
    W = layout.world
    bounds = documents if documents is not None else (0, seq_len)
    segs = [layout.segments(r, seq_len).cut(bounds) for r in range(W)]
    out = torch.zeros(5, W, W, dtype=torch.long)
    if segs[0].stride == 1:
        owners = sorted((run.glob, run.glob + run.length, k) for k in range(W)
                        for run in layout.segments(k, seq_len).runs)
        keys = Segments((Run(0, 0, seq_len),)).cut(bounds)
        for r in _sample(W):
            pieces: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(W)]
            for t in plan(segs[r], keys, rule, fewest_calls=False):
                for k, piece in _by_owner(t, owners):
                    pieces[k].append(piece)
            for k in range(W):
                out[:, r, k] = _counted(pieces[k])
        return out
    for r in _sample(W):
        for k in range(W):
            out[:, r, k] = _counted([(t.q_start, t.q_stop, t.k_start, t.k_stop, task_pairs(t))
                                     for t in plan(segs[r], segs[k], rule, fewest_calls=False)])
    return out


def _by_owner(t: Task, owners: list[tuple[int, int, int]]):
    """``(rank, (q0, q1, k0, k1, pairs))`` for each rank holding some of ``t``'s keys (global positions): the rows
    and keys of that piece that see any, and its pairs (``t``'s band over the piece's keys)."""
    lo, hi = t.mask.lo, t.mask.hi
    i = bisect.bisect_right(owners, (t.k_start, math.inf, math.inf)) - 1
    a = t.k_start
    while a < t.k_stop:
        _, g1, k = owners[i]
        b = min(g1, t.k_stop)
        off = a - t.k_start                      # the piece's key j' = j - off: lo - off <= j' - i <= hi - off
        slo, shi = (None if lo is None else lo - off), (None if hi is None else hi - off)
        m, n = t.rows, b - a
        pairs = count_pairs(m, n, slo, shi)
        if pairs:
            r0, r1 = (0 if shi is None else max(0, -shi)), (m - 1 if slo is None else min(m - 1, n - 1 - slo))
            c0, c1 = (0 if slo is None else max(0, slo)), (n - 1 if shi is None else min(n - 1, m - 1 + shi))
            yield k, (t.q_start + r0, t.q_start + r1 + 1, a + c0, a + c1 + 1, pairs)
        a, i = b, i + 1


def _counted(pieces: list[tuple[int, int, int, int, int]]) -> torch.Tensor:
    """One ``block_matrix`` cell from its pieces ``(q0, q1, k0, k1, pairs)``: pairs, rows, keys, tiles, padded."""
    if not pieces:
        return torch.zeros(5, dtype=torch.long)
    pairs = sum(p[4] for p in pieces)
    rows = sum(b - a for a, b in union_spans((p[0], p[1]) for p in pieces))
    keys = sum(b - a for a, b in union_spans((p[2], p[3]) for p in pieces))
    tiles = -(-rows // TILE_ROWS)
    return torch.tensor([pairs, rows, keys, tiles, pairs * tiles * TILE_ROWS // max(rows, 1)])


def _upto_t(Lq: torch.Tensor, Lk: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
    """``work._upto`` on tensors: #{(i, j): i < Lq, j < Lk, j - i <= x}."""
    if x is None:
        return Lq * Lk
    c = x + 1
    a = (1 - c).clamp(min=0).minimum(Lq)
    b = (Lk - c).minimum(Lq).maximum(a)
    n = b - a
    return n * c + (a + b - 1) * n // 2 + (Lq - b) * Lk


def _run_block_t(Lq: torch.Tensor, Lk: torch.Tensor, d: torch.Tensor, stride: int, lo: int | None,
                 hi: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pairs, rows, keys)`` of query runs against key runs ``d`` apart, one stride, ``lo <= key - query <=
    hi``: the pairs are ``work.run_pairs`` on tensors; with ``tlo <= j - i <= thi`` in row units, row i sees a
    key iff ``-thi <= i <= Lk - 1 - tlo`` and key j is seen iff ``tlo <= j <= Lq - 1 + thi``."""
    tlo = None if lo is None else -torch.div(d - lo, stride, rounding_mode="floor")      # ceil((lo - d) / s)
    thi = None if hi is None else torch.div(hi - d, stride, rounding_mode="floor")
    below = torch.zeros_like(Lq) if tlo is None else _upto_t(Lq, Lk, tlo - 1)
    pairs = (_upto_t(Lq, Lk, thi) - below).clamp(min=0)
    zero = torch.zeros_like(Lq)
    rows = ((Lq - 1 if tlo is None else (Lk - 1 - tlo).minimum(Lq - 1))
            - (zero if thi is None else (-thi).clamp(min=0)) + 1).clamp(min=0)
    keys = ((Lk - 1 if thi is None else (Lq - 1 + thi).minimum(Lk - 1))
            - (zero if tlo is None else tlo.clamp(min=0)) + 1).clamp(min=0)
    if tlo is not None and thi is not None:
        empty = tlo > thi
        pairs, rows, keys = (torch.where(empty, 0, x) for x in (pairs, rows, keys))
    return pairs, rows, keys


def _sample(ranks: int) -> list[int]:
    if ranks <= 64:
        return list(range(ranks))
    return sorted({round(i * (ranks - 1) / 63) for i in range(64)})


# --- pass-KV ring (ring, usp) ---------------------------------------------------------------------------------
def partials_home(p: Problem, L: float, kv_heads: float, steps: int) -> bool:
    """Whether a pass-KV backward of ``steps`` steps over ``L`` local rows sends each step's dK/dV partial home
    (``seqpar.methods._passkv.partials_home``'s rule: ``steps`` partials of the block, each element the wider of
    the inputs' and the wire's dtype, within ``PASSKV_HOME_BYTES``)."""
    return steps * p.act(L, 2 * kv_heads, max(p.dtype_bytes, p.grad_bytes)) <= PASSKV_HOME_BYTES


def passkv(p: Problem, m: Machine, layout: str, R: int, heads: float, kv_heads: float, group: Group,
           method: str, pattern: str = "ring") -> Cost:
    """Pass-KV ring of R ranks over S tokens with ``heads`` / ``kv_heads`` per rank (ALGORITHMS.md §3);
    its steps cost ``method``'s fixed step time; its hops move as ``pattern`` ("ring": NCCL's P2P, "ring_copy":
    copy engines, Note [Copy-engine ring] in ``seqpar.comm.symmetric``)."""
    L = p.seq_len / R
    calls = steps(p, layout, R)
    n = len(calls)
    per_rank = rank_steps(p, layout, R, n)
    kv, dkv = p.act(L, 2 * kv_heads), p.act(L, 2 * kv_heads, p.grad_bytes)
    t_kv, t_dkv = m.comm_ms(pattern, kv, group), m.comm_ms(pattern, dkv, group)
    f, b = tallies(m, method)
    more = [s + 1 < n for s in range(n)]

    def run(t: Tally, comp: Callable[[Block | None, int], float], comms: list[float], sent: list[float],
            waits: Sequence[float] = ()) -> None:
        """The pass's steps: each at its busiest rank's call, or each rank's own (Note [Ring critical path])."""
        if per_rank is not None:
            t.ring([[comp(blk, s) for s, blk in enumerate(row)] for row in per_rank], comms, pattern, sent, waits)
            return
        for s, blk in enumerate(calls):
            if waits and waits[s]:
                t.wait(waits[s])
            t.step(comp(blk, s), comms[s], pattern, sent[s])

    def fwd(blk: Block | None, s: int) -> float:
        return m.kernel_ms(p, blk, heads) + (m.merge_ms(p, blk.rows, heads) if s and blk is not None else 0.0)
    run(f, fwd, [t_kv if x else 0.0 for x in more], [kv if x else 0.0 for x in more])
    b.local(m.hbm_ms(p.act(L, heads, 2 * p.dtype_bytes)))                 # Delta = rowsum(dO * O)
    home = partials_home(p, L, kv_heads, n)
    if home:                       # partials straight home (Note [Partials home] in seqpar.methods._passkv)
        part = p.act(L, 2 * kv_heads)                                     # exact partials: the inputs' dtype
        t_part = m.comm_ms(pattern, part, group)
        kv_s = [t_kv if x else 0.0 for x in more]
        part_s = [t_part if s >= 2 else 0.0 for s in range(n)]
        # step s posts the next K/V and step s - 1's partial: one NCCL batch, or two copy-engine lanes side by side
        comms = [max(a, c) if pattern == "ring_copy" else a + c for a, c in zip(kv_s, part_s)]
        run(b, lambda blk, s: m.kernel_ms(p, blk, heads, "bwd"), comms,
            [(kv if more[s] else 0.0) + (part if s >= 2 else 0.0) for s in range(n)])
        if n > 1:
            b.wait(t_part, part)                                          # the last step's partial
            b.local(m.hbm_ms((n + 1) * p.act(L, heads + 2 * kv_heads)))    # each sum, once, at the end
    else:
        def acc(blk: Block | None, s: int) -> float:
            if blk is None:
                return 0.0
            return m.kernel_ms(p, blk, heads, "bwd") + m.hbm_ms(p.act(blk.rows, heads, 10) +
                                                                p.act(blk.cols, 2 * kv_heads, 10))
        run(b, acc, [(t_kv if more[s] else 0.0) + (0.0 if PASSKV_EXPOSED_DKV or not s else t_dkv) for s in range(n)],
            [(kv + dkv) if x else 0.0 for x in more],
            [t_dkv if s and PASSKV_EXPOSED_DKV else 0.0 for s in range(n)])
        if n > 1:
            b.wait(t_dkv, dkv)                                            # the last dK/dV hop home
    fwd_base, bwd_base = base_mem(p)
    acc_f = p.act(L, heads, 4) + p.rowstat(L, heads)
    fwd_mem = 2 * kv + acc_f + p.act(L, heads)                            # stacked KV + next, accumulator, block out
    held = n * p.act(L, 2 * kv_heads) if home else 2 * p.act(L, 2 * kv_heads, max(4, p.grad_bytes))
    bwd_mem = p.act(L, heads, 4) + 2 * kv + held + temps(p, L, heads, kv_heads)
    c = Cost(f, b, fwd_base + fwd_mem, bwd_base + bwd_mem)
    if n < R:
        why = ("documents end" if p.documents is not None else "the mask ends" if p.planned_mask is not None
               else "window ends")
        c.notes.append(f"{why} the ring after {n} of {R} steps")
    if p.shaped:
        c.balance = balance(p, layout, R, calls)
        c.notes.append(f"busiest rank {c.balance[0]:.2f}x the mean work, steps wait for it: {c.balance[1]:.2f}x")
    elif p.causal and layout == "contiguous" and p.window == (-1, -1) and R > 1:
        c.notes.append(f"contiguous causal: the last rank does {2 * R - 1} of {R} average units "
                       f"(bound {R / (2 * R - 1):.0%})")
    return c


def note_ccr(cost: Cost, p: Problem, m: Machine, R: int) -> Cost:
    """Adds the compute-to-communication ratio of one pass-KV step over R ranks to the notes."""
    if R > 1:
        r = ccr(p, m, R=R)
        cost.notes.append(f"CCR {r:.2f} per zigzag step" + (" (communication-bound)" if r < 1 else ""))
    return cost


# --- Ulysses (ulysses, usp) -----------------------------------------------------------------------------------
def kv_wire_heads(kv_heads: int, U: int) -> int:
    """KV heads a rank sends in the Ulysses all-to-all (ALGORITHMS.md §5.2): Hkv, or U when Hkv | U < ..."""
    return kv_heads if kv_heads % U == 0 else U


@dataclass(frozen=True)
class _A2A:
    """One head group's Ulysses all-to-alls: bytes a rank sends per collective, and its packing traffic."""

    fwd_in: tuple[float, ...]
    """q/k/v packed in one collective."""
    fwd_out: tuple[float, ...]
    """out, then lse (two collectives)."""
    bwd_in: tuple[float, ...]
    """dO."""
    bwd_out: tuple[float, ...]
    """dq/dk/dv packed in one collective."""
    pack: float

    def ms(self, m: Machine, U: int, sizes: tuple[float, ...]) -> float:
        """The collectives one after another (one stream)."""
        return sum(m.comm_ms("a2a", x, Group(U)) for x in sizes)


def _a2a_bytes(p: Problem, U: int, L: float, chunks: int = 1) -> _A2A:
    """Per head group, what a rank sends in each all-to-all and its packing traffic."""
    H, hw = p.heads / chunks, kv_wire_heads(p.kv_heads // chunks, U)
    frac = (U - 1) / U
    repl = hw > p.kv_heads // chunks
    grads = frac * (p.act(L, H) + p.act(L, 2 * hw, p.grad_bytes if repl else p.dtype_bytes))
    return _A2A(fwd_in=(frac * p.act(L, H + 2 * hw),), fwd_out=(frac * p.act(L, H), frac * p.rowstat(L, H)),
                bwd_in=(frac * p.act(L, H),), bwd_out=(grads,),
                pack=2 * (p.act(L, H + 2 * hw) + p.act(L, H)))           # pack + unpack, both directions


def a2a_in(p: Problem, m: Machine, U: int, L: float, f: Tally, b: Tally) -> None:
    """Ulysses' sequence <-> head all-to-alls on one rank holding L tokens, forward and backward."""
    a = _a2a_bytes(p, U, L)
    for tally, first, last in ((f, a.fwd_in, a.fwd_out), (b, a.bwd_in, a.bwd_out)):
        tally.local(m.hbm_ms(a.pack))
        tally.wait(a.ms(m, U, first), sum(first))
        tally.wait(a.ms(m, U, last), sum(last))


def head_chunk_valid(heads: int, kv_heads: int, U: int, c: int) -> bool:
    """c head groups each keep the slot rules over U (mirrors ``_ulysses.head_chunk_counts``)."""
    if c < 1 or heads % c or kv_heads % c:
        return False
    h, hk = heads // c, kv_heads // c
    return h % U == 0 and (hk % U == 0 or U % hk == 0)


def auto_head_chunks(heads: int, kv_heads: int, U: int) -> int:
    """``head_chunks="auto"``, as ``seqpar.methods._ulysses.auto_head_chunks`` decides it (a test keeps the two
    equal): the largest c <= 4 with every group free of KV replication and at least 2 query heads per rank,
    1 when U == 1."""
    if U == 1:
        return 1
    for c in range(4, 1, -1):
        if heads % c == 0 and kv_heads % c == 0 and (kv_heads // c) % U == 0 and heads // (c * U) >= 2:
            return c
    return 1


def ulysses_why_not(p: Problem, U: int, chunks: Any) -> list[str]:
    """The head-count rules of a Ulysses axis of degree U with ``head_chunks=chunks`` (ALGORITHMS.md §5.2,
    Note [Head-group pipeline]) that ``p`` breaks; empty when it can run."""
    why = []
    if p.heads % U:
        why.append(f"ulysses degree {U} must divide heads={p.heads}")
    if p.kv_heads % U and U % p.kv_heads:
        why.append(f"ulysses degree {U} and kv_heads={p.kv_heads} must divide one another")
    if chunks != "auto" and not (isinstance(chunks, int) and head_chunk_valid(p.heads, p.kv_heads, U, chunks)):
        why.append(f"head_chunks {chunks!r} must split heads={p.heads} and kv_heads={p.kv_heads} into groups "
                   f"that keep the slot rules over degree {U}")
    return why


def head_chunks(p: Problem, c: Candidate, U: int) -> int:
    """The candidate's ``head_chunks`` as a group count (1 when absent)."""
    v = c.option("head_chunks", 1)
    return auto_head_chunks(p.heads, p.kv_heads, U) if v == "auto" else int(v)


def head_pipeline(p: Problem, m: Machine, U: int, L: float, chunks: int, eng_f: Tally, eng_b: Tally
                  ) -> tuple[Tally, Tally]:
    """Forward and backward of ``chunks`` head groups, ``eng_f`` / ``eng_b`` being ONE group's engine.

    Group 0's inputs and the last group's outputs are exposed; the others move beside a group's engine
    (group i+1's inputs and group i-1's outputs behind group i): ``max(T_eng, T_a2a) + δ min``, the
    engine's own steps carrying their fixed costs.
    """
    a = _a2a_bytes(p, U, L, chunks)
    f, b = Tally(m), Tally(m)
    for tally, eng, first, last in ((f, eng_f, a.fwd_in, a.fwd_out), (b, eng_b, a.bwd_in, a.bwd_out)):
        t_in, t_out = a.ms(m, U, first), a.ms(m, U, last)
        tally.local(m.hbm_ms(chunks * a.pack))
        tally.wait(t_in, sum(first))
        for i in range(chunks):
            moved = (sum(first) if i + 1 < chunks else 0.0) + (sum(last) if i else 0.0)
            comm = (t_in if i + 1 < chunks else 0.0) + (t_out if i else 0.0)
            tally.ms += max(eng.ms, comm) + m.loss("a2a") * min(eng.compute, comm)
            tally.host += eng.host
            tally.exposed += eng.exposed + max(0.0, comm - eng.ms)
            tally.sent += eng.sent + moved
            tally.compute += eng.compute
        tally.wait(t_out, sum(last))
    return f, b


def ulysses_mem(p: Problem, U: int, L: float) -> tuple[float, float]:
    """(forward, backward) bytes the Ulysses sandwich adds on one rank of degree U holding L tokens."""
    H, hw = p.heads, kv_wire_heads(p.kv_heads, U)
    t = p.act(L, H + 2 * hw)                                              # q, k, v in either sharding
    saved = t + p.act(L, H) + p.rowstat(L, H)                             # head-sharded q, k, v, out, lse
    return 2 * t + 2 * p.act(L, H), saved + 2 * p.act(L, H) + 2 * t


# --- ALGORITHMS.md quantities ---------------------------------------------------------------------------------
def single_gpu_ms(p: Problem, m: Machine, mode: str) -> float:
    """The yardstick: one GPU's kernel time on the whole problem, divided by W (efficiency = this / time)."""
    blk = whole(p)
    t = m.kernel_ms(p, blk, p.heads)
    if mode != "fwd":
        t += m.kernel_ms(p, blk, p.heads, "bwd")
    return t / p.world


def pass_bytes(p: Problem, which: str, direction: str) -> float:
    """Bytes per rank per step of pass-KV ("kv") or pass-Q ("q") with L_q = L_kv (ALGORITHMS.md §7.1)."""
    L, H, Hkv, D, e, eg = p.seq_len / p.world, p.heads, p.kv_heads, p.head_dim, p.dtype_bytes, p.grad_bytes
    B = p.batch
    if which == "kv":
        return 2 * B * L * Hkv * D * (e if direction == "fwd" else e + eg)
    if which == "q":
        return B * L * H * (2 * D * e + 4) if direction == "fwd" else B * L * H * (2 * D * e + 8 + D * eg)
    raise ValueError(f"which must be 'kv' or 'q', got {which!r}")


def ccr(p: Problem, m: Machine | None = None, *, R: int | None = None, tflops: float | None = None,
        gbps: float | None = None, causal: bool | None = None) -> float:
    """Compute-to-communication ratio of one pass-KV step (ALGORITHMS.md §12.3).

    ``T_comp / T_comm`` for an L x L step (L = S/R; halved compute when causal, zigzag) against one
    ``‖KV‖`` transfer. Rates come from ``m`` (its kernel at size L, P2P at ‖KV‖) unless given.
    """
    R = R or p.world
    L = p.seq_len / R
    causal = p.causal if causal is None else causal
    flops = 4.0 * p.batch * L * L * p.heads * p.head_dim * (0.5 if causal else 1.0)
    kv = p.act(L, 2 * p.kv_heads)
    if tflops is None:
        if m is None:
            raise ValueError("ccr needs a Machine or explicit tflops, got neither")
        tflops = m.profile.rate_tflops(m.kernel, "full", "fwd", L / (2 ** 0.5 if causal else 1.0))
    t_comm = kv / (gbps * 1e9) if gbps is not None else (m.comm_ms("ring", kv, Group(R)) * 1e-3 if m else 0.0)
    return (flops / (tflops * 1e12)) / t_comm
