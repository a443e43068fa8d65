"""transformers models on seqpar, one job per module (``seqpar.integrations.huggingface`` re-exports them all):

    attention.py   ``enable`` and its ``Handle``: the attention function registered with transformers'
                   ``AttentionInterface`` (and the mask function), what it honours and refuses, under compile
    layers.py      what one layer attends to (layer types: full, sliding, chunked; Gemma 3's image spans), the
                   pieces of transformers' mask functions it knows, Llama 4's position-scaled queries
    batch.py       ``shard_batch``: this rank's share of a global batch; ``batch_layout``, the per-batch layout
    loss.py        ``sequence_parallel_loss`` (``token_loss_sum`` in chunks, ``reduce_loss`` over the group)
    grads.py       ``all_reduce_gradients`` over the sequence-parallel group

Imports run one way: attention -> layers, batch; loss -> grads; ``seqpar.integrations.hf_generate`` (generate over a
sharded KV cache) -> attention; ``huggingface`` -> all of them. Nothing here imports transformers at import time.
"""
