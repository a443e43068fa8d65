"""ring-flash-attn style names, kept at their first address: they live in ``seqpar.compat.ring_flash_attn``.

``from seqpar.flash_api import zigzag_ring_flash_attn_func`` and ``seqpar.zigzag_ring_flash_attn_func`` are the
same objects as ``seqpar.compat.ring_flash_attn.zigzag_ring_flash_attn_func``; the conventions (per-rank
``cu_seqlens``, ring-flash-attn's llama3 prepare step, the HF adapter) are documented there.
"""

from __future__ import annotations

from .compat.ring_flash_attn import (
    llama3_flash_attn_prepare_cu_seqlens,
    llama3_flash_attn_varlen_func,
    llama3_flash_attn_varlen_kvpacked_func,
    llama3_flash_attn_varlen_qkvpacked_func,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
    stripe_flash_attn_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    stripe_flash_attn_varlen_func,
    stripe_flash_attn_varlen_kvpacked_func,
    stripe_flash_attn_varlen_qkvpacked_func,
    substitute_hf_flash_attn,
    update_ring_flash_attn_params,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_kvpacked_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func", "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func", "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func", "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func", "stripe_flash_attn_varlen_func", "stripe_flash_attn_varlen_kvpacked_func",
    "stripe_flash_attn_varlen_qkvpacked_func", "substitute_hf_flash_attn", "update_ring_flash_attn_params",
    "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]
