"""FlexAttention: any band or varlen mask as a compiled block-sparse kernel (CUDA).

The mask becomes a ``mask_mod`` over call-local indices; block masks are cached per (mask, shape, device),
bounded by entries and bytes: a block mask holds device tensors, and a document (varlen) mask is one packed
batch's, so those keep only ``VARLEN_MASKS`` entries (``_block_mask``). A band's or a joined call's block mask is
derived from each row's intervals of visible keys (``_tiles``: O(rows x tiles), where eager ``create_block_mask``
holds an S x S bool tensor and its int64 temporaries, over 100 GiB at 128K); the same tiles, in the same order,
as ``create_block_mask`` (``tests/test_masks_kernels.py``). On Hopper ``auto`` prefers flex to FA2 for
wide windowed bands of training calls and of calls without a backward, and a step's band and thin blocks run as one
flex call (Note [Bands on flex] in ``seqpar.kernels.executor``). Training calls with fixed shapes run flex compiled
per shape, every other call flex compiled once for every shape (Note [Flex recompiles]).
Score capping (``softcap``) is a ``score_mod``; every head dim from 16 to 256 (powers of two or not) and a value
head dim that differs from the key head dim are served (probed forward and backward, ``sdpa.py``'s probe note).
Flex keeps its lse in base 2 internally; the public lse output is converted in ``_natural_lse`` (the one
place that knows the convention of the running torch version).

Backward from the FINAL (out, lse): on CUDA flex's backward kernel alone, given the final rows as cuDNN's is (Note
[Flex backward from the final rows] in ``seqpar.kernels.flex_backward``). Where that cannot be built (and for calls
whose shapes vary) the block's forward is recomputed: flex's lse is differentiable, so the block gradient is
autograd of the recomputed block ``(o_b, l_b)`` with upstream ``w dO`` on ``o_b`` and ``w (rowsum(dO o_b) -
Delta)`` on ``l_b``, where ``w = exp(l_b - lse)`` is the block's merge weight: exactly the chain rule through MERGE.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any

import torch

from ..masks.forms import Band, Joined, Mask, Modded
from ..types import AttnOutput
from .base import Kernel, KernelCall, device_arch, register
from .flex_backward import final_rows_backward

__all__ = ["BAND_ARCHS", "BAND_BWD_KV_HEADS", "BAND_MASKS", "BAND_RANK", "ENGINE_ROWS", "MASK_BYTES", "MOD_MASKS",
           "RECOMPILES", "SPARSE_BLOCK", "STATIC_SHAPES", "TMA_ARCHS", "VARLEN_MASKS", "FlexKernel", "takes_tma"]


@functools.lru_cache(maxsize=1)
def _lse_request() -> dict:
    """``return_aux=AuxRequest(lse=True)`` where this torch has it, else the older ``return_lse=True``."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def _options(device: torch.device, rows: int, tma: bool = False) -> dict:
    """Kernel options for a call of ``rows`` query rows on ``device``: under ``SPARSE_BLOCK`` rows flex's heuristic
    picks its decoding kernel, which found no valid configuration for seqpar's block masks on an H100 (a 127-row
    band, ``tests/test_gpu_masks.py``); such calls ask for the standard Triton kernel (``BACKEND``, torch >= 2.9).
    With ``tma`` (forward kernels only), longer calls on a ``TMA_ARCHS`` GPU load their tiles through the Tensor
    Memory Accelerator (Note [Flex on TMA])."""
    if device.type != "cuda":
        return {}
    if rows < SPARSE_BLOCK:
        return {"kernel_options": {"BACKEND": "TRITON"}}
    if tma and _tma_on(device_arch(device)):
        return {"kernel_options": {"USE_TMA": True}}
    return {}


def _tma_on(arch: int) -> bool:
    """Whether forward kernels on a GPU of compute capability ``arch`` run on TMA (Note [Flex on TMA])."""
    return arch in TMA_ARCHS and _has_tma_option()


