"""The one place this package computes attention on ONE rank: ``attend_block``.

Every local attention of ``seqpar.inference`` (prefill extension steps, decode slices, the static decode step)
goes through ``attend_block(q, k, v, mask, scale, kernel) -> AttnOutput``, so that when the kernel contract
changes (value head dim, softcap, a new backward) this module is the only one to re-point.

Two mask forms:

- ``Band`` / ``Varlen`` (``seqpar.masks``): host integers in the call's own coordinates, as the block planner
  gives them. Served by the kernel registry (``seqpar.kernels.select``): the named kernel or the best for
  ``kernel="auto"``, never a silent substitute.
- ``SlotMask``: a device-side ``(B, Sk)`` boolean, "key row j is visible to every query row of batch row b".
  The static decode step (Note [Static decode step] in ``decode``) needs it: which slots of a preallocated
  cache hold visible tokens changes every step, and a CUDA graph cannot bake host integers that change. No
  registered kernel takes device-side key masks yet, so this form is computed here in plain torch (scores in
  fp32, the reference kernel's rule for rows that see nothing). When the kernel contract grows a
  ``seqused_k``-style mask, this branch moves into the registry.

Note [Decode queries as rows]
    One query token against a KV head that G query heads share is a G-row problem against that head: the
    view ``(B, 1, Hkv * G, D) -> (B, G, Hkv, D)`` turns GQA decode into multi-head attention with G query rows
    and no mask among them, so every kernel reads each KV head once (no KV replication for GQA) and a kernel
    that serves only MHA serves it. ``attend_block`` applies it to every single-row call whose mask is full.

Note [Split keys for decode]
    A decode call has G query rows per KV head, so a fused kernel that parallelises over (batch, heads, query
    tiles) runs B * Hkv thread blocks: 2 on a GQA 8/2 model, each walking every key of the slice. At a 1M-token
    slice that left the GPU nearly idle (66 ms per token against transformers' 41 ms on one H100, whose FA2
    call splits the keys itself). So a long slice of batch 1 is cut into chunks of ``SPLIT_KEYS`` keys, read as
    a batch of chunks through a view of the cache (no copy), each chunk's ``(out, lse)`` from one kernel call,
    and the chunks merged exactly in fp32 by their lse (a flash-decoding split). Kernel-agnostic: whichever
    kernel serves the call serves the chunks.

Note [Decode kernel]
    A decode step's key count grows by one every token, and cuDNN builds an execution plan per shape: with
    ``kernel="auto"`` choosing cuDNN (the fastest for training shapes), every layer of every token paid a plan
    build, 1.13x transformers' decode time at a 32K context on one H100 where transformers' SDPA runs FA2.
    So for calls of one query token ``auto`` asks PyTorch's FA2 (``flash``) first, which launches directly
    and splits long key ranges itself, and takes the registry's choice only where FA2 cannot serve.

"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedInputError, rank_suffix
from ..kernels import Kernel, KernelCall, select
from ..masks import Band, Mask
from ..types import AttnOutput

__all__ = ["SPLIT_KEYS", "SlotMask", "attend_block"]

SPLIT_KEYS = 8192
"""Keys per chunk of a decode call (Note [Split keys for decode]); slices under twice this are not split."""


@dataclass(frozen=True, eq=False)
class SlotMask:
    """Key row j is visible to all query rows of batch row b iff ``visible_BK[b, j]`` (a device bool tensor)."""

    visible_BK: torch.Tensor


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask | SlotMask, scale: float,
                 kernel: str) -> AttnOutput:
    """Attention of ``q`` over ``k, v`` under ``mask`` on this rank.

    Args:
        q: ``(B, Sq, H, D)``, any strides with the last dim contiguous.
        k: ``(B, Sk, Hkv, D)``; ``H % Hkv == 0``.
        v: ``(B, Sk, Hkv, Dv)``.
        mask: ``Band``/``Varlen`` in the call's coordinates, or a ``SlotMask``.
        scale: logit scale.
        kernel: "auto" or a kernel name (``seqpar.kernels.available_kernels()``).

    Returns:
        ``AttnOutput(out (B, Sq, H, Dv), lse (B, H, Sq))``: out in fp32 or q's dtype, lse fp32 (fp64 for fp64);
        rows that see no key are ``(0, -inf)``.
    """
    if isinstance(mask, SlotMask):
        if kernel not in ("auto", "reference"):
            raise ValueError(f"kernel must be 'auto' or 'reference' for a device-side slot mask (no registered "
                             f"kernel takes one yet), got {kernel!r}{rank_suffix()}")
        return _slot_masked(q, k, v, mask.visible_BK, scale)
    if q.shape[1] == 1 and isinstance(mask, Band) and mask.is_full and k.shape[2] < q.shape[2]:
        return _as_rows(q, k, v, mask, scale, kernel)
    call = KernelCall.of(q, k, mask, value_dim=v.shape[-1])
    return (_decode_kernel(kernel, call) if q.shape[1] == 1 else select(kernel, call)).forward(q, k, v, mask, scale)


def _decode_kernel(kernel: str, call: KernelCall) -> Kernel:
    """The kernel of a one-token call (Note [Decode kernel])."""
    if kernel == "auto" and call.device == "cuda":
        try:
            return select("flash", call)
        except UnsupportedInputError:
            pass
    return select(kernel, call)


def _as_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Band, scale: float, kernel: str) -> AttnOutput:
    """One query token, GQA: the G query heads of each KV head as G rows (Note [Decode queries as rows]), long
    slices of batch 1 split into key chunks (Note [Split keys for decode])."""
    B, _, H, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // Hkv
    rows_BGKD = q.reshape(B, Hkv, G, D).transpose(1, 2)
    n = Sk // SPLIT_KEYS if B == 1 else 1
    if n < 2:
        out, lse = _decode_kernel(kernel, KernelCall.of(rows_BGKD, k, mask, value_dim=Dv)).forward(
            rows_BGKD, k, v, mask, scale)
        return AttnOutput(out.transpose(1, 2).reshape(B, 1, H, Dv), lse.reshape(B, H, 1))
    m = n * SPLIT_KEYS
    k_n, v_n = (x[:, :m].reshape(n, SPLIT_KEYS, Hkv, x.shape[-1]) for x in (k, v))     # views of the slice
    rows_n = rows_BGKD.expand(n, G, Hkv, D).contiguous()
    kern = _decode_kernel(kernel, KernelCall.of(rows_n, k_n, mask, value_dim=Dv))
    parts = [kern.forward(rows_n, k_n, v_n, mask, scale)]
    if m < Sk:
        tail = (k[:, m:], v[:, m:])
        parts.append(_decode_kernel(kernel, KernelCall.of(rows_BGKD, tail[0], mask, value_dim=Dv)).forward(
            rows_BGKD, *tail, mask, scale))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_nGKV = torch.cat([p.out for p in parts]).to(acc)
    lse_nKG = torch.cat([p.lse for p in parts]).to(acc)
    lse_KG = torch.logsumexp(lse_nKG, 0)
    w_nGK = torch.exp(lse_nKG - lse_KG).transpose(1, 2)
    out_GKV = (out_nGKV * w_nGK.unsqueeze(-1)).sum(0)
    return AttnOutput(out_GKV.transpose(0, 1).reshape(1, 1, H, Dv), lse_KG.reshape(1, H, 1))


def _bmm_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32 (fp64 for fp64), reading half-precision operands as they are
    on CUDA (``out_dtype``) instead of upcasting copies of the whole cache."""
    if a.dtype in (torch.float16, torch.bfloat16):
        if a.is_cuda:
            return torch.bmm(a, b, out_dtype=torch.float32)
        return torch.bmm(a.float(), b.float())
    return torch.bmm(a, b)


