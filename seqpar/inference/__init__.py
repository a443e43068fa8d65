"""Long-context inference over a sequence-sharded KV cache: prefill, extension and decode.

    cache = seqpar.ShardedKVCache(layers=L, batch=B, mesh=mesh)       # max_len=... for a static cache
    chunk = cache.begin_prefill(S, method="ring", layout="zigzag")     # a prompt, sharded like training
    out = seqpar.inference.attend(q, k, v, cache, layer)               # per layer: store k, v; attend q
    chunk = cache.begin_decode()                                       # then one token at a time
    out = seqpar.inference.attend(q, k, v, cache, layer)

Start reading at ``cache`` (Notes [Cache layout], [Chunks], [Sliding windows and eviction]), then ``attend``
(what runs for each chunk), ``extend`` (pass-KV and pass-Q over the cache), ``decode`` (the exact merge and the
graph-capturable static step) and ``choice`` (which pass, and why). Every local attention goes through
``_local.attend_block``. transformers' ``generate`` on top of this: ``seqpar.integrations.hf_generate``.
"""

from __future__ import annotations

from .attend import attend, attend_stored
from .cache import CacheSpec, Chunk, ShardedKVCache
from .choice import InferencePlan, PassDecision, choose_extend_pass, plan_inference
from .decode import StaticDecode

__all__ = ["CacheSpec", "Chunk", "InferencePlan", "PassDecision", "ShardedKVCache", "StaticDecode", "attend",
           "attend_stored", "choose_extend_pass", "plan_inference"]