ENGINE_ROWS = 16384
"""Query rows from which a training call whose forward takes TMA leaves flex's own autograd for the engine (Note
[Flex on TMA]; measured at 16K and 128K)."""
TMA_ARCHS = frozenset({90})
"""Compute capabilities where flex's kernels run with ``USE_TMA`` (Note [Flex on TMA]).

Note [Flex on TMA]
    Flex's Triton kernels can load query and key/value tiles through Hopper's Tensor Memory Accelerator
    (``kernel_options={"USE_TMA": True}``, off by default; inductor falls back to plain loads where a tensor's
    strides or alignment do not allow it). On an H100 (torch 2.11, GQA 32/8, D 128, bf16, flex's own tile
    choice for the shape, interleaved bursts; ``benchmarks/gpu/probe_rank_flex.py``): the sink window's forward
    at W = 1, 128K, 22.56 -> 21.44 ms; its emulated rank's joined call (16K rows x 20.6K keys) 2.96 -> 2.74 ms.
    Other tile shapes, stages, warps and ``ROWS_GUARANTEED_SAFE`` were slower or equal. The option reaches the
    backward kernel too, and there it costs: a causal window of 4095 at 16K, forward+backward through flex's own
    autograd, 9.30 ms without, 9.53 with (an H200, ``probe_band_bounds.py``; 1.006x at 128K). So only forward
    kernels take it - ``FlexKernel.forward`` (a ring's step, a joined call) and a whole call on flex's own autograd
    (``autograd_forward``) where no backward can follow (no grad, or inputs that need none); a training call on
    that autograd (one option for both kernels) and the backward from the final rows run without, and so does
    flex compiled for every shape (Note [Flex recompiles]): measured only compiled per shape. Only masks where it
    was measured faster take it (``takes_tma``): bands and joined bands without softcap. On a user's ``mask_mod``
    it was slower - at W = 1, 16K, a no-grad forward at 1.11x flex with it and 1.03x without, and on an emulated
    rank of 8 at 2K-4K tokens 1.06-1.16x the forward without it (4 H200s, ``probe_tma_rank.py``); softcap moved
    -3% to +2%. A training call of ``ENGINE_ROWS`` rows or more whose forward takes it leaves flex's own autograd
    for the engine (``trains_on_engine``): its forward on TMA, its backward from the final rows (Note [Flex
    backward from the final rows]). Through ``seqpar.attention`` at W = 1 on an H200 (``probe_direct_vs_engine.py``,
    the same outputs bitwise): a window of 4095 and the sink window, the training forward 0.92-0.94x the direct
    path's, forward+backward 0.96-0.98x, at 16K and 128K. Both in
    ``benchmarks/results/2026-11-28-h200x4-twenty-ninth/``. Measured on sm90 only."""


def takes_tma(mask: Mask, softcap: float) -> bool:
    """Whether a forward kernel of ``mask`` asks for TMA (Note [Flex on TMA]): bands and joined bands without a
    ``score_mod``, where it was measured faster; a user's ``mask_mod`` ran slower on it."""
    return softcap == 0 and isinstance(mask, (Band, Joined))


@functools.lru_cache(maxsize=1)
def _has_tma_option() -> bool:
    """Whether this torch's flex takes ``USE_TMA`` (``FlexKernelOptions`` names it, torch >= 2.8)."""
    try:
        from torch.nn.attention.flex_attention import FlexKernelOptions
    except ImportError:
        return False
    return "USE_TMA" in getattr(FlexKernelOptions, "__annotations__", {})


RECOMPILES = 128
"""Compiled variants flex may hold (one per mask family, shape and head dim; Note [Flex recompiles])."""
STATIC_SHAPES = 8
"""Shapes of calls without a backward (or shaped by the batch) compiled per shape before the compile for every
shape takes the rest (Note [Flex recompiles])."""


