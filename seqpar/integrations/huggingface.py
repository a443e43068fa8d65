"""transformers models on seqpar, through transformers' public attention registry.

    import seqpar.integrations.huggingface as sp_hf

    handle = sp_hf.enable(mesh, method="usp", layout="zigzag")        # registers attn_implementation "seqpar"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="seqpar")
    batch = handle.shard_batch(global_batch)        # this rank's tokens, global positions, shifted labels, docs
    loss = model(**batch).loss                      # this rank's share: local token-loss sum / global count
    loss.backward()
    sp_hf.all_reduce_gradients(model.parameters(), mesh)   # (or FSDP/DDP over the mesh: grad_reduction="mean")

The code lives in ``seqpar.integrations.hf`` (one job per module: ``attention``, ``batch``, ``loss``,
``grads``) and ``seqpar.integrations.hf_generate``; this module re-exports their public names. What the
attention function honours and refuses: ``seqpar.integrations.hf.attention``.

Activation memory: transformers' ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable``
before 5.2x) works unchanged: each decoder layer keeps only its input and is recomputed in backward, seqpar's
attention (and its communication) included; every rank recomputes in the same order, so the collectives pair
up. Use ``use_reentrant=False``. The logits are the other long-context peak: compute the loss from the final
hidden states with ``sequence_parallel_loss(..., chunk_size=...)`` (Note [Tiled loss]) instead of asking the
model for logits. ``examples/train_long_context.py`` combines both with FSDP2 over a data x sequence mesh.

Training with a KV cache: pass ``use_cache=False`` (or set ``config.use_cache = False``): a cache would keep
every layer's K and V alive for nothing, and decoding with one raises.
"""

from __future__ import annotations

from .hf import attention as _attention
from .hf.attention import DEFAULT_NAME, GRAPH_BREAK_REASON, Handle, enable, host_boundaries
from .hf.batch import batch_layout, shard_batch
from .hf.grads import all_reduce_gradients
from .hf.loss import SPLoss, reduce_loss, sequence_parallel_loss, token_loss_sum
from .hf_generate import SeqparCache, generate, prefill, serving

__all__ = ["DEFAULT_NAME", "GRAPH_BREAK_REASON", "Handle", "SPLoss", "SeqparCache", "all_reduce_gradients",
           "batch_layout", "enable", "generate", "host_boundaries", "prefill", "reduce_loss",
           "sequence_parallel_loss", "serving", "shard_batch", "token_loss_sum"]

# what seqpar.integrations.hf_ring_flash imports from here: the attention function's refusal lists and helpers
_BENIGN, _REFUSED, _UNSET = _attention._BENIGN, _attention._REFUSED, _attention._UNSET
_eager, _short, _window = _attention._eager, _attention._short, _attention._window
