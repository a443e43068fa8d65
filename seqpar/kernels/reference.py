"""The reference kernel: readable pure torch, any device and dtype, accumulating in fp32 (fp64 for fp64).

It is the oracle's building block and the CPU path of every method. GQA is computed by viewing the query
heads as ``(Hkv, G)`` groups against their KV head (broadcast, no copy). Masks are built from the call's
band (``j - i`` against ``[lo, hi]``); varlen runs one band call per segment. The value head dim may differ
from the key head dim; ``softcap > 0`` caps the scores as ``softcap * tanh(s / softcap)`` (Gemma 2), whose
derivative ``1 - tanh^2`` the backward applies to dS. It takes a precomputed Delta (``takes_delta``). On a
GPU ``kernel="auto"`` never picks it (it materialises the scores); name it to use it there.
"""

from __future__ import annotations

import torch

from ..masks.forms import Band, Mask, Modded, Varlen, dense
from ..numerics import acc_dtype
from ..types import AttnOutput
from .base import KERNELS, Kernel, KernelCall, register

__all__ = ["ReferenceKernel", "attention_reference"]


def _grouped(q_BSHD: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, S, H, D)`` -> ``(B, Hkv, G, S, D)`` in ``dtype``."""
    B, S, H, D = q_BSHD.shape
    return q_BSHD.to(dtype).reshape(B, S, kv_heads, H // kv_heads, D).permute(0, 2, 3, 1, 4)


def _ungrouped(x_BKGSD: torch.Tensor) -> torch.Tensor:
    """``(B, Hkv, G, S, D)`` -> ``(B, S, H, D)``."""
    B, K, G, S, D = x_BKGSD.shape
    return x_BKGSD.permute(0, 3, 1, 2, 4).reshape(B, S, K * G, D)


def _visible(mask: Band | Modded, m: int, n: int, device: torch.device) -> torch.Tensor | None:
    """Boolean ``(m, n)`` visibility of a band or ``Modded`` block, or None when everything is visible."""
    if isinstance(mask, Band) and mask.is_full:
        return None
    return dense(mask, m, n, device)


def _probs(q: torch.Tensor, k: torch.Tensor, band: Band | Modded, scale: float, lse: torch.Tensor | None,
           softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scores -> (probabilities ``(B, Hkv, G, Sq, Sk)``, lse ``(B, Hkv, G, Sq)``, d capped / d raw or None)
    in the accumulation dtype.

    With ``lse`` given (backward), probabilities are ``exp(s - lse)`` against that FINAL lse.
    """
    acc = acc_dtype(q.dtype)
    qg = _grouped(q, k.shape[2], acc)                               # (B, Hkv, G, Sq, D)
    kg = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)                 # (B, Hkv, 1, Sk, D)
    s = (qg @ kg.transpose(-1, -2)) * scale
    dcap = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1.0 - t * t
    vis = _visible(band, q.shape[1], k.shape[1], q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    if lse is None:
        B, H, Sq = q.shape[0], q.shape[2], q.shape[1]
        lse_g = torch.logsumexp(s, dim=-1)                          # -inf for rows that see nothing
    else:
        B, H, Sq = lse.shape
        lse_g = lse.to(acc).reshape(B, k.shape[2], H // k.shape[2], Sq)
    p = torch.exp(s - lse_g.unsqueeze(-1)).nan_to_num_(0.0)         # -inf - -inf rows -> 0, not NaN
    return p, lse_g, dcap


def _band_forward(q, k, v, band: Band, scale: float, softcap: float = 0.0) -> AttnOutput:
    p, lse_g, _ = _probs(q, k, band, scale, None, softcap)
    vg = v.to(p.dtype).permute(0, 2, 1, 3).unsqueeze(2)             # (B, Hkv, 1, Sk, D)
    out = _ungrouped(p @ vg)
    B, Hkv, G, Sq = lse_g.shape
    return AttnOutput(out, lse_g.reshape(B, Hkv * G, Sq))


def _band_backward(do, q, k, v, out, lse, band: Band, scale: float, delta, softcap: float = 0.0):
    p, _, dcap = _probs(q, k, band, scale, lse, softcap)            # (B, Hkv, G, Sq, Sk)
    acc = p.dtype
    Hkv = k.shape[2]
    dog = _grouped(do, Hkv, acc)                                    # (B, Hkv, G, Sq, D)
    vg = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    kg = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    if delta is None:
        delta = (do.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (B, H, Sq)
    B, H, Sq = delta.shape
    dg = delta.to(acc).reshape(B, Hkv, H // Hkv, Sq, 1)
    dv = (p.transpose(-1, -2) @ dog).sum(2)                         # (B, Hkv, Sk, D)
    ds = p * (dog @ vg.transpose(-1, -2) - dg)
    if dcap is not None:
        ds = ds * dcap
    dq = _ungrouped(ds @ kg) * scale
    qg = _grouped(q, Hkv, acc)
    dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
    return dq, dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


def _segments(mask: Varlen):
    """Each varlen segment as (query rows, key rows, Band) in the call's coordinates."""
    left, right = mask.window
    for s in range(len(mask.cu_q) - 1):
        qa, qb, ka, kb = mask.cu_q[s], mask.cu_q[s + 1], mask.cu_k[s], mask.cu_k[s + 1]
        if qa == qb or ka == kb:
            continue
        shift = (kb - ka) - (qb - qa)
        yield slice(qa, qb), slice(ka, kb), Band(None if left < 0 else shift - left,
                                                 None if right < 0 else shift + right)


class ReferenceKernel(Kernel):
    """Pure torch; serves every mask, dtype, head dim and device. The CPU path and the oracle's core."""

    name = "reference"
    auto_rank = {"cpu": 100}
    takes_delta = True
    grads_in_input_dtype = False

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        return []

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        if not isinstance(mask, Varlen):
            return _band_forward(q, k, v, mask, scale, softcap)
        acc = acc_dtype(q.dtype)
        B, Sq, H, _ = q.shape
        out = torch.zeros(B, Sq, H, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((B, H, Sq), float("-inf"), dtype=acc, device=q.device)
        for rq, rk, band in _segments(mask):
            o, l = _band_forward(q[:, rq], k[:, rk], v[:, rk], band, scale, softcap)
            out[:, rq], lse[:, :, rq] = o, l
        return AttnOutput(out, lse)

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        if not isinstance(mask, Varlen):
            return _band_backward(do, q, k, v, out, lse, mask, scale, delta, softcap)
        acc = acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for rq, rk, band in _segments(mask):
            g = _band_backward(do[:, rq], q[:, rq], k[:, rk], v[:, rk], None if out is None else out[:, rq],
                               lse[:, :, rq], band, scale, None if delta is None else delta[:, :, rq], softcap)
            dq[:, rq] += g[0]
            dk[:, rk] += g[1]
            dv[:, rk] += g[2]
        return dq, dk, dv


register(ReferenceKernel())


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                        scale: float | None = None, softcap: float = 0.0) -> AttnOutput:
    """One-call convenience: the reference forward with the default scale ``D ** -0.5``."""
    return KERNELS["reference"].forward(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale,
                                        softcap=softcap)
