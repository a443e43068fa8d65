"""``seqpar.attention`` as the compat adapters call it: excluded from torch.compile tracing.

Note [Compat adapters under torch.compile]
    A compiled caller (ring-flash-attn's tests compile every function they call) graph-breaks once at each
    adapter's attention call and runs seqpar eagerly there, as ``integrations.huggingface`` does: seqpar's
    schedules are host-side plans over collectives, and tracing into them costs seconds of compile time for a
    dozen graph breaks inside. Host reads of boundaries (``cu_seqlens`` tensors) are excluded the same way, so
    no Python branch ever sees an unbacked integer (``GuardOnDataDependentSymNode`` under
    ``capture_scalar_outputs``). Gradients flow through as in eager mode. When ``seqpar.attention`` traces as
    one operator, this exclusion is what to remove.
"""

from __future__ import annotations

import torch

from ..api import attention as _attention

__all__ = ["attention"]

REASON = "seqpar.compat: seqpar.attention runs eagerly (host-side schedules over collectives)"

try:
    attention = torch.compiler.disable(_attention, recursive=True, reason=REASON)
except TypeError:                          # torch < 2.8: no reason argument
    attention = torch.compiler.disable(_attention, recursive=True)
