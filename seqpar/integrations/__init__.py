"""Integrations with other libraries. None imports its library before it is enabled.

    seqpar.integrations.huggingface   transformers models through the public ``AttentionInterface``:
                                       ``enable``, ``shard_batch``, ``sequence_parallel_loss``
    seqpar.integrations.dit           joint (text + image) attention for diffusion transformers, text
                                       replicated and image tokens sharded
    seqpar.integrations.hf_ring_flash  ring-flash-attn's HF adapter names (``seqpar.substitute_hf_flash_attn``,
                                       ``seqpar.update_ring_flash_attn_params``), through the same registry
"""
