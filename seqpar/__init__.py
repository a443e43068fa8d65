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
    seqpar.ShardedKVCache(layers=L, batch=B, mesh=mesh)                      long-context inference (prefill, decode)

Peers' names live under ``seqpar.compat`` (``seqpar.compat.ring_flash_attn``, ``seqpar.compat.yunchang``); the
ring-flash-attn names at the top level (``seqpar.zigzag_ring_flash_attn_func``, ...) still resolve, loaded on first
use, but are not part of ``__all__``. ``import seqpar`` loads no planner, compat, inference or integration module.

Layers (imports run one way): api, flash_api, modules -> methods -> {kernels, comm, layouts, groups} -> types,
errors, masks, config. ``docs/DESIGN.md`` is the map.
"""

from __future__ import annotations

from typing import Any

from .api import ShardInfo, attention, positions, shard, shard_info, unshard, verify
from .config import AttentionConfig
from .errors import RankDisagreementError, UnsupportedInputError, VerificationError
from .groups import SeqParallelGroups, make_mesh
from .linear_api import linear_attention, linear_methods
from .modules import (
    SequenceParallelAttention,
    SequenceParallelAttentionKVPacked,
    SequenceParallelAttentionQKVPacked,
)
from .passes import PassChoice, choose_pass
from .types import AttnOutput

__version__ = "0.1.0"


_LAZY = {"plan": ("planner", "plan"), "ShardedKVCache": ("inference", "ShardedKVCache")}
"""Public names loaded on first use, so ``import seqpar`` stays light: ``name -> (module, attribute)``."""
_SUBPACKAGES = frozenset({"bench", "compat", "flash_api", "inference", "integrations", "planner", "testing"})


def __getattr__(name: str) -> Any:
    """``seqpar.plan`` and ``seqpar.ShardedKVCache`` on first use; the ring-flash-attn names' old top-level
    address (their home is ``seqpar.compat.ring_flash_attn``)."""
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    if name in _SUBPACKAGES:                   # ``seqpar.inference.attend(...)`` after a plain ``import seqpar``
        return importlib.import_module(f".{name}", __name__)
    compat = importlib.import_module(".flash_api", __name__) if name.endswith(("_func", "_cu_seqlens", "_params")) \
        or name == "substitute_hf_flash_attn" else None
    if compat is not None and name in compat.__all__:
        return getattr(compat, name)
    raise AttributeError(f"module 'seqpar' has no attribute {name!r}")


__all__ = [
    "AttentionConfig", "AttnOutput", "PassChoice", "RankDisagreementError", "SeqParallelGroups",
    "SequenceParallelAttention", "SequenceParallelAttentionKVPacked", "SequenceParallelAttentionQKVPacked",
    "ShardInfo", "ShardedKVCache", "UnsupportedInputError", "VerificationError", "attention", "choose_pass",
    "linear_attention", "linear_methods", "make_mesh", "plan", "positions", "shard", "shard_info", "unshard", "verify",
]
