"""PyTorch's built-in fused attention kernels, called through their aten entry points (CUDA only).

What each gives from Python (reference/KERNELS.md, probed on H100/H200, torch 2.11):

=========  =================================================  ===========================================
kernel     serves                                             notes
=========  =================================================  ===========================================
cudnn      full and causal bands (lo unbounded), and bands    fastest at every head dim 64-256 on Hopper
           open to the right (hi unbounded) read backwards;   (1.3-2x FA2, probe below); causal is top-left
           GQA native, Dv != D; head dims <= 256 on compute   only: ``Band(None, hi > 0)`` runs as full keys
           capability >= 9.0, <= 128 before                   ``[0, hi)`` + top-left causal keys ``[hi, n)``,
                                                              merged in fp32 (Note [Open bands backwards])
flash      every band (bottom-right windows), varlen, GQA;    FA2; lse ``(B, H, S)``; varlen lse ``(H, T)``;
           head dims <= 256                                   Dv != D by zero-padding the smaller head dim
efficient  full and causal bands, fp32 only; KV replicated   memory-efficient kernel; lse padded to 32
           locally for GQA
=========  =================================================  ===========================================

None of them caps scores (softcap: flex, flash_attn, flash_attn3). The probe that fixed these declarations
(torch 2.11, cuDNN 9.19, H100; every head dim forward and backward against fp32, and timings) is
``benchmarks/gpu/probe_kernels.py``; results in ``benchmarks/results/2026-11-23-h100-probe/``;
``tests/test_gpu_kernels.py`` re-checks the declarations on the GPU it runs on.

Rows that see no key come back from FA2 with lse = +inf; adapters turn that into -inf (our contract) and
turn -inf back into +inf before a backward call (exp(s - (+inf)) = 0 where exp(s - (-inf)) would be inf).

Note [Split bands in one pass]
    A bottom-right causal block whose keys outnumber its rows (pass-Q's own back chunk against the whole own
    block, a document's piece against its earlier keys) runs on cuDNN as a full call and a top-left causal call
    (``causal_parts``). Their merge was six element-wise passes in fp32 (a widening copy, logaddexp, two exps, a
    multiply, an addcmul): 55 us beside two 30 us cuDNN calls at TokenRing's first step, 2K tokens per rank over 8
    (H100, ``benchmarks/gpu/probe_host.py``, 2026-11-26). ``merge_parts`` now merges them in one pass
    (``combine.merge_parts``: each part read once, the block's fp32 output written once), and the backward's dQ
    sums its parts the same way (``combine.sum_parts``); the values are the fp32 merge and sum they were. Since
    then the runner hands the kernel such a block as two tasks (Note [Split bands as tasks] in
    ``seqpar.kernels.executor``), so this merge serves only callers that run the kernel on a band directly
    (inference, calibration).

Note [Open bands backwards]
    A windowed ring's farthest step holds a band open to the right, ``Band(lo, None)``: its rows see the keys from
    a diagonal to the block's end (the sink window's rank at 2K tokens over 8 against the keys two ranks back: an
    upper triangle). cuDNN takes top-left causal masks only, so such a block ran on FA2, which computed it as the
    whole block (200 us forward, 393 us backward for a 2K triangle at GQA 32/8 on an H200, where cuDNN's causal 2K
    block is about a third of that; ``benchmarks/results/2026-11-28-h200-thirtieth/``). Read backwards - query rows
    and keys both reversed, row i to m - 1 - i, key j to n - 1 - j - the band is ``Band(None, n - m - lo)``: lo
    unbounded, which cuDNN serves as full keys and a causal rest (``causal_parts``). ``open_forward`` and
    ``open_backward`` flip the rows that see any key and the keys they see (``open_cut``), run the kernel on the
    reversed band and flip the results back; rows that see nothing get 0 and lse -inf, keys no row sees a zero
    gradient. The flips are copies of the block's inputs and results, a few percent of the call. Mask kind
    "open" (``seqpar.kernels.base.mask_kind``) lets selection tell these bands from windows.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict

import torch

from ..masks import Band, Mask, Varlen, bottom_right_window, fa2_exact
from ..numerics import acc_dtype
from ..types import AttnOutput
from . import combine, long_docs
from .base import Kernel, KernelCall, band_of, register
from .combine import host_table

__all__ = ["CudnnKernel", "EfficientKernel", "FlashKernel", "causal_parts", "cudnn_max_head_dim", "fa2_pieces",
           "merge_parts", "open_backward", "open_cut", "open_forward", "pad_dim", "pieces_backward", "pieces_forward",
           "split_backward"]

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_INF = float("inf")
_NAN = float("nan")


def _t(x: torch.Tensor) -> torch.Tensor:
    """``(B, S, H, D)`` <-> ``(B, H, S, D)`` view."""
    return x.transpose(1, 2)


@functools.lru_cache(maxsize=1)
def cudnn_max_head_dim() -> int:
    """256 on compute capability >= 9.0 (probed forward and backward, Dv != D included), else 128."""
    if not torch.cuda.is_available():
        return 128
    return 256 if torch.cuda.get_device_capability()[0] >= 9 else 128


def _gpu_reasons(call: KernelCall, dtypes: tuple[torch.dtype, ...], max_dim: int) -> list[str]:
    r = []
    if call.device != "cuda":
        r.append(f"runs on CUDA only, got device {call.device!r}")
    if call.dtype not in dtypes:
        r.append(f"dtype must be one of {[str(d) for d in dtypes]}, got {call.dtype}")
    for what, d in (("head_dim", call.head_dim), ("value head_dim", call.dv)):
        if d > max_dim or d % 8:
            r.append(f"{what} must be a multiple of 8 up to {max_dim}, got {d}")
    if call.softcap:
        r.append("no score capping (softcap); use flex, flash_attn or flash_attn3")
    return r


def pad_dim(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` with its last dim zero-padded to ``n`` (a copy) or ``x`` itself."""
    return x if x.shape[-1] == n else torch.nn.functional.pad(x, (0, n - x.shape[-1]))


