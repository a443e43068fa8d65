"""yunchang 0.6.4's API on seqpar: change ``from yunchang import ...`` to ``from seqpar.compat.yunchang import ...``.

    set_seq_parallel_pg(U, R, rank, world_size)        yunchang's groups (``globals.PROCESS_GROUP``) and their mesh
    LongContextAttention(ring_impl_type=..., attn_type=...)   USP: seqpar.attention(method="usp")
    LongContextAttentionQKVPacked, AsyncLongContextAttention, UlyssesAttention
    ring_flash_attn_func, zigzag_ring_flash_attn_func, stripe_flash_attn_func (+ kvpacked, qkvpacked, varlen)
    EXTRACT_FUNC_DICT / basic_, zigzag_, stripe_extract_local   the global tensor -> this rank's tokens
    AttnType (also ``seqpar.compat.yunchang.kernels.AttnType``)

Submodules mirror yunchang's import paths where users reach into them: ``kernels`` (``AttnType``), ``globals``
(``PROCESS_GROUP``, ``set_seq_parallel_pg``). How each argument maps to seqpar, and which values raise, is in
``layers`` (Note [How yunchang's arguments map]), ``kernels`` and ``ring``.
"""

from __future__ import annotations

from .extract_local import EXTRACT_FUNC_DICT, basic_extract_local, stripe_extract_local, zigzag_extract_local
from .globals import PROCESS_GROUP, set_seq_parallel_pg
from .kernels import AttnType
from .layers import AsyncLongContextAttention, LongContextAttention, LongContextAttentionQKVPacked, UlyssesAttention
from .ring import (
    RING_IMPL_DICT,
    RING_IMPL_QKVPACKED_DICT,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    ring_flash_attn_varlen_func,
    ring_flash_attn_varlen_kvpacked_func,
    ring_flash_attn_varlen_qkvpacked_func,
    ring_flashinfer_attn_func,
    ring_flashinfer_attn_kvpacked_func,
    ring_flashinfer_attn_qkvpacked_func,
    ring_npu_flash_attn_func,
    ring_pytorch_attn_func,
    stripe_flash_attn_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_varlen_func,
    zigzag_ring_flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "EXTRACT_FUNC_DICT", "PROCESS_GROUP", "RING_IMPL_DICT", "RING_IMPL_QKVPACKED_DICT", "AsyncLongContextAttention",
    "AttnType", "LongContextAttention", "LongContextAttentionQKVPacked", "UlyssesAttention", "basic_extract_local",
    "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
    "ring_flashinfer_attn_func", "ring_flashinfer_attn_kvpacked_func", "ring_flashinfer_attn_qkvpacked_func",
    "ring_npu_flash_attn_func", "ring_pytorch_attn_func", "set_seq_parallel_pg", "stripe_extract_local",
    "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "zigzag_extract_local", "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func", "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]
