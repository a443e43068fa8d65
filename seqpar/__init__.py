"""seqpar: sequence-parallel (context-parallel) attention, forward and backward, checked against a dense oracle.

Entry points (start reading at ``seqpar/api.py``):

    seqpar.attention(q, k, v, mesh=..., method=..., layout=..., causal=...)   one attention layer over ranks
    seqpar.linear_attention(q, k, v, mesh=..., method="lasp2", decay=...)     linear attention over ranks (LASP-2)
    seqpar.shard / seqpar.unshard / seqpar.positions                         where tokens live
    seqpar.shard_info(seq_len, cu_seqlens=...)                               packed documents: RoPE positions,
                                                                             local segments, pad mask
    seqpar.verify(q, k, v, out, mesh=..., method=...)                        check a result on a dense sample
    seqpar.make_mesh(ulysses=U, ring=R)                                      a 2D mesh for USP
    seqpar.plan(seq_len=..., heads=..., world=...)                           which method to use, and why
    seqpar.SequenceParallelAttention(mesh, method=..., layout=...)           the same as an nn.Module
    seqpar.choose_pass(batch=..., q_len=..., heads=..., head_dim=...)        pass-KV (ring) or pass-Q (tokenring)
    seqpar.flash_api                                                         ring-flash-attn style names

Layers (imports run one way): api, flash_api, modules -> methods -> {kernels, comm, layouts, groups} -> types,
errors, masks, config. ``docs/DESIGN.md`` is the map.
"""

from __future__ import annotations

from typing import Any

from .api import ShardInfo, attention, positions, shard, shard_info, unshard, verify
from .config import AttentionConfig
from .errors import RankDisagreementError, UnsupportedInputError, VerificationError
from .flash_api import (
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
from .groups import SeqParallelGroups, make_mesh
from .inference import ShardedKVCache as ShardedKVCache  # long-context inference: seqpar.inference
from .linear_api import linear_attention, linear_methods
from .modules import (
    SequenceParallelAttention,
    SequenceParallelAttentionKVPacked,
    SequenceParallelAttentionQKVPacked,
)
from .passes import PassChoice, choose_pass
from .types import AttnOutput

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``seqpar.plan`` is ``seqpar.planner.plan``, imported on first use (``import seqpar`` stays light)."""
    if name == "plan":
        from .planner import plan

        return plan
    raise AttributeError(f"module 'seqpar' has no attribute {name!r}")


__all__ = [
    "AttentionConfig", "AttnOutput", "PassChoice", "RankDisagreementError", "SeqParallelGroups",
    "SequenceParallelAttention", "SequenceParallelAttentionKVPacked", "SequenceParallelAttentionQKVPacked",
    "ShardInfo", "UnsupportedInputError", "VerificationError", "attention", "choose_pass", "linear_attention",
    "linear_methods", "llama3_flash_attn_prepare_cu_seqlens", "llama3_flash_attn_varlen_func",
    "llama3_flash_attn_varlen_kvpacked_func", "llama3_flash_attn_varlen_qkvpacked_func", "make_mesh", "plan",
    "positions", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func", "ring_flash_attn_varlen_kvpacked_func", "ring_flash_attn_varlen_qkvpacked_func",
    "shard", "shard_info", "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func", "stripe_flash_attn_varlen_func", "stripe_flash_attn_varlen_kvpacked_func",
    "stripe_flash_attn_varlen_qkvpacked_func", "substitute_hf_flash_attn", "unshard", "update_ring_flash_attn_params",
    "verify", "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func", "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func", "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]
