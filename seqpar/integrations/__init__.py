"""Integrations with other libraries. Nothing here is imported by ``import seqpar``.

    seqpar.integrations.huggingface   transformers models through the public ``AttentionInterface``:
                                       ``enable``, ``shard_batch``, ``sequence_parallel_loss``
    seqpar.integrations.dit           joint (text + image) attention for diffusion transformers, text
                                       replicated and image tokens sharded
"""
