"""Masks: the forms a kernel call applies (``Band``, ``Varlen``, ``Modded``, ``Joined``, ``Stacked``) and the masks
users pass.

``seqpar.attention(..., mask_mod=m)`` takes a named mask from this module (``chunked``, ``spans``,
``prefix_lm``, ``block_causal``, ``shared_prefix``, ``tree``, ``sink_window``: their block structure is declared,
Note [Masks as pieces]) or any flex-style ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on global positions
(evaluated per planned block, Note [Generic mask_mod]).
"""

from .forms import Band, Joined, Mask, Modded, Stacked, Varlen, bottom_right_window, dense, fa2_exact, run_positions
from .mod import ModMask
from .named import (
                    BlockCausal,
                    Chunked,
                    PieceMask,
                    SinkWindow,
                    Spans,
                    Tree,
                    block_causal,
                    chunked,
                    from_spec,
                    prefix_lm,
                    shared_prefix,
                    sink_window,
                    spans,
                    tree,
)

__all__ = ["Band", "BlockCausal", "Chunked", "Joined", "Mask", "ModMask", "Modded", "PieceMask", "SinkWindow", "Spans",
           "Stacked", "Tree", "Varlen", "block_causal", "bottom_right_window", "chunked", "dense", "fa2_exact",
           "from_spec", "prefix_lm", "run_positions", "shared_prefix", "sink_window", "spans", "tree"]