@functools.lru_cache(maxsize=2)
def _compiled(dynamic: bool):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=dynamic)

    def call(*args, **kwargs):
        # Note [Flex recompiles]: past dynamo's recompile limit (8 by default) a compiled function silently runs
        # eagerly, and eager flex materialises every score (32 GiB at 16K x 32 heads, measured on the H100).
        # Compiled per shape (dynamic=False), seqpar meets one variant per block shape, mask family and head dim,
        # so it raises the limit for its own calls and makes hitting it an error rather than a silent unfused
        # fallback. A training call's shapes recur step after step, so it compiles per shape: the fastest kernel.
        # A call without a backward (serving's prefill meets every prompt length; nothing tells it from an
        # evaluation loop) and a block shaped by the batch (packed documents) would compile for seconds at every
        # new length and fail past RECOMPILES of them. They get FlexKernel.for_call's variant: its first
        # STATIC_SHAPES shapes compile per shape (an evaluation's few shapes at full speed), later ones run flex
        # compiled once for every shape (dynamic=True), which compiled twice over every length tried (multiples of
        # 128 and the rest) on an H100 (benchmarks/results/2026-11-26-h100-flex-dynamic). Compiled for every
        # shape, a 16K window's forward took 2.79 ms against 2.74 per shape, but a generic mask_mod's blocks 6.45 ms
        # against 5.04: hence per shape first.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILES, fail_on_recompile_limit_hit=True):
            return compiled(*args, **kwargs)
    return call


def _flex(device: torch.device, dynamic: bool = False):
    """The compiled kernel on CUDA, one variant per shape or (``dynamic``) one for every shape (Note [Flex
    recompiles]); the eager (unfused) one elsewhere, used only by the CPU tests."""
    if device.type == "cuda":
        return _compiled(dynamic)
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _natural_lse(lse: torch.Tensor) -> torch.Tensor:
    """Flex's public lse output is already natural log (torch >= 2.5; probed in reference/KERNELS.md)."""
    return lse.float()


_BIG = 1 << 30


def _mask_mod(mask: Mask, m: int, n: int, device: torch.device):
    """The mask as a ``mask_mod`` whose parameters are tensors, so dynamo compiles one kernel per mask family
    (band, varlen; a user's ``mask_mod`` once per function) rather than one per mask. The tensors are int32, as
    flex's indices are: a band's bounds in int64 made flex compare in 64 bits on its partial tiles, 2-4% slower on
    every row of a 4095 window at 16K and 128K, flex called directly alike (an H100, interleaved bursts,
    ``benchmarks/results/2026-11-28-flex-bounds-tma/``). A user's function still gets int64 global positions, as
    the oracle evaluates it (in int32 a hash mask overflowed)."""
    if isinstance(mask, Modded):            # the user's function on the rows' global positions
        base, fn = _mask_mod(mask.base, m, n, device), mask.fn
        q_pos, k_pos = mask.positions(device)

        def user_mod(b, h, qi, ki):
            return base(b, h, qi, ki) & fn(b, h, q_pos[qi], k_pos[ki])
        return user_mod
    if isinstance(mask, Joined):                # each row's few key intervals (``Joined.row_intervals``)
        rows = mask.row_intervals(m).to(device)
        slots = rows.shape[0] // 2

        def joined_mod(b, h, qi, ki):
            vis = (ki >= rows[0][qi]) & (ki <= rows[1][qi])
            for c in range(1, slots):
                vis = vis | ((ki >= rows[2 * c][qi]) & (ki <= rows[2 * c + 1][qi]))
            return vis
        return joined_mod
    if isinstance(mask, Band):
        bounds = torch.tensor([-_BIG if mask.lo is None else mask.lo, _BIG if mask.hi is None else mask.hi],
                              dtype=torch.int32, device=device)

        def band_mod(b, h, qi, ki):
            d = ki - qi
            return (d >= bounds[0]) & (d <= bounds[1])
        return band_mod
    left, right = mask.window
    q_seg = torch.empty(m, dtype=torch.int32)
    k_seg = torch.full((n,), -1, dtype=torch.int32)
    q_diag = torch.empty(m, dtype=torch.int32)        # the key index (segment-local) of each query's diagonal
    k_idx = torch.empty(n, dtype=torch.int32)
    for s in range(len(mask.cu_q) - 1):
        qa, qb, ka, kb = mask.cu_q[s], mask.cu_q[s + 1], mask.cu_k[s], mask.cu_k[s + 1]
        q_seg[qa:qb], k_seg[ka:kb] = s, s
        q_diag[qa:qb] = torch.arange(qb - qa, dtype=torch.int32) + ((kb - ka) - (qb - qa))
        k_idx[ka:kb] = torch.arange(kb - ka, dtype=torch.int32)
    q_seg, k_seg, q_diag, k_idx = (t.to(device) for t in (q_seg, k_seg, q_diag, k_idx))
    win = torch.tensor([_BIG if left < 0 else left, _BIG if right < 0 else right], dtype=torch.int32, device=device)

    def varlen_mod(b, h, qi, ki):
        d = k_idx[ki] - q_diag[qi]
        return (q_seg[qi] == k_seg[ki]) & (d >= -win[0]) & (d <= win[1])
    return varlen_mod