def causal_parts(band: Band, n: int) -> list[tuple[slice, bool]]:
    """A band with ``lo`` unbounded as (key slice, top-left causal?) calls: full keys [0, hi) + causal rest."""
    if band.is_full:
        return [(slice(0, n), False)]
    assert band.lo is None and band.hi is not None and band.hi >= 0
    if band.hi == 0:
        return [(slice(0, n), True)]
    return [(slice(0, band.hi), False), (slice(band.hi, n), True)]


def open_cut(band: Band, m: int, n: int) -> tuple[int, int, int, Band] | None:
    """An open band (``lo`` bounded, ``hi`` unbounded) on an m x n block read backwards (Note [Open bands
    backwards]): ``(rows, k0, k1, reversed)`` - query rows ``[0, rows)`` see keys ``[k0, k1)``, and with both
    reversed the band is ``reversed`` (lo unbounded, top-left aligned on the cut); None when no row sees a key."""
    cut = _trimmed(Band(None, n - m - band.lo), 0, m, n)
    if cut is None:
        return None
    r0, _, k0, k1, reversed_ = cut
    if reversed_.hi >= k1 - k0 - 1:                 # its first row sees every key it keeps: all rows do
        reversed_ = Band()
    return m - r0, n - k1, n - k0, reversed_


