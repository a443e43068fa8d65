"""``AttentionConfig``: every option of one sequence-parallel attention call, validated once.

``seqpar.attention`` builds it from its keyword arguments; methods read it and never see raw kwargs.
Method-specific options (``heads_k_stride`` for allgather, ``node_size`` for double_ring, ...) travel in
``options`` and each method declares the ones it accepts: anything else is an error, never ignored.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import rank_suffix
from .layouts.blocks import Rule

__all__ = ["AttentionConfig", "balance_rule"]


def balance_rule(layout: str | None, causal: bool, mask: Any) -> Rule | None:
    """The rule ``balanced`` places tokens by: causal and a named mask's pieces (the same in ``seqpar.shard`` and
    ``seqpar.attention``); None (causal work) for other layouts, no mask, or a generic ``mask_mod``."""
    from .layouts import BALANCED_LAYOUTS
    from .masks.named import PieceMask

    return Rule(causal, mask=mask) if layout in BALANCED_LAYOUTS and isinstance(mask, PieceMask) else None


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """One call's options (frozen, hashable: schedules are cached on it)."""

    method: str = "ring"
    """Sequence-parallel method (``seqpar.methods.available()``)."""
    layout: str = "zigzag"
    """Token layout: "contiguous", "zigzag" or "stripe" (methods accept a subset)."""
    causal: bool = True
    """Causal masking in global positions (key position <= query position)."""
    window_size: tuple[int, int] = (-1, -1)
    """Sliding window ``(left, right)`` in global positions, flash-attn convention; -1 = unbounded."""
    softmax_scale: float | None = None
    """Logit scale; None means ``head_dim ** -0.5``."""
    kernel: str = "auto"
    """Local kernel name or "auto" (``seqpar.kernels.available_kernels()``)."""
    cu_seqlens: tuple[int, ...] | None = None
    """Global document boundaries (host ints, 0 first, total last): no attention across documents."""
    seq_len: int | None = None
    """Valid global length when the sharded tensors carry padding at the end (padding never leaks)."""
    deterministic: bool = False
    """Bitwise-reproducible results: fixed reduction orders and deterministic kernels only."""
    grad_dtype: torch.dtype = torch.float32
    """Dtype of gradient partials on the wire (dK/dV in pass-KV, dQ in pass-Q, reduce-scatters)."""
    softcap: float = 0.0
    """Score capping ``softcap * tanh(s / softcap)`` (Gemma 2); 0 = none."""
    mask: Any = None
    """A named mask or ``ModMask`` (``seqpar.masks``) ANDed with causal, window, documents and padding."""
    balance: str | None = None
    """What ``layout="balanced"`` balances: None - the work under a named ``mask`` (causal work without one);
    "causal" - causal work whatever the mask (layers with different masks sharing one placement)."""
    options: tuple[tuple[str, Any], ...] = field(default=())
    """Method-specific options as sorted ``(name, value)`` pairs (see ``option``)."""

    def __post_init__(self) -> None:
        w = self.window_size
        if (not isinstance(w, tuple) or len(w) != 2 or not all(isinstance(x, int) and x >= -1 for x in w)):
            raise ValueError(f"window_size must be a pair of ints >= -1, got {w!r}{rank_suffix()}")
        if self.softmax_scale is not None and not (isinstance(self.softmax_scale, (int, float))
                                                   and self.softmax_scale > 0):
            raise ValueError(f"softmax_scale must be a positive float or None, got {self.softmax_scale!r}"
                             f"{rank_suffix()}")
        if self.balance not in (None, "causal"):
            raise ValueError(f"balance must be None (the mask's work) or 'causal', got {self.balance!r}{rank_suffix()}")
        if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) or self.softcap < 0:
            raise ValueError(f"softcap must be a float >= 0 (0 = no capping), got {self.softcap!r}{rank_suffix()}")
        if self.grad_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"grad_dtype must be a floating dtype, got {self.grad_dtype}{rank_suffix()}")
        cu = self.cu_seqlens
        if cu is not None:
            if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
                raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {list(cu)[:12]}"
                                 f"{rank_suffix()}")
            if self.seq_len is not None and cu[-1] != self.seq_len:
                raise ValueError(f"cu_seqlens must end at seq_len={self.seq_len}, got {cu[-1]}{rank_suffix()}")

    @property
    def rule(self) -> Rule:
        return Rule(self.causal, self.window_size, self.mask)

    @property
    def balance_rule(self) -> Rule | None:
        """What ``layout="balanced"`` balances beyond causal work: the rule with a named mask, else None."""
        return balance_rule(self.layout, self.causal, None if self.balance == "causal" else self.mask)

    @property
    def valid_len(self) -> int | None:
        """The valid global length if known (from ``seq_len`` or the last document boundary)."""
        return self.seq_len if self.seq_len is not None else (self.cu_seqlens[-1] if self.cu_seqlens else None)

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def scale(self, head_dim: int) -> float:
        return head_dim ** -0.5 if self.softmax_scale is None else float(self.softmax_scale)

    @staticmethod
    def pack_options(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted(options.items()))