SPARSE_BLOCK = 128
"""Flex's tile (query rows x key rows) of its block masks: ``create_block_mask``'s default."""


def _intervals(mask: Band | Joined, m: int) -> torch.Tensor:
    """Each query row's visible key intervals, ``(2K, m)`` int32 (``Joined.row_intervals``; a band is one part)."""
    return (Joined(((0, m, 0, _BIG, mask),)) if isinstance(mask, Band) else mask).row_intervals(m)


def _tiles(rows: torch.Tensor, m: int, n: int, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` bool tile maps ``(ceil(m / T), ceil(n / T))`` (T = ``SPARSE_BLOCK``) from the rows' key
    intervals ``rows`` (``_intervals``, on the device that computes): a row's visible keys in a tile are the sum of
    its disjoint intervals' overlaps with it, so a tile is full when all T of its rows see all T of its keys and
    partial when some row sees some key - what ``create_block_mask`` finds from the S x S mask, in O(m x tiles x K)
    and ``chunk`` tile rows at a time."""
    T = SPARSE_BLOCK
    c = torch.arange(0, n, T, device=rows.device)
    d = (c + T).clamp(max=n) - 1                              # each tile's last key
    n_rows = -(-m // T)
    partial = torch.empty(n_rows, c.shape[0], dtype=torch.bool, device=rows.device)
    full = torch.empty_like(partial)
    for r0 in range(0, n_rows, chunk):
        i0, i1 = r0 * T, min((r0 + chunk) * T, m)
        seen = torch.zeros(i1 - i0, c.shape[0], dtype=torch.int64, device=rows.device)
        for s in range(rows.shape[0] // 2):
            lo, hi = rows[2 * s, i0:i1, None].long(), rows[2 * s + 1, i0:i1, None].long()
            seen += (torch.minimum(hi, d) - torch.maximum(lo, c) + 1).clamp(min=0)
        pad = -(i1 - i0) % T                                  # rows past m: a tile with them is never full
        seen = torch.nn.functional.pad(seen, (0, 0, 0, pad), value=-1).view(-1, T, c.shape[0])
        partial[r0:r0 + seen.shape[0]] = (seen > 0).any(1)
        full[r0:r0 + seen.shape[0]] = (seen == T).all(1)
    return partial & ~full, full


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``(rows, cols)`` tile map as flex's ``(num_blocks (1, 1, rows), indices (1, 1, rows, cols))``, int32."""
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], idx[None, None].contiguous()


def _evaluated_tiles(mod, m: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` tile maps like ``_tiles``, from ``mod`` evaluated on slabs of whole tile rows of at most
    ``EVAL_CELLS`` cells (a varlen or ``mask_mod`` call's mask has no row intervals): eager ``create_block_mask``
    holds the m x n mask and its int64 temporaries at once - 128 GiB at 128K, measured on an H100."""
    from ..masks.mod import EVAL_CELLS

    T = SPARSE_BLOCK
    n_pad = -(-n // T) * T
    step = T * max(1, EVAL_CELLS // (n_pad * T))
    kv = torch.arange(n, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    partial, full = [], []
    for a in range(0, m, step):
        qi = torch.arange(a, min(a + step, m), device=device)
        seen = mod(zero, zero, qi[:, None], kv[None, :]).expand(qi.shape[0], n)
        rows = -(-qi.shape[0] // T) * T                   # cells past m or n: never seen, so their tiles never full
        seen = torch.nn.functional.pad(seen, (0, n_pad - n, 0, rows - qi.shape[0]))
        count = seen.view(rows // T, T, n_pad // T, T).sum((1, 3), dtype=torch.int32)
        full.append(count == T * T)
        partial.append((count > 0) & (count < T * T))
    return torch.cat(partial), torch.cat(full)


def _tiled_block_mask(mask: Band | Joined, m: int, n: int, device: torch.device):
    """The block mask of a band or joined call from its rows' key intervals (``_tiles``), with its ``mask_mod``."""
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = _tiles(_intervals(mask, m).to(device), m, n)
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=SPARSE_BLOCK,
                                    mask_mod=_mask_mod(mask, m, n, device), seq_lengths=(m, n))


BAND_MASKS = 64
"""Band and joined block masks kept (one per band or step, shape and device: reused by every batch)."""
VARLEN_MASKS = 4
"""Document block masks kept: one packed batch's each, used by one step."""
MOD_MASKS = 256
"""Block masks of ``mask_mod`` blocks kept (one per block of a planned call: a ring's steps, a call's pieces)."""
MASK_BYTES = 256 << 20
"""Device bytes all kept block masks may hold together (the least recently used go first, documents first)."""

_BANDS: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()      # key -> (block mask, bytes), least recent first
_DOCS: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
_MODS: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
_HELD = [0]                                                       # bytes of both
_LOCK = threading.Lock()


def _block_mask(mask: Mask, m: int, n: int, device: torch.device):
    """The block mask of ``mask`` over ``m`` x ``n`` call-local rows, cached (module docstring)."""
    from torch.nn.attention.flex_attention import BlockMask

    tiled = isinstance(mask, (Band, Joined))
    key, tier = (mask, m, n, device), _BANDS if tiled else _MODS if isinstance(mask, Modded) else _DOCS
    with _LOCK:
        hit = tier.get(key)
        if hit is not None:
            tier.move_to_end(key)
            return hit[0]
    if tiled:
        bm = _tiled_block_mask(mask, m, n, device)
    else:
        mod = _mask_mod(mask, m, n, device)
        partial, full = _evaluated_tiles(mod, m, n, device)
        bm = BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=SPARSE_BLOCK, mask_mod=mod,
                                      seq_lengths=(m, n))
    nbytes, dropped = _mask_bytes(bm), []
    with _LOCK:
        old = tier.pop(key, None)
        _HELD[0] += nbytes - (0 if old is None else old[1])
        tier[key] = (bm, nbytes)
        for t, most in ((_DOCS, VARLEN_MASKS), (_MODS, MOD_MASKS), (_BANDS, BAND_MASKS)):
            while len(t) > most or (_HELD[0] > MASK_BYTES and t and next(iter(t)) != key):
                dropped.append(t.popitem(last=False)[1])
                _HELD[0] -= dropped[-1][1]
    del dropped                          # released outside the lock
    return bm


