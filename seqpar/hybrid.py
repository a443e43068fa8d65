"""LASP-2H (ALGORITHMS.md §11): linear and softmax attention layers over ONE token layout.

A hybrid model (linear layers with an occasional softmax layer) runs sequence-parallel when every layer
type sees the tokens where the others left them. ``HybridContext`` holds that shared placement and hands
each layer type its method: linear layers call ``ctx.linear`` (LASP-2, ``seqpar.linear_attention``),
softmax layers ``ctx.softmax`` (all-gather KV by default, ``seqpar.attention``), both with the same mesh,
layout, documents and padding. ``SingleDeviceContext`` has the same interface on one process (the
reference a sequence-parallel run is compared with, and the evaluation path)::

    ctx = HybridContext(mesh=group, layout="zigzag", softmax_method="allgather", seq_len=S)
    x = ctx.shard(tokens)                      # this rank's tokens; labels shifted BEFORE sharding
    pos = ctx.positions(S)                     # global positions of those tokens (RoPE)
    ... model(x, ctx) ...                      # layers call ctx.linear(q, k, v, gates=g) / ctx.softmax(q, k, v)
    ctx.all_reduce_grads(model.parameters())   # replicated parameters: sum the ranks' shares

Note [One layout for both layer types]
    Zigzag balances the causal softmax layers (every rank does the same work) and costs the linear layers
    nothing but a second slot per rank (two (M, P) summaries in the same all-gather, §10.5); contiguous
    leaves the softmax layers with the 2W-1 : 1 imbalance. No token permutation happens between layers.
    Parameters are replicated over the sequence-parallel group; each rank's backward yields its share
    of their gradient (its tokens' contribution), so the group sums them, exactly as data parallelism does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import methods
from .api import attention, positions, shard, unshard
from .errors import rank_suffix
from .groups import SeqParallelGroups
from .kernels.linear import linear_attention_chunked
from .layouts import make_layout
from .linear_api import get_linear_method, linear_attention

__all__ = ["HybridContext", "SingleDeviceContext"]


@dataclass(frozen=True, kw_only=True)
class HybridContext:
    """The shared sequence-parallel placement of a hybrid model (Note [One layout for both layer types])."""

    mesh: Any = None
    """A 1D DeviceMesh, a ProcessGroup or None (the default group): the sequence-parallel group."""
    layout: str = "zigzag"
    """Token layout shared by every layer; must be accepted by both methods."""
    linear_method: str = "lasp2"
    """Method of the linear layers (``seqpar.linear_methods()``)."""
    softmax_method: str = "allgather"
    """Method of the softmax layers (``seqpar.methods.available()``); any of them keeps the layout."""
    seq_len: int | None = None
    """Valid global length when the sharded tensors carry end padding."""
    cu_seqlens: tuple[int, ...] | None = None
    """Global document boundaries shared by both layer types."""
    softmax_kernel: str = "auto"
    """Local kernel of the softmax layers."""
    linear_kernel: str = "auto"
    """Local kernel of the linear layers."""
    chunk_size: int = 64
    """Chunk length of the linear layers' local pass."""

    def __post_init__(self) -> None:
        if self.softmax_method not in methods.available():
            raise ValueError(f"softmax_method must be one of {methods.available()}, got {self.softmax_method!r}"
                             f"{rank_suffix()}")
        soft, lin = methods.get(self.softmax_method), get_linear_method(self.linear_method)
        if soft.mesh_dims != 1:
            raise ValueError(f"softmax_method must run on a 1D group like the linear layers, got "
                             f"{self.softmax_method!r} (a {soft.mesh_dims}D mesh){rank_suffix()}")
        for name, layouts in ((self.softmax_method, soft.layouts), (self.linear_method, lin.LAYOUTS)):
            if self.layout not in layouts:
                raise ValueError(f"layout must be accepted by both layer types; method={name!r} takes "
                                 f"{list(layouts)}, got {self.layout!r}{rank_suffix()}")
        if self.cu_seqlens is not None:
            object.__setattr__(self, "cu_seqlens", tuple(int(x) for x in self.cu_seqlens))

    @property
    def group(self) -> dist.ProcessGroup:
        return SeqParallelGroups.resolve(self.mesh, 1).group

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def padded_len(self, n: int) -> int:
        """The global length the layout needs for ``n`` tokens (a multiple of its divisor)."""
        d = make_layout(self.layout, self.world).divisor
        return -(-n // d) * d

    def shard(self, x: torch.Tensor, dim: int = 1, pad_value: float | int = 0) -> torch.Tensor:
        """This rank's tokens of the global ``x``, end-padded with ``pad_value`` to ``padded_len``."""
        n = x.shape[dim]
        extra = self.padded_len(n) - n
        if extra:
            shape = list(x.shape)
            shape[dim] = extra
            x = torch.cat([x, x.new_full(shape, pad_value)], dim)
        return shard(x, mesh=self.mesh, method=self.softmax_method, layout=self.layout, dim=dim)

    def unshard(self, x: torch.Tensor, dim: int = 1, seq_len: int | None = None) -> torch.Tensor:
        """The global tensor from every rank's shard (collective), padding dropped with ``seq_len``."""
        return unshard(x, mesh=self.mesh, method=self.softmax_method, layout=self.layout, dim=dim,
                       seq_len=seq_len)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens, in local order (RoPE); ``seq_len`` the unpadded length."""
        return positions(self.padded_len(seq_len), mesh=self.mesh, method=self.softmax_method, layout=self.layout,
                         device=device)

    def linear(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        """``seqpar.linear_attention`` with this context's mesh, method, layout, documents and padding."""
        return linear_attention(q, k, v, mesh=self.mesh, method=self.linear_method, layout=self.layout,
                                cu_seqlens=self.cu_seqlens, seq_len=self.seq_len, chunk_size=self.chunk_size,
                                kernel=self.linear_kernel, **kw)

    def softmax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        """``seqpar.attention`` with this context's mesh, softmax method, layout, documents and padding."""
        return attention(q, k, v, mesh=self.mesh, method=self.softmax_method, layout=self.layout,
                         cu_seqlens=self.cu_seqlens, seq_len=self.seq_len, kernel=self.softmax_kernel, **kw)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group (a detached copy; e.g. the loss for logging)."""
        y = x.detach().clone()
        dist.all_reduce(y, group=self.group)
        return y

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the gradients of replicated parameters over the group, in one flat buffer per dtype."""
        grads = [p.grad for p in params if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=self.group)
            at = 0
            for g in same:
                g.copy_(flat[at:at + g.numel()].view_as(g))
                at += g.numel()


@dataclass(frozen=True, kw_only=True)
class SingleDeviceContext:
    """``HybridContext``'s interface on one process: the whole sequence, no communication.

    Linear layers run the chunked local form per document; softmax layers run SDPA with the causal
    (and per-document) mask. The reference a sequence-parallel run must reproduce.
    """

    cu_seqlens: tuple[int, ...] | None = None
    seq_len: int | None = None
    chunk_size: int = 64

    def shard(self, x: torch.Tensor, dim: int = 1, pad_value: float | int = 0) -> torch.Tensor:
        return x

    def unshard(self, x: torch.Tensor, dim: int = 1, seq_len: int | None = None) -> torch.Tensor:
        return x if seq_len is None else x.narrow(dim, 0, seq_len)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.arange(seq_len, device=device)

    def _docs(self, n: int) -> Sequence[tuple[int, int]]:
        bounds = list(self.cu_seqlens) if self.cu_seqlens is not None else [0, self.seq_len or n]
        return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]

    def linear(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, decay: torch.Tensor | None = None,
               gates: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        g = gates if gates is not None else decay
        out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
        parts, at = [], 0
        for a, b in self._docs(q.shape[1]):
            parts += [out[:, at:a]] if a > at else []
            gs = None if g is None else (g if g.dim() == 1 else g[:, a:b])
            o, _ = linear_attention_chunked(q[:, a:b], k[:, a:b], v[:, a:b], gs, chunk_size=self.chunk_size, **kw)
            parts.append(o)
            at = b
        parts += [out[:, at:]] if at < q.shape[1] else []
        return torch.cat(parts, 1)

    def softmax(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                softmax_scale: float | None = None) -> torch.Tensor:
        S, G = q.shape[1], q.shape[2] // k.shape[2]
        doc = torch.full((S,), -1, dtype=torch.long, device=q.device)
        for i, (a, b) in enumerate(self._docs(S)):
            doc[a:b] = i
        vis = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
        if causal:
            vis &= torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)))
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=vis, scale=softmax_scale)
        return torch.where(vis.any(-1)[None, None, :, None], o, 0.0).transpose(1, 2)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def all_reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        return None