def _slot_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible_BK: torch.Tensor,
                 scale: float) -> AttnOutput:
    """Masked attention with the key mask on the device: static shapes, no host reads (graph-capturable).

    Query heads are grouped per KV head as rows (Note [Decode queries as rows]); K and V are read through
    views, never copied: the cache's sequence-major buffers ``(Sk, B, Hkv, D)`` make ``(B * Hkv, D, Sk)`` a
    strided batch a GEMM reads in place.
    """
    B, Sq, H, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hkv
    q_KRD = q.reshape(B, Sq, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B * Hkv, Sq * G, D)
    k_KDS = k.permute(0, 2, 3, 1).reshape(B * Hkv, D, Sk)
    v_KSD = v.permute(0, 2, 1, 3).reshape(B * Hkv, Sk, Dv)
    s = _bmm_acc(q_KRD, k_KDS).mul_(scale)                                       # (B * Hkv, Sq * G, Sk)
    hidden = ~visible_BK.view(B, 1, 1, Sk).expand(B, Hkv, 1, Sk).reshape(B * Hkv, 1, Sk)
    s.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                             # -inf where nothing is seen
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
    out = _bmm_acc(p.to(v.dtype) if v.dtype in (torch.float16, torch.bfloat16) else p, v_KSD)
    out_BSHD = out.reshape(B, Hkv, Sq, G, Dv).permute(0, 2, 1, 3, 4).reshape(B, Sq, H, Dv)
    lse_BHS = lse.reshape(B, Hkv, Sq, G).permute(0, 1, 3, 2).reshape(B, H, Sq)
    return AttnOutput(out_BSHD, lse_BHS)