def open_forward(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band) -> AttnOutput:
    """``band``, open to the right, as ``fn(q, k, v, reversed_band) -> AttnOutput`` on the reversed rows and keys
    (Note [Open bands backwards]); rows that see nothing at 0 and lse -inf."""
    B, m, H, _ = q.shape
    cut = open_cut(band, m, k.shape[1])
    if cut is not None:
        rows, k0, k1, rb = cut
        res = fn(q[:, :rows].flip(1), k[:, k0:k1].flip(1), v[:, k0:k1].flip(1), rb)
        o, lse = res.out.flip(1), res.lse.flip(-1)
        if rows == m:
            return AttnOutput(o, lse)
    out = q.new_zeros(B, m, H, v.shape[-1])
    full = torch.full((B, H, m), -_INF, dtype=acc_dtype(q.dtype) if cut is None else lse.dtype, device=q.device)
    if cut is not None:
        out[:, :rows], full[:, :, :rows] = o, lse
    return AttnOutput(out, full)


def open_backward(fn, do, q, k, v, out, lse, band: Band) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``open_forward``'s block: ``fn(do, q, k, v, out, lse, reversed_band)`` on the reversed
    rows and keys, flipped back into place; zero where no row or key takes part."""
    m, n = q.shape[1], k.shape[1]
    cut = open_cut(band, m, n)
    if cut is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows, k0, k1, rb = cut
    r = slice(0, rows)
    g = fn(do[:, r].flip(1), q[:, r].flip(1), k[:, k0:k1].flip(1), v[:, k0:k1].flip(1), out[:, r].flip(1),
           lse[..., r].flip(-1), rb)

    def placed(x: torch.Tensor, whole: torch.Tensor, a: int, b: int) -> torch.Tensor:
        x = x.flip(1)
        if (a, b) == (0, whole.shape[1]):
            return x
        z = torch.zeros_like(whole)
        z[:, a:b] = x
        return z
    return placed(g[0], q, 0, rows), placed(g[1], k, k0, k1), placed(g[2], v, k0, k1)


def merge_parts(parts: list[AttnOutput]) -> AttnOutput:
    """The calls of a split band (``causal_parts``: the same query rows against disjoint keys) as one block's
    result, merged in one pass in fp32 (Note [Split bands in one pass])."""
    if len(parts) == 1:
        return parts[0]
    B, S, H, Dv = parts[0].out.shape
    whole = slice(0, S)
    out, lse = combine.merge_parts([(whole, p.out, p.lse) for p in parts], (B, S, H, Dv), acc_dtype(parts[0].out.dtype))
    return AttnOutput(out, lse)


def split_backward(fn, do, q, k, v, out, lse, band: Band):
    """Backward of a split band: dq sums over parts (one pass, Note [Split bands in one pass]), dk/dv concatenate
    along keys."""
    grads = [fn(do, q, k[:, ks], v[:, ks], out, lse, causal) for ks, causal in causal_parts(band, k.shape[1])]
    if len(grads) == 1:
        return grads[0]
    whole = slice(0, q.shape[1])
    dq = combine.sum_parts([(whole, g[0]) for g in grads], tuple(q.shape), acc_dtype(q.dtype))
    return dq, torch.cat([g[1] for g in grads], 1), torch.cat([g[2] for g in grads], 1)


# Note [FA2's capped windows]
#     FA2 clamps a window side to the key length: a side of ``n`` keys or more becomes unbounded (-1), and with the
#     other side bounded an unbounded side becomes ``n`` (flash_api.cpp: ``window_size_right = seqlen_k``). Bottom-
#     right alignment puts query i on key diagonal ``i + n - m``, so a right side of ``n`` reaches key ``i + 2n - m``:
#     every key only when m <= n + 1. A trimmed band (``lo <= n - m <= hi``, Note [Block planning]) with more query
#     rows than keys + 1 and a right side of ``n`` or more - a query run against a short key run to its left, under
#     a window: a windowed span's image rows against the tokens before it - lost the keys beyond the clamp in its top
#     rows (on an H100: rows 10-110 of a 100-token window against the 10 tokens before an image, out off by 3.3).
#     Such a band runs as at most three row ranges, each a window FA2 keeps (``fa2_pieces``): the rows that see
#     every key (one unwindowed call), the rows above them (their right side below the diagonal's reach) and the
#     rows below (their left side); the ranges share no row, so outputs land in place and only dK/dV add up.


def _trimmed(band: Band, r0: int, r1: int, n: int) -> tuple[int, int, int, int, Band] | None:
    """Rows ``[r0, r1)`` of ``band`` (on n keys) cut to the rows and keys they see, the band in the cut's own
    coordinates; None when they see nothing."""
    lo, hi = band.lo, band.hi
    if lo is not None:
        r1 = min(r1, n - lo)                      # rows past it start beyond the last key
    if hi is not None:
        r0 = max(r0, -hi)                         # rows before it end before the first key
    if r0 >= r1:
        return None
    k0 = 0 if lo is None else max(0, r0 + lo)
    k1 = n if hi is None else min(n, r1 + hi)
    d = r0 - k0
    return r0, r1, k0, k1, Band(None if lo is None else lo + d, None if hi is None else hi + d)


def fa2_pieces(band: Band, m: int, n: int) -> tuple[tuple[int, int, int, int, Band], ...] | None:
    """None when FA2 serves ``band`` on an m x n block as one call (the check every FA2 call makes: arithmetic only);
    else ``(r0, r1, k0, k1, band)`` row ranges, disjoint, each a window FA2 serves (Note [FA2's capped windows])."""
    return None if fa2_exact(band, m, n) else _ranges(band, m, n)


@functools.lru_cache(maxsize=256)
def _ranges(band: Band, m: int, n: int) -> tuple[tuple[int, int, int, int, Band], ...]:
    f0 = 0 if band.hi is None else max(0, n - 1 - band.hi)      # the rows that see every key: [f0, f1)
    f1 = m if band.lo is None else min(m, 1 - band.lo)
    assert f0 < f1, (band, m, n)                    # a clamped trimmed band has such rows
    out = [_trimmed(band, 0, f0, n), (f0, f1, 0, n, Band()), _trimmed(band, f1, m, n)]
    pieces = tuple(p for p in out if p is not None)
    assert all(fa2_exact(b, r1 - r0, k1 - k0) for r0, r1, k0, k1, b in pieces), (band, m, n, pieces)
    return pieces


def pieces_forward(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces) -> AttnOutput:
    """A block as ``fa2_pieces``' row ranges, ``fn(q, k, v, band) -> AttnOutput`` on each: outputs in place, rows
    no range holds at 0 and -inf."""
    B, m, H, _ = q.shape
    out = q.new_zeros(B, m, H, v.shape[-1])
    lse = torch.full((B, H, m), -_INF, dtype=acc_dtype(q.dtype), device=q.device)
    for r0, r1, k0, k1, band in pieces:
        o, lp = fn(q[:, r0:r1], k[:, k0:k1], v[:, k0:k1], band)
        out[:, r0:r1], lse[:, :, r0:r1] = o, lp
    return AttnOutput(out, lse)


def pieces_backward(fn, do, q, k, v, out, lse, pieces) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``pieces_forward``'s block, ``fn(do, q, k, v, out, lse, band)`` on each range, summed once
    each (``combine.sum_parts``: dQ's ranges are disjoint, dK's and dV's overlap) in the inputs' dtypes."""
    grads = [((r0, r1, k0, k1), fn(do[:, r0:r1], q[:, r0:r1], k[:, k0:k1], v[:, k0:k1], out[:, r0:r1],
                                   lse[:, :, r0:r1], band)) for r0, r1, k0, k1, band in pieces]
    return (combine.sum_parts([(slice(r0, r1), g[0]) for (r0, r1, _, _), g in grads], tuple(q.shape), q.dtype),
            *(combine.sum_parts([(slice(k0, k1), g[i]) for (_, _, k0, k1), g in grads], tuple(x.shape), x.dtype)
              for i, x in ((1, k), (2, v))))


@contextlib.contextmanager
def _deterministic(on: bool):
    """FA2's backward reads PyTorch's global deterministic flag; set it for one call only."""
    if not on or torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


class CudnnKernel(Kernel):
    """cuDNN attention (``aten._scaled_dot_product_cudnn_attention``): full and causal blocks, GQA native."""

    name = "cudnn"
    splits_bands = True
    auto_rank = {"cuda": 90}
    plans_per_shape = True              # Note [Plans per shape]

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        r = _gpu_reasons(call, _HALF, cudnn_max_head_dim())
        if call.mask not in ("full", "causal", "open"):
            r.append(f"no {call.mask} masks from Python (top-left causal only); use flash or flex")
        if call.deterministic:
            r.append("its backward is not deterministic")
        if call.single:
            r.append("cuDNN rejects a 1 x 1 block (s_q = s_kv = 1) in backward")
        if call.device == "cuda" and not torch.backends.cudnn.is_available():
            r.append("this PyTorch build has no cuDNN")
        return r

    @staticmethod
    def _fwd(q, k, v, causal: bool, scale: float) -> AttnOutput:
        res = aten._scaled_dot_product_cudnn_attention(_t(q), _t(k), _t(v), None, True, 0.0, causal, False,
                                                       scale=scale)
        return AttnOutput(_t(res[0]), res[1].squeeze(-1))

    @staticmethod
    def _bwd(do, q, k, v, out, lse, causal: bool, *, scale: float):
        lse4 = lse.contiguous().unsqueeze(-1)
        seed = torch.empty(0, dtype=torch.int64, device=q.device)        # dropout is 0: never read
        g = aten._scaled_dot_product_cudnn_attention_backward(
            _t(do), _t(q), _t(k), _t(v), _t(out), lse4, seed, seed, None, None, None,
            q.shape[1], k.shape[1], 0.0, causal, scale=scale)
        return _t(g[0]), _t(g[1]), _t(g[2])

    def direct(self, mask: Mask) -> bool:
        return isinstance(mask, Band) and (mask.is_full or (mask.lo is None and mask.hi == 0))

    def autograd_forward(self, q, k, v, mask: Mask, scale: float) -> torch.Tensor:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        res = aten._scaled_dot_product_cudnn_attention(_t(q), _t(k), _t(v), None, grad, 0.0, not band_of(mask).is_full,
                                                       False, scale=scale)
        return _t(res[0])

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        band = band_of(mask)
        if band.lo is not None:                                 # Note [Open bands backwards]
            return open_forward(lambda *a: self.forward(*a, scale), q, k, v, band)
        return merge_parts([self._fwd(q, k[:, ks], v[:, ks], causal, scale)
                             for ks, causal in causal_parts(band, k.shape[1])])

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        band = band_of(mask)
        if band.lo is not None:
            return open_backward(lambda *a: self.backward(*a, scale), do, q, k, v, out, lse, band)
        return split_backward(lambda *a: self._bwd(*a, scale=scale), do, q, k, v, out, lse, band)


CU_TENSORS = 128
"""Varlen offset tensors kept (``_cu_tensor``), least recently used dropped first."""
_CU: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_CU_LOCK = threading.Lock()


def _cu_tensor(cu: tuple[int, ...], batch: int, stride: int, device: torch.device) -> torch.Tensor:
    """Varlen offsets for ``batch`` packed copies of one row layout (``stride`` rows each), int32. Cached for the
    calls of one packed batch (a ring step's query and key offsets, forward and backward: 2 per step; a masked
    call's document pieces add more); a batch that is gone leaves at most ``CU_TENSORS`` small tensors behind.
    A miss is copied through pinned memory without blocking (``combine.host_table``: no wait for the device
    queue inside a ring step, and legal inside a CUDA graph capture, whose miss is not cached: the graph owns
    it, Note [Tables under capture])."""
    key = (cu, batch, stride, device)
    with _CU_LOCK:
        hit = _CU.get(key)
        if hit is not None:
            _CU.move_to_end(key)
            return hit
    host = torch.tensor([c + b * stride for b in range(batch) for c in (cu if b == 0 else cu[1:])],
                        dtype=torch.int32)
    if device.type != "cuda":
        return host
    t = host_table(host, device)
    if torch.cuda.is_current_stream_capturing():
        return t
    with _CU_LOCK:
        _CU[key] = t
        while len(_CU) > CU_TENSORS:
            _CU.popitem(last=False)
    return t


def _rng(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(2, dtype=torch.int64, device=device), torch.empty(0, device=device)


@functools.lru_cache(maxsize=64)
def _serves(kernel: Kernel, call: KernelCall) -> bool:
    return not kernel.not_supported_reasons(call)


class FlashKernel(Kernel):
    """FlashAttention-2 inside PyTorch (``aten._flash_attention_forward``): bands, varlen, GQA native."""

    name = "flash"
    auto_rank = {"cuda": 70}

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        r = _gpu_reasons(call, _HALF, 256)
        if call.mask in ("mod", "joined"):
            r.append(f"a {call.mask} block runs on flex (GPU) or the reference kernel")
        return r

    @staticmethod
    def _padded(q, k, v):
        """FA2 needs one head dim for q, k and v: zero-pad the smaller (zeros change no score, no output)."""
        n = max(q.shape[-1], v.shape[-1])
        return pad_dim(q, n), pad_dim(k, n), pad_dim(v, n)

    @staticmethod
    def _window(mask: Mask, m: int, n: int) -> tuple[bool, int | None, int | None]:
        left, right = mask.window if isinstance(mask, Varlen) else bottom_right_window(mask, m, n)
        if (left, right) == (-1, 0):
            return True, None, None
        return False, (None if left < 0 else left), (None if right < 0 else right)

    @staticmethod
    def _packed(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def direct(self, mask: Mask) -> bool:
        return isinstance(mask, Band)

    def autograd_forward(self, q, k, v, mask: Mask, scale: float) -> torch.Tensor:
        if q.shape[-1] != v.shape[-1]:
            raise NotImplementedError("FA2's differentiable op needs one head dim; use the kernel path")
        m, n = q.shape[1], k.shape[1]
        if not fa2_exact(mask, m, n):
            raise NotImplementedError(f"FA2's differentiable op cannot hold {mask} on {m} x {n}; use the kernel path")
        causal, wl, wr = self._window(mask, m, n)
        return aten._flash_attention_forward(q, k, v, None, None, m, n, 0.0, causal, False, scale=scale,
                                             window_size_left=wl, window_size_right=wr)[0]

    beside: str = "flash"
    """The kernel of a varlen call's long documents (Note [Long documents in few heads]): "flash" (this one),
    "cudnn" (block shapes recur) or "cudnn-buckets" (square documents at bucket lengths, Note [Documents alone in
    buckets]); ``for_call`` picks the variant."""

    def for_call(self, call: KernelCall, *, named: bool = False) -> FlashKernel:
        """Under ``auto`` or ``sdpa`` the variant whose long documents may run on cuDNN (by exact shape where the
        call's block shapes recur, in buckets where they vary); named, this one: no other kernel serves any of
        the call."""
        if named:
            return self
        return _FLASH_BUCKETS if call.shapes_vary else _FLASH_CUDNN

    def _alone(self, mask: Mask, q: torch.Tensor, k: torch.Tensor, deterministic: bool
               ) -> tuple[long_docs.Alone | None, str]:
        """A varlen call's long documents, to run alone beside it (Note [Long documents in few heads]), and what
        runs them: "cudnn", "cudnn-buckets" (both: ``beside``, where cuDNN serves) or "flash". A call with nothing
        to take out pays two cache lookups (a windowed or non-varlen one, none: ``plan``'s key hashes the offsets)."""
        n = long_docs.slots(q.device) if isinstance(mask, Varlen) and mask.window == (-1, 0) else 0
        alone = long_docs.plan(mask, q.shape[2], n) if n else None
        if alone is None:
            return None, "flash"
        side = "flash"
        if self.beside != "flash" and _serves(_CUDNN, KernelCall.of(q, k, Band(None, 0), deterministic)):
            side = self.beside
        return (alone if side == "cudnn" else long_docs.plan(mask, q.shape[2], n, True)), side

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        alone, side = self._alone(mask, q, k, False)
        if alone is None:
            return self._forward(q, k, v, mask, scale)
        fa2 = lambda *a: self._forward(*a, scale)                                          # noqa: E731
        cudnn = lambda *a: _CUDNN.forward(*a, scale)                                        # noqa: E731
        beside = {"flash": fa2, "cudnn": cudnn,
                  "cudnn-buckets": lambda q_, k_, v_, band: long_docs.padded_forward(cudnn, q_, k_, v_)}[side]
        return long_docs.forward(fa2, beside, q, k, v, alone)

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        alone, side = self._alone(mask, q, k, deterministic)
        if alone is None:
            return self._backward(do, q, k, v, out, lse, mask, scale, deterministic)
        fa2 = lambda *a: self._backward(*a, scale, deterministic)                           # noqa: E731
        cudnn = lambda *a: _CUDNN.backward(*a, scale)                                       # noqa: E731
        beside = {"flash": fa2, "cudnn": cudnn,
                  "cudnn-buckets": lambda *a: long_docs.padded_backward(cudnn, *a[:6])}[side]
        return long_docs.backward(fa2, beside, do, q, k, v, out, lse, alone)

    def _forward(self, q, k, v, mask: Mask, scale: float) -> AttnOutput:
        B, m, H, _ = q.shape
        n, dv = k.shape[1], v.shape[-1]
        causal, wl, wr = self._window(mask, m, n)
        if isinstance(mask, Band) and (pieces := fa2_pieces(mask, m, n)) is not None:
            return pieces_forward(lambda *a: self._forward(*a, scale), q, k, v, pieces)
        q, k, v = self._padded(q, k, v)
        if isinstance(mask, Band):
            o, lse, *_ = aten._flash_attention_forward(q, k, v, None, None, m, n, 0.0, causal, False, scale=scale,
                                                        window_size_left=wl, window_size_right=wr)
            return AttnOutput(o[..., :dv], lse)
        cq, ck = _cu_tensor(mask.cu_q, B, m, q.device), _cu_tensor(mask.cu_k, B, n, q.device)
        o, lse, *_ = aten._flash_attention_forward(self._packed(q), self._packed(k), self._packed(v), cq, ck,
                                                    mask.max_q, mask.max_k, 0.0, causal, False, scale=scale,
                                                    window_size_left=wl, window_size_right=wr)
        lse = lse.reshape(H, B, m).permute(1, 0, 2).nan_to_num_(nan=_NAN, posinf=-_INF, neginf=-_INF)  # no keys: -inf
        return AttnOutput(o.reshape(B, m, H, -1)[..., :dv], lse)

    def _backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, deterministic: bool):
        B, m, H, d = q.shape
        n, dv = k.shape[1], v.shape[-1]
        if isinstance(mask, Band) and (pieces := fa2_pieces(mask, m, n)) is not None:
            return pieces_backward(lambda *a: self._backward(*a, scale, deterministic), do, q, k, v, out, lse, pieces)
        causal, wl, wr = self._window(mask, m, n)
        rng, unused = _rng(q.device)
        lse_k = lse.nan_to_num(nan=_NAN, posinf=_INF, neginf=_INF)      # one kernel: a row seeing nothing is +inf
        q, k, v = self._padded(q, k, v)
        do, out = pad_dim(do, q.shape[-1]), pad_dim(out, q.shape[-1])
        with _deterministic(deterministic):
            if isinstance(mask, Band):
                g = aten._flash_attention_backward(do, q, k, v, out, lse_k.contiguous(), None, None, m, n, 0.0,
                                                   causal, rng, unused, scale=scale, window_size_left=wl,
                                                   window_size_right=wr)
                return g[0][..., :d], g[1][..., :d], g[2][..., :dv]
            cq, ck = _cu_tensor(mask.cu_q, B, m, q.device), _cu_tensor(mask.cu_k, B, n, q.device)
            g = aten._flash_attention_backward(
                self._packed(do), self._packed(q), self._packed(k), self._packed(v), self._packed(out),
                lse_k.permute(1, 0, 2).reshape(H, B * m).contiguous(), cq, ck, mask.max_q, mask.max_k, 0.0,
                causal, rng, unused, scale=scale, window_size_left=wl, window_size_right=wr)
        return (g[0].reshape(q.shape)[..., :d], g[1].reshape(k.shape)[..., :d], g[2].reshape(v.shape)[..., :dv])


class EfficientKernel(Kernel):
    """Memory-efficient attention (``aten._scaled_dot_product_efficient_attention``): the fp32 path on GPU.

    Full and causal blocks; GQA by replicating KV heads locally (a copy, fp32 correctness runs only).
    Half precision is refused: through these entry points it gave non-finite dq and an illegal memory access
    on H100 (torch 2.11) in our conformance test, and cudnn / flash serve half precision faster anyway.
    """

    name = "efficient"
    splits_bands = True
    auto_rank = {"cuda": 20}

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        r = _gpu_reasons(call, (torch.float32,), 256)
        if call.mask not in ("full", "causal"):
            r.append(f"no {call.mask} masks through this entry point; use flash or flex")
        if call.deterministic:
            r.append("its backward is not deterministic")
        return r

    @staticmethod
    def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
        return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)

    def _fwd(self, q, k, v, causal: bool, scale: float) -> AttnOutput:
        H = q.shape[2]
        o, lse, *_ = aten._scaled_dot_product_efficient_attention(_t(q), _t(self._expand(k, H)),
                                                                   _t(self._expand(v, H)), None, True, 0.0, causal,
                                                                   scale=scale)
        return AttnOutput(_t(o), lse[:, :, : q.shape[1]])

    def _bwd(self, do, q, k, v, out, lse, causal: bool, scale: float):
        B, m, H, _ = q.shape
        g = k.shape[2]
        lse_pad = lse.new_zeros((B, H, -(-m // 32) * 32))       # the forward's padded layout; pad rows unused
        lse_pad[:, :, :m] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _t(do), _t(q), _t(self._expand(k, H)), _t(self._expand(v, H)), None, _t(out), lse_pad, seed, seed,
            0.0, [True, True, True, False], causal, scale=scale)
        dq, dk, dv = _t(dq), _t(dk), _t(dv)
        if g != H:
            dk = dk.unflatten(2, (g, H // g)).sum(3)
            dv = dv.unflatten(2, (g, H // g)).sum(3)
        return dq, dk, dv

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        return merge_parts([self._fwd(q, k[:, ks], v[:, ks], causal, scale)
                             for ks, causal in causal_parts(band_of(mask), k.shape[1])])

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        return split_backward(lambda *a: self._bwd(*a, scale), do, q, k, v, out, lse, band_of(mask))


_CUDNN = register(CudnnKernel())
register(FlashKernel())
register(EfficientKernel())


class _FlashBeside(FlashKernel):
    """``FlashKernel`` whose long documents may run alone on cuDNN (``FlashKernel.for_call``; not registered: the
    same kernel, named "flash")."""

    def __init__(self, beside: str):
        self.beside = beside


_FLASH_CUDNN = _FlashBeside("cudnn")
_FLASH_BUCKETS = _FlashBeside("cudnn-buckets")
