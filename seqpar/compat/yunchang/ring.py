"""yunchang's ring attention functions on seqpar (``from yunchang.ring import ...`` / ``from yunchang import ...``).

yunchang's signatures: ring-flash-attn's, with ``softcap`` after ``window_size`` and, for the batch names,
``attn_type`` and ``attn_processor`` at the end. ``attn_type`` picks the kernel (``kernels.seqpar_kernel``);
the layout follows the name (ring = contiguous, zigzag, stripe). ``return_attn_probs=True`` returns
``(out, lse, None)`` like yunchang; gradients come back in the input dtype (yunchang's basic ring returns dq in
bf16 and, in fp32, aliases a buffer the next step overwrites: PEERS.md §13 Y2, Y3) and the packed variants
work (Y1: yunchang's raise ``TypeError``). The varlen names are ring-flash-attn's
(Note [ring-flash-attn's varlen conventions] in ``seqpar.compat.ring_flash_attn``) with ``softcap``.

``ring_pytorch_attn_func`` is the basic ring on PyTorch's SDPA kernels: ``attn_type`` TORCH_* picks one, FA (its
default) means PyTorch's FlashAttention-2 (what yunchang runs); unlike yunchang's it honours every argument.
``ring_flashinfer_attn_*`` and ``ring_npu_flash_attn_func`` exist for their kernels, which seqpar does not have:
they raise, naming the seqpar function that computes the same attention.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import rank_suffix
from .. import ring_flash_attn as rfa
from .._eager import attention
from .kernels import AttnType, seqpar_kernel

__all__ = [
    "RING_IMPL_DICT", "RING_IMPL_QKVPACKED_DICT", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func", "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func", "ring_flashinfer_attn_func", "ring_flashinfer_attn_kvpacked_func",
    "ring_flashinfer_attn_qkvpacked_func", "ring_npu_flash_attn_func", "ring_pytorch_attn_func",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]


def _ring(layout: str, kernel: str, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
          deterministic, return_attn_probs, group):
    res = attention(q, k, v, mesh=group, method="ring", layout=layout, causal=causal, softmax_scale=softmax_scale,
                    kernel=kernel, window_size=tuple(window_size), softcap=softcap, dropout_p=dropout_p,
                    alibi_slopes=alibi_slopes, deterministic=deterministic, return_lse=True)
    return (res.out, res.lse, None) if return_attn_probs else res.out


def _family(layout: str):
    def func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
             softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
             alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False, group=None,
             attn_type: AttnType = AttnType.FA, attn_processor=None):
        """``q (b, s_local, h, d)``, ``k, v (b, s_local, h_kv, d)``."""
        return _ring(layout, seqpar_kernel(attn_type, attn_processor), q, k, v, dropout_p, softmax_scale, causal,
                     window_size, softcap, alibi_slopes, deterministic, return_attn_probs, group)

    def kvpacked(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                 causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                 deterministic: bool = False, return_attn_probs: bool = False, group=None,
                 attn_type: AttnType = AttnType.FA):
        """``kv (b, s_local, 2, h_kv, d)``."""
        return _ring(layout, seqpar_kernel(attn_type), q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale,
                     causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, group)

    def qkvpacked(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                  causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                  deterministic: bool = False, return_attn_probs: bool = False, group=None,
                  attn_type: AttnType = AttnType.FA):
        """``qkv (b, s_local, 3, h, d)``."""
        return _ring(layout, seqpar_kernel(attn_type), qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p,
                     softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                     group)

    for f, suffix in ((func, ""), (kvpacked, " (kv packed)"), (qkvpacked, " (qkv packed)")):
        f.__doc__ = f"yunchang's ring attention, {layout} layout{suffix}. " + (f.__doc__ or "")
    return func, kvpacked, qkvpacked


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = _family("contiguous")
zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func, zigzag_ring_flash_attn_qkvpacked_func = \
    _family("zigzag")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = _family("stripe")


def ring_pytorch_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                           softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False, group=None, attn_type: AttnType = AttnType.FA,
                           attn_processor=None):
    """The basic (contiguous) ring on one of PyTorch's SDPA kernels: ``attn_type`` TORCH_*, or FA = "flash"."""
    kernel = seqpar_kernel(attn_type, attn_processor)      # every type it accepts is FA or a PyTorch kernel
    return _ring("contiguous", "flash" if kernel == "auto" else kernel, q, k, v, dropout_p, softmax_scale, causal,
                 window_size, softcap, alibi_slopes, deterministic, return_attn_probs, group)


