"""seqpar: sequence-parallel (context-parallel) attention, forward and backward, checked against a dense oracle.

Entry points (start reading at ``seqpar/api.py``):

    seqpar.attention(q, k, v, mesh=..., method=..., layout=..., causal=...)   one attention layer over ranks
    seqpar.shard / seqpar.unshard / seqpar.positions                         where tokens live
    seqpar.make_mesh(ulysses=U, ring=R)                                      a 2D mesh for USP
    seqpar.choose_pass(batch=..., q_len=..., heads=..., head_dim=...)        pass-KV (ring) or pass-Q (tokenring)
    seqpar.flash_api                                                         ring-flash-attn style names

Layers (imports run one way): api, flash_api -> methods -> {kernels, comm, layouts, groups} -> types,
errors, masks, config. ``docs/DESIGN.md`` is the map.
"""

from __future__ import annotations

from .api import attention, positions, shard, unshard
from .config import AttentionConfig
from .errors import UnsupportedInputError
from .flash_api import (
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
    stripe_flash_attn_func,
    stripe_flash_attn_kvpacked_func,
    stripe_flash_attn_qkvpacked_func,
    zigzag_ring_flash_attn_func,
    zigzag_ring_flash_attn_kvpacked_func,
    zigzag_ring_flash_attn_qkvpacked_func,
)
from .groups import SeqParallelGroups, make_mesh
from .passes import PassChoice, choose_pass
from .types import AttnOutput

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig", "AttnOutput", "PassChoice", "SeqParallelGroups", "UnsupportedInputError", "attention",
    "choose_pass", "make_mesh",
    "positions", "ring_flash_attn_func", "ring_flash_attn_kvpacked_func", "ring_flash_attn_qkvpacked_func",
    "shard", "stripe_flash_attn_func", "stripe_flash_attn_kvpacked_func", "stripe_flash_attn_qkvpacked_func",
    "unshard", "zigzag_ring_flash_attn_func", "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
]
