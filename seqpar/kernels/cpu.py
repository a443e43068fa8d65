"""PyTorch's fused CPU attention (``aten._scaled_dot_product_flash_attention_for_cpu``): the CPU fast path.

It returns ``(out, lse)`` and has a backward that takes the final ``(out, lse)`` - exactly the kernel contract -
with GQA served natively (query head h reads KV head ``h // G``). Causal masks are aligned top-left, so like
cuDNN it serves full blocks and bands with ``lo`` unbounded (split into full keys ``[0, hi)`` and a top-left
causal square, merged in fp32), and bands open to the right read backwards (Note [Open bands backwards] in
``seqpar.kernels.sdpa``); windows and varlen blocks go to the reference kernel. One head dim for q, k
and v: a differing value head dim is zero-padded. Measured on the 2-core CI machine (B=1, 64 tokens, 4 heads,
head dim 16, causal): 29 us per forward against 150+ us for the reference kernel, the same as ``F.sdpa``.
``kernel="auto"`` ranks it first on CPU; ``deterministic=True`` keeps the reference kernel (its multi-threaded
backward's reduction order is not documented).
"""

from __future__ import annotations

import torch

from ..masks import Mask
from ..types import AttnOutput
from .base import Kernel, KernelCall, band_of, register
from .sdpa import causal_parts, merge_parts, open_backward, open_forward, pad_dim, split_backward

__all__ = ["CpuFlashKernel"]

aten = torch.ops.aten


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


class CpuFlashKernel(Kernel):
    """``_scaled_dot_product_flash_attention_for_cpu``: full and causal blocks on CPU, GQA native."""

    name = "cpu_flash"
    splits_bands = True
    auto_rank = {"cpu": 110}

    def not_supported_reasons(self, call: KernelCall) -> list[str]:
        r = []
        if call.device != "cpu":
            r.append(f"runs on CPU only, got device {call.device!r}")
        if call.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            r.append(f"dtype must be a float dtype, got {call.dtype}")
        if call.mask in ("band", "varlen", "mod"):
            r.append(f"no {call.mask} masks (top-left causal only); the reference kernel serves them")
        if call.softcap:
            r.append("no score capping (softcap)")
        if call.deterministic:
            r.append("its multi-threaded backward's reduction order is not documented as deterministic")
        return r

    @staticmethod
    def _fwd(q, k, v, causal: bool, scale: float) -> AttnOutput:
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(_t(q), _t(k), _t(v), 0.0, causal, scale=scale)
        return AttnOutput(_t(o), lse)

    @staticmethod
    def _bwd(do, q, k, v, out, lse, causal: bool, *, scale: float):
        g = aten._scaled_dot_product_flash_attention_for_cpu_backward(_t(do), _t(q), _t(k), _t(v), _t(out), lse,
                                                                     0.0, causal, scale=scale)
        return _t(g[0]), _t(g[1]), _t(g[2])

    def direct(self, mask: Mask) -> bool:
        band = band_of(mask)
        return band.is_full or (band.lo is None and band.hi == 0)

    def autograd_forward(self, q, k, v, mask: Mask, scale: float) -> torch.Tensor:
        if q.shape[-1] != v.shape[-1]:
            raise NotImplementedError("the CPU flash op needs one head dim; use the kernel path")
        o, _ = aten._scaled_dot_product_flash_attention_for_cpu(_t(q), _t(k), _t(v), 0.0, not band_of(mask).is_full,
                                                               scale=scale)
        return _t(o)

    def forward(self, q, k, v, mask: Mask, scale: float, *, softcap: float = 0.0) -> AttnOutput:
        dv = v.shape[-1]
        n = max(q.shape[-1], dv)
        q, k, v = pad_dim(q, n), pad_dim(k, n), pad_dim(v, n)
        band = band_of(mask)
        if band.lo is not None:                      # Note [Open bands backwards] in seqpar.kernels.sdpa
            res = open_forward(lambda *a: self.forward(*a, scale), q, k, v, band)
        else:
            res = merge_parts([self._fwd(q, k[:, ks], v[:, ks], causal, scale)
                               for ks, causal in causal_parts(band, k.shape[1])])
        return AttnOutput(res.out[..., :dv], res.lse)

    def backward(self, do, q, k, v, out, lse, mask: Mask, scale: float, *, delta=None, softcap=0.0,
                 deterministic=False):
        d, dv = q.shape[-1], v.shape[-1]
        n = max(d, dv)
        q, k, v, do, out = (pad_dim(x, n) for x in (q, k, v, do, out))
        band = band_of(mask)
        if band.lo is not None:
            dq, dk, dv_ = open_backward(lambda *a: self.backward(*a, scale), do, q, k, v, out, lse, band)
        else:
            dq, dk, dv_ = split_backward(lambda *a: self._bwd(*a, scale=scale), do, q, k, v, out, lse, band)
        return dq[..., :d], dk[..., :d], dv_[..., :dv]


register(CpuFlashKernel())
