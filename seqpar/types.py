"""Shared vocabulary: the result type, the shape-letter legend and the option enums.

Shape letters (used as suffixes on names wherever code reshapes, e.g. ``q_BSHD``):

    B    batch
    S    sequence length (global unless the name says local: ``L`` is a rank's local length)
    L    tokens held by one rank (S / W for an even split)
    H    query heads
    Hkv  key/value heads (H % Hkv == 0); G = H // Hkv query heads share one KV head
    D    head dimension
    W    ranks in the sequence-parallel group ("world"); U, R: Ulysses and ring degrees (W = U * R)

Vocabulary: "axis" is a mesh or group dimension, "dim" a tensor dimension. A "block" is a set of query rows
against a set of key rows; a "task" is one kernel call on a block; a "step" is one round of a schedule.

Tensor contract at every boundary: q, k, v, out are ``(B, S, H, D)`` (flash-attn's layout); every local
kernel returns ``AttnOutput(out, lse)`` with lse in fp32, natural log, shape ``(B, H, S)``; a query row that
sees no key has ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["AttnOutput"]


class AttnOutput(NamedTuple):
    """Attention result: ``out (B, S, H, D)`` and ``lse (B, H, S)`` (fp32, natural log)."""

    out: torch.Tensor
    lse: torch.Tensor

