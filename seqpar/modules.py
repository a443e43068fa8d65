"""``nn.Module`` wrappers of ``seqpar.attention`` for use inside models.

    mesh = seqpar.make_mesh(ulysses=2, ring=4)
    attn = seqpar.SequenceParallelAttention(mesh, method="usp", layout="zigzag", causal=True)
    x = attn.shard(x_global)                        # this rank's tokens; attn.positions(S) for RoPE
    out = attn(q, k, v)                             # (B, L, H, D) local shards in, local out

The module holds no parameters and no process state: the mesh (or process group) is passed in, and the
call's options are a frozen ``AttentionConfig`` validated when the module is built, so a bad method,
layout, kernel or option fails at model construction, not at the first step. Only what varies per batch
is given per call (``PER_CALL``): document boundaries, the valid length of padded shards, and whether to
return the lse. Everything that fixes where tokens live (mesh, method, layout) is fixed at construction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import methods
from .api import attention, attention_config, positions, shard, unshard
from .config import AttentionConfig
from .errors import rank_suffix
from .groups import SeqParallelGroups
from .types import AttnOutput

__all__ = ["SequenceParallelAttention", "SequenceParallelAttentionKVPacked", "SequenceParallelAttentionQKVPacked"]


class SequenceParallelAttention(nn.Module):
    """Sequence-parallel softmax attention over the ranks of ``mesh``.

    Args:
        mesh: a DeviceMesh (2D with dims "ulysses", "ring" for ``usp``), a ProcessGroup, or None for the
            default group. Checked here when given.
        method: one of ``seqpar.methods.available()``.
        layout: the token layout; None picks "zigzag" when the method accepts it, else the method's first.
        causal, kernel, softmax_scale, window_size, deterministic, grad_dtype, **options: as in
            ``seqpar.attention``, fixed for the module's life.

    Attributes:
        config: the frozen, validated ``AttentionConfig`` of every call.
    """

    #: keyword arguments ``forward`` accepts per call (anything else is fixed at construction)
    PER_CALL = ("cu_seqlens", "seq_len", "return_lse")

    def __init__(self, mesh: Any = None, *, method: str = "ring", layout: str | None = None, causal: bool = True,
                 kernel: str = "auto", softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                 deterministic: bool = False, grad_dtype: torch.dtype = torch.float32, **options: Any):
        super().__init__()
        self.config: AttentionConfig = attention_config(
            method, layout=layout, causal=causal, softmax_scale=softmax_scale, kernel=kernel,
            window_size=window_size, deterministic=deterministic, grad_dtype=grad_dtype, **options)
        if mesh is not None:
            SeqParallelGroups.resolve(mesh, methods.get(method).mesh_dims)
        self.mesh = mesh

    @property
    def _where(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "method": self.config.method, "layout": self.config.layout}

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_call: dict[str, Any]
              ) -> torch.Tensor | AttnOutput:
        unknown = sorted(set(per_call) - set(self.PER_CALL))
        if unknown:
            raise TypeError(f"per-call arguments must be among {list(self.PER_CALL)} (the rest is fixed when the "
                            f"module is built), got {unknown}{rank_suffix()}")
        c = self.config
        return attention(q, k, v, **self._where, causal=c.causal, softmax_scale=c.softmax_scale, kernel=c.kernel,
                         window_size=c.window_size, deterministic=c.deterministic, grad_dtype=c.grad_dtype,
                         **dict(c.options), **per_call)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **per_call: Any
                ) -> torch.Tensor | AttnOutput:
        """``q (B, L, H, D)``, ``k, v (B, L, Hkv, D)`` local shards -> ``out (B, L, H, D)``
        (``AttnOutput(out, lse)`` with ``return_lse=True``)."""
        return self._call(q, k, v, per_call)

    def shard(self, x: torch.Tensor, dim: int = 1, pad: bool = False) -> torch.Tensor:
        """This rank's tokens of the global ``x`` in the module's placement (``seqpar.shard``)."""
        return shard(x, **self._where, dim=dim, pad=pad)

    def unshard(self, x: torch.Tensor, dim: int = 1, seq_len: int | None = None) -> torch.Tensor:
        """The global tensor from every rank's shard (a collective; ``seqpar.unshard``)."""
        return unshard(x, **self._where, dim=dim, seq_len=seq_len)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens, int64 ``(L,)`` (for RoPE; ``seqpar.positions``)."""
        return positions(seq_len, **self._where, device=device)

    def extra_repr(self) -> str:
        c = self.config
        extra = "".join(f", {k}={v!r}" for k, v in c.options)
        return f"method={c.method!r}, layout={c.layout!r}, causal={c.causal}, kernel={c.kernel!r}{extra}"


class SequenceParallelAttentionQKVPacked(SequenceParallelAttention):
    """``SequenceParallelAttention`` on ``qkv (B, L, 3, H, D)`` (MHA; the Ulysses all-to-all moves the three
    in one collective either way)."""

    def forward(self, qkv: torch.Tensor, **per_call: Any) -> torch.Tensor | AttnOutput:  # type: ignore[override]
        if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seq_local, 3, heads, head_dim), got "
                             f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}"
                             f"{rank_suffix()}")
        return self._call(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], per_call)


class SequenceParallelAttentionKVPacked(SequenceParallelAttention):
    """``SequenceParallelAttention`` on ``q (B, L, H, D)`` and ``kv (B, L, 2, Hkv, D)`` (GQA/MQA packed)."""

    def forward(self, q: torch.Tensor, kv: torch.Tensor, **per_call: Any  # type: ignore[override]
                ) -> torch.Tensor | AttnOutput:
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError(f"kv must be (batch, seq_local, 2, kv_heads, head_dim), got "
                             f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}"
                             f"{rank_suffix()}")
        return self._call(q, kv[:, :, 0], kv[:, :, 1], per_call)