def _no_flashinfer(*args: Any, **kwargs: Any):
    """Raises: yunchang's FlashInfer ring; seqpar has no FlashInfer kernel (use the ``ring_flash_attn_*`` twin)."""
    raise NotImplementedError(f"ring_flashinfer_attn_* run FlashInfer's kernel, which seqpar does not have: "
                              f"ring_flash_attn_* (same arguments) computes the same attention on seqpar's kernels"
                              f"{rank_suffix()}")


ring_flashinfer_attn_func = ring_flashinfer_attn_kvpacked_func = ring_flashinfer_attn_qkvpacked_func = _no_flashinfer


def ring_npu_flash_attn_func(group, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_num: int | None = None,
                             input_layout: str = "BSND"):
    """Raises: yunchang's Ascend NPU ring; seqpar has no NPU kernel (``ring_flash_attn_func(q, k, v,
    group=group)`` computes the same non-causal attention)."""
    raise NotImplementedError(f"ring_npu_flash_attn_func runs Ascend's fused NPU kernel, which seqpar does not have: "
                              f"ring_flash_attn_func(q, k, v, group=group) computes the same attention"
                              f"{rank_suffix()}")


# ---- varlen: ring-flash-attn's per-rank conventions, with yunchang's softcap ----

def ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, max_seqlen=None,
                                dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                                window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                deterministic: bool = False, return_attn_probs: bool = False, group=None):
    """``seqpar.compat.ring_flash_attn.ring_flash_attn_varlen_func`` (this rank's ``cu_seqlens``) with softcap."""
    return rfa.ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                           window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                           softcap=softcap)


def ring_flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens, max_seqlen=None,
                                         dropout_p: float = 0.0, softmax_scale: float | None = None,
                                         causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                                         alibi_slopes=None, deterministic: bool = False,
                                         return_attn_probs: bool = False, group=None):
    """``kv (total_local, 2, h_kv, d)``."""
    return ring_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                                       causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                       group)


def ring_flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens, max_seqlen=None, dropout_p: float = 0.0,
                                          softmax_scale: float | None = None, causal: bool = False,
                                          window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                          deterministic: bool = False, return_attn_probs: bool = False, group=None):
    """``qkv (total_local, 3, h, d)``."""
    return ring_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p,
                                       softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                       return_attn_probs, group)


def zigzag_ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                                       max_seqlen=None, dropout_p: float = 0.0, softmax_scale: float | None = None,
                                       causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                                       alibi_slopes=None, deterministic: bool = False,
                                       return_attn_probs: bool = False, group=None):
    """``seqpar.compat.ring_flash_attn.zigzag_ring_flash_attn_varlen_func`` (per-rank ``cu_seqlens``) with softcap."""
    return rfa.zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                                  window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                                  softcap=softcap)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens, max_seqlen=None,
                                                 dropout_p: float = 0.0, softmax_scale: float | None = None,
                                                 causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                                                 alibi_slopes=None, deterministic: bool = False,
                                                 return_attn_probs: bool = False, group=None):
    """``qkv (total_local, 3, h, d)``."""
    return zigzag_ring_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, softcap, alibi_slopes,
                                              deterministic, return_attn_probs, group)


RING_IMPL_DICT = {
    "basic": ring_flash_attn_func,
    "zigzag": zigzag_ring_flash_attn_func,
    "strip": stripe_flash_attn_func,
    "basic_pytorch": ring_pytorch_attn_func,
    "basic_flashinfer": ring_flashinfer_attn_func,
    "basic_npu": ring_npu_flash_attn_func,
}
RING_IMPL_QKVPACKED_DICT = {
    "basic": ring_flash_attn_qkvpacked_func,
    "zigzag": zigzag_ring_flash_attn_qkvpacked_func,
    "strip": stripe_flash_attn_qkvpacked_func,
    "basic_flashinfer": ring_flashinfer_attn_qkvpacked_func,
}