def _mask_bytes(bm: Any) -> int:
    """Device bytes of a block mask: its index tensors and the tensors its ``mask_mod`` closes over."""
    cells = [c.cell_contents for c in getattr(bm.mask_mod, "__closure__", None) or ()]
    tensors = [t for t in (*vars(bm).values(), *cells) if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@functools.lru_cache(maxsize=16)
def _softcap_mod(softcap: float, device: torch.device):
    """``softcap * tanh(s / softcap)`` with the cap as a tensor, so one compiled kernel serves every value."""
    cap = torch.tensor(softcap, device=device)

    def score_mod(score, b, h, qi, ki):
        return cap * torch.tanh(score / cap)
    return score_mod


BAND_ARCHS = frozenset({90})
"""Compute capabilities (10 * major + minor) where flex outruns FA2 on wide windowed bands (Note [Bands on flex] in
``seqpar.kernels.executor``: measured on the H100 and the H200; A100's FA2 is its own kernel's home, Blackwell
unmeasured)."""
BAND_RANK = 85
"""Flex's rank for such a band: above both FA2s (``flash_attn`` 80, ``flash`` 70); cuDNN serves no window."""
BAND_BWD_KV_HEADS = 4
"""KV heads up to which a grouped-query (GQA/MQA) wide band's backward leaves flex for FA2 while its forward stays
(Note [Band backward on few KV heads] in ``seqpar.kernels.executor``)."""


class FlexKernel(Kernel):
    """``torch.nn.attention.flex_attention`` with a block mask built from the call's mask."""

    name = "flex"
    auto_rank = {"cuda": 50}
    direct_softcap = True
    joins = True
    dynamic = False
    """May compile once for every shape, not once per shape (``for_call``'s variant)."""

    def rank(self, call: KernelCall) -> int | None:
        """``BAND_RANK`` for a wide windowed band (``KernelCall.wide``) on a ``BAND_ARCHS`` GPU of a training call
        with fixed block shapes (compiled once per block shape, which a training run pays once) or of a call
        without a backward (compiled once for every shape: ``for_call``), Note [Bands on flex]: flex wins only
        where a band is large enough to repay its call; narrow bands (an image's or a frame's diagonal piece),
        training blocks shaped by the batch and deterministic calls keep FA2, and so does the backward of a
        grouped-query band with at most ``BAND_BWD_KV_HEADS`` KV heads (Note [Band backward on few KV heads])."""
        if (call.mask == "band" and call.wide and call.arch in BAND_ARCHS and not call.deterministic
                and (not call.training or not call.shapes_vary)
                and not (call.backward and call.kv_heads < call.heads and call.kv_heads <= BAND_BWD_KV_HEADS)):
            return BAND_RANK
        return super().rank(call)

    def for_call(self, call: KernelCall, *, named: bool = False) -> FlexKernel:
        """Compiled for every shape (``dynamic=True``) where a call's shapes need not recur: calls without a
        backward (serving's prefill meets every prompt length) and blocks shaped by the batch (Note [Flex
        recompiles])."""
        return _DYNAMIC if (not call.training or call.shapes_vary) else self

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        r = []
        try:
            import torch.nn.attention.flex_attention
        except ImportError as e:
            r.append(f"flex_attention is not importable in this torch ({e})")
        if call.device != "cuda":
            r.append(f"runs on CUDA only (compiled flex on CPU is inference-only), got {call.device!r}")
        if call.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            r.append(f"dtype must be fp16, bf16 or fp32, got {call.dtype}")
        for what, d in (("head_dim", call.head_dim), ("value head_dim", call.dv)):
            if d < 16 or d > 256 or d % 8:
                r.append(f"{what} must be a multiple of 8 in [16, 256], got {d}")
        return r

    def _run(self, q, k, v, mask: Mask, scale: float, softcap: float, tma: bool = False) -> AttnOutput:
        bm = _block_mask(mask, q.shape[1], k.shape[1], q.device)
        mod = _softcap_mod(float(softcap), q.device) if softcap > 0 else None
        dynamic = self._dynamic_for(q, k, mask)
        options = _options(q.device, q.shape[1], tma and not dynamic)
        o, lse = _flex(q.device, dynamic)(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, scale=scale, score_mod=mod,
            enable_gqa=q.shape[2] != k.shape[2], **_lse_request(), **options)
        return AttnOutput(o.transpose(1, 2), _natural_lse(lse if torch.is_tensor(lse) else lse.lse))

    def _dynamic_for(self, q: torch.Tensor, k: torch.Tensor, mask: Mask) -> bool:
        """Whether this call runs the compile for every shape (Note [Flex recompiles]): never for the per-shape
        kernel."""
        return False

    def direct(self, mask: Mask) -> bool:
        return True

    def trains_on_engine(self, mask: Mask, rows: int, arch: int, softcap: float) -> bool:
        """A training call whose forward would take TMA (Note [Flex on TMA]), from ``ENGINE_ROWS`` rows: flex's own
        autograd runs both kernels without it; the engine runs the forward on TMA and the backward from the final
        rows."""
        return not self.dynamic and rows >= ENGINE_ROWS and takes_tma(mask, softcap) and _tma_on(arch)

    def autograd_forward(self, q, k, v, mask: Mask, scale: float, softcap: float = 0.0) -> torch.Tensor:
        """The whole call as flex's own autograd op: its backward reuses the forward's lse (no recompute). On TMA
        only where no backward can follow (Note [Flex on TMA])."""
        bm = _block_mask(mask, q.shape[1], k.shape[1], q.device)
        mod = _softcap_mod(float(softcap), q.device) if softcap > 0 else None
        dynamic = self._dynamic_for(q, k, mask)
        tma = takes_tma(mask, softcap) and not (dynamic or (torch.is_grad_enabled()
                                                           and any(t.requires_grad for t in (q, k, v))))
        o = _flex(q.device, dynamic)(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, scale=scale, score_mod=mod,
            enable_gqa=q.shape[2] != k.shape[2], **_options(q.device, q.shape[1], tma))
        return o.transpose(1, 2)

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        """A block's out and lse, without autograd: on detached inputs (Note [Flex under capture]).

        Note [Flex under capture]
            Dynamo guards a compiled flex on whether its inputs require grad. An engine's forward runs inside the
            autograd op (grad mode off) on the caller's tensors, which do in training; a graphed call's capture runs
            it on static copies, which do not. Each saw its own variant, so the capture compiled a new one - and
            compiling inside a CUDA graph capture fails (dynamo's trace of the mask's tensors copies between host
            and device): graphed training calls with a flex block (a ``mask_mod``, softcap, the sink window's joined
            call at 4K rows a rank) raised at their capture, found on an H200 (2026-11-28,
            ``benchmarks/gpu/probe_capture.py``: "tensor 'key' requires_grad mismatch"). So ``FlexKernel.forward``
            hands flex detached tensors: one variant, compiled by the eager call before capture."""
        with torch.no_grad():
            o, lse = self._run(q.detach(), k.detach(), v.detach(), mask, scale, softcap, tma=takes_tma(mask, softcap))
        return AttnOutput(o, lse.masked_fill(~torch.isfinite(lse), float("-inf")))

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        if out is not None and delta is None and not self.dynamic and q.device.type == "cuda":
            grads = final_rows_backward(do, q, k, v, out, lse, _block_mask(mask, q.shape[1], k.shape[1], q.device),
                                        _softcap_mod(float(softcap), q.device) if softcap > 0 else None, scale,
                                        _options(q.device, q.shape[1]).get("kernel_options", {}))
            if grads is not None:                    # Note [Flex backward from the final rows]
                return grads
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            o_b, l_b = self._run(qg, kg, vg, mask, scale, softcap)
            l_b = l_b.masked_fill(~torch.isfinite(l_b.detach()), float("-inf"))
            w = torch.exp(l_b.detach() - lse.float()).nan_to_num_(0.0)      # the block's merge weight
            if delta is None:
                delta = (do.float() * out.float()).sum(-1).transpose(1, 2)
            d_ob = (do.float() * o_b.detach().float()).sum(-1).transpose(1, 2)
            g_o = do.float() * w.transpose(1, 2).unsqueeze(-1)
            g_l = w * (d_ob - delta)
            return torch.autograd.grad((o_b, l_b), (qg, kg, vg), (g_o.to(o_b.dtype), g_l.to(l_b.dtype)))


register(FlexKernel())


class _DynamicFlex(FlexKernel):
    """``FlexKernel`` for calls whose shapes need not recur (``FlexKernel.for_call``; not registered: it is the same
    kernel, named "flex"): its first ``STATIC_SHAPES`` shapes run the per-shape compile (an evaluation loop's few
    shapes at full speed), every later one the compile for every shape (Note [Flex recompiles])."""

    dynamic = True

    def __init__(self):
        self._static: set[tuple] = set()
        self._lock = threading.Lock()

    def _dynamic_for(self, q: torch.Tensor, k: torch.Tensor, mask: Mask) -> bool:
        key = (type(mask), q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], q.dtype, q.device)
        with self._lock:
            if key in self._static:
                return False
            if len(self._static) < STATIC_SHAPES:
                self._static.add(key)
                return False
        return True


_DYNAMIC = _DynamicFlex()
