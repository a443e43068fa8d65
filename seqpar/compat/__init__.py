"""The peers' names on seqpar: a user of ring-flash-attn or yunchang changes an import, nothing else.

    seqpar.compat.ring_flash_attn   ring-flash-attn 0.1.8: ``*_flash_attn_func`` (batch, varlen, llama3) with its
                                    per-rank ``cu_seqlens``, its llama3 prepare step, and its HF adapter
                                    (``substitute_hf_flash_attn``, ``update_ring_flash_attn_params``)
    seqpar.compat.yunchang          yunchang 0.6.4: ``set_seq_parallel_pg``, ``LongContextAttention`` (USP),
                                    ``UlyssesAttention``, its ring functions and ``EXTRACT_FUNC_DICT``

Each module is a thin adapter over the public ``seqpar.attention`` (plus ``seqpar.shard``-style index math):
no schedule, kernel or communication of its own. What each adapter does differently from its peer (always
because the peer is wrong or ignores an argument there) is listed in its module docstring.
"""
