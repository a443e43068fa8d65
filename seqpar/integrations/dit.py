"""Joint (text + image) attention for diffusion transformers, xDiT style: text replicated, image sharded.

    mesh = seqpar.make_mesh(ulysses=2, ring=2)
    attn = JointAttention(dim=1024, heads=16, mesh=mesh, method="usp")       # MM-DiT (SD3-style) attention
    img_local = seqpar.shard(img, mesh=mesh, method="usp", layout="contiguous")    # any partition works
    img_out, txt_out = attn(img_local, txt)          # txt (B, T, C) is the same on every rank

or, on projected heads, ``joint_attention(q_img, k_img, v_img, q_txt, k_txt, v_txt, mesh=..., method=...)``.

Note [Joint attention with replicated text]: in MM-DiT every image and text token attends to every image and
text token (non-causal). Image tokens are sharded over the W ranks; the T text tokens are on every rank. With
no causal mask and positions already applied (RoPE before attention), attention does not depend on the order
of the tokens, so each rank adds its own slice of the text to its image shard and runs one ordinary
sequence-parallel attention over the joint sequence: every query sees all image keys AND all text keys, each
exactly once (xDiT's defect was dropping the joint text K/V on some paths). The text outputs are then
all-gathered back to every rank.

Uneven text: each rank's local sequence has ``L + c`` rows, ``c = ceil(T / W)``, so ``P = W c - T < W`` rows
are padding. Padding must not be seen, and seqpar excludes exactly two kinds of positions: the END of the
sequence (``seq_len``) and whole documents (``cu_seqlens``). So the plan (``_plan``) puts the padding at the
first ``P_s`` and the last ``P_e`` GLOBAL positions (``P_s + P_e = P``; the first ``P_s`` form their own
document, which sees only itself and whose outputs are dropped). Since order does not matter, each rank
arranges its rows freely: the rows whose global positions (in the internal layout) are padding get padding,
the others its image tokens then its text tokens. A plan exists when no rank would need more than ``c``
padding rows; stripe, zigzag and contiguous are tried with every split, and the first that fits is used
(stripe spreads the end over all ranks; contiguous puts the ends on the first and last rank). The internal
layout has nothing to do with the image shard, which can be any partition of the image.

Note [Replicated text: partial-sum gradients]: text tensors are replicated in the forward pass and carry
PARTIAL gradients in the backward pass: the gradients every rank returns for the text inputs (and any
parameter gradients computed from them) add up over the group to the single-process gradient, exactly like
the image shards' parameter gradients. So one all-reduce-sum of parameter gradients over the group gives
the single-process gradient. The convention asks the loss to count each text token once over the group: a
DiT's denoising loss on image latents does; a loss on text outputs computed on every rank must be divided
by W. Communication: the text slices' outputs are all-gathered forward and their gradients all-reduced
backward (``B x T x H x D`` each), on the group passed in.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import methods
from ..api import attention
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..layouts import Layout

__all__ = ["JointAttention", "TextPlan", "joint_attention"]


@dataclass(frozen=True)
class TextPlan:
    """How the text is spread (Note [Joint attention with replicated text]).

    Attributes:
        layout: the internal layout of the joint sequence.
        slot: text rows per rank, ``ceil(T / W)``.
        counts, offsets: real text tokens and the first one's index, per sequence-parallel index.
        pad_start, pad_end: padding rows at the start (one document) and at the end of the joint sequence.
    """

    layout: str
    slot: int
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    pad_start: int
    pad_end: int

    def attention_kwargs(self, seq_len: int) -> dict[str, Any]:
        """``cu_seqlens`` / ``seq_len`` that exclude the padding of a joint sequence of ``seq_len`` rows."""
        valid = seq_len - self.pad_end
        kwargs: dict[str, Any] = {"seq_len": valid} if self.pad_end else {}
        if self.pad_start:
            kwargs["cu_seqlens"] = (0, self.pad_start, valid)
        return kwargs


@functools.lru_cache(maxsize=256)
def _plan_cached(module_name: str, lay_by_name: tuple[tuple[str, Layout], ...], world: int, image_len: int,
                 text_len: int) -> TextPlan | None:
    slot = -(-text_len // world)
    padded = world * slot - text_len
    seq_len = world * (image_len + slot)
    for name, lay in lay_by_name:
        if seq_len % lay.divisor:
            continue
        for pad_start in range(padded + 1):
            pads = [_pad_rows(lay, i, seq_len, pad_start, padded - pad_start).numel() for i in range(world)]
            if max(pads) <= slot:
                counts = tuple(slot - p for p in pads)
                offsets = tuple(itertools.accumulate(counts, initial=0))[:-1]
                return TextPlan(name, slot, counts, offsets, pad_start, padded - pad_start)
    return None


def _plan(module: Any, groups: SeqParallelGroups, image_len: int, text_len: int) -> TextPlan:
    """The first (layout, padding split) whose padding rows fit every rank's text slot."""
    order = ("contiguous", "stripe", "zigzag") if text_len % groups.world == 0 else ("stripe", "zigzag", "contiguous")
    lays = tuple((name, module.placement(name, groups)[0]) for name in order if name in module.layouts)
    plan = _plan_cached(module.name, lays, groups.world, image_len, text_len)
    if plan is None:
        padded = -text_len % groups.world
        raise ValueError(
            f"text of T={text_len} tokens over W={groups.world} ranks leaves {padded} padding rows that no layout of "
            f"method {module.name!r} ({[n for n, _ in lays]}) can place at the ends of the joint sequence (image "
            f"shard of {image_len} tokens): pad the text to a multiple of {groups.world} with tokens the model may "
            f"attend to{rank_suffix()}")
    return plan


def _pad_rows(lay: Layout, index: int, seq_len: int, pad_start: int, pad_end: int) -> torch.Tensor:
    """Local rows of ``index`` whose global positions are padding (the first ``pad_start``, last ``pad_end``)."""
    pos = _positions(lay, index, seq_len)
    return ((pos < pad_start) | (pos >= seq_len - pad_end)).nonzero().flatten()


@functools.lru_cache(maxsize=256)
def _positions(lay: Layout, index: int, seq_len: int) -> torch.Tensor:
    return lay.positions(index, seq_len)


@functools.lru_cache(maxsize=64)
def _arrangement(lay: Layout, index: int, seq_len: int, pad_start: int, pad_end: int
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Row order of ``[image ; text ; padding]`` in the local joint sequence and its inverse; None if identity.

    ``order[row]`` is the index in ``cat([img, txt_slice, padding])`` that goes to local row ``row``.
    """
    rows = lay.positions(index, seq_len).numel()
    pad = _pad_rows(lay, index, seq_len, pad_start, pad_end)
    is_pad = torch.zeros(rows, dtype=torch.bool)
    is_pad[pad] = True
    real = (~is_pad).nonzero().flatten()
    order = torch.empty(rows, dtype=torch.long)
    order[real] = torch.arange(real.numel())                       # image rows then text rows, in order
    order[pad] = torch.arange(real.numel(), rows)                   # then the padding
    return None if bool((order == torch.arange(rows)).all()) else (order, torch.argsort(order))


def joint_attention(q_img: torch.Tensor, k_img: torch.Tensor, v_img: torch.Tensor, q_txt: torch.Tensor,
                    k_txt: torch.Tensor, v_txt: torch.Tensor, *, mesh: Any = None, method: str = "usp",
                    kernel: str = "auto", softmax_scale: float | None = None, **options: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of image + text queries over image + text keys; image sharded, text replicated.

    Args:
        q_img, k_img, v_img: this rank's image tokens ``(B, L, H, D)`` / ``(B, L, Hkv, D)``: any partition of
            the image over the group (e.g. ``seqpar.shard(x, mesh=mesh, method=method, layout="contiguous")``).
        q_txt, k_txt, v_txt: all text tokens ``(B, T, H, D)`` / ``(B, T, Hkv, D)``, the same on every rank.
        mesh, method, kernel, softmax_scale, **options: as in ``seqpar.attention`` (non-causal).

    Returns:
        ``(out_img (B, L, H, D), out_txt (B, T, H, D))``: image outputs of this rank's tokens; text outputs,
        the same on every rank, with partial gradients (Note [Replicated text: partial-sum gradients]).
    """
    _validate(q_img, k_img, v_img, q_txt, k_txt, v_txt)
    module = methods.get(method)
    groups = SeqParallelGroups.resolve(mesh, module.mesh_dims)
    L = q_img.shape[1]
    plan = _plan(module, groups, L, q_txt.shape[1])
    start, count = plan.offsets[groups.index], plan.counts[groups.index]
    seq_len = groups.world * (L + plan.slot)
    lay, _ = module.placement(plan.layout, groups)
    arranged = _arrangement(lay, groups.index, seq_len, plan.pad_start, plan.pad_end)
    order, inverse = (None, None) if arranged is None else (t.to(q_img.device) for t in arranged)

    def joint(img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:      # local rows of [img ; text ; padding]
        pad = txt.new_zeros((txt.shape[0], plan.slot - count, *txt.shape[2:]))
        rows = torch.cat([img, txt[:, start:start + count], pad], 1)
        return rows if order is None else rows.index_select(1, order)

    out = attention(joint(q_img, q_txt), joint(k_img, k_txt), joint(v_img, v_txt), mesh=mesh, method=method,
                    layout=plan.layout, causal=False, kernel=kernel, softmax_scale=softmax_scale,
                    **plan.attention_kwargs(seq_len), **options)
    if inverse is not None:                                              # back to [img ; text ; padding]
        out = out.index_select(1, inverse)
    out_txt = _GatherText.apply(out[:, L:], groups, plan)
    return out[:, :L], out_txt


def _validate(q_img, k_img, v_img, q_txt, k_txt, v_txt) -> None:
    rs = rank_suffix()
    for name, t in (("q_img", q_img), ("k_img", k_img), ("v_img", v_img), ("q_txt", q_txt), ("k_txt", k_txt),
                    ("v_txt", v_txt)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4D tensor (batch, seq, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}{rs}")
    for name, a, b in (("q", q_img, q_txt), ("k", k_img, k_txt), ("v", v_img, v_txt)):
        if a.shape[0] != b.shape[0] or a.shape[2:] != b.shape[2:] or a.dtype != b.dtype:
            raise ValueError(f"{name}_img and {name}_txt must share batch, heads, head_dim and dtype, got "
                             f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}{rs}")
    if q_txt.shape[1] == 0:
        raise ValueError(f"text must have at least one token, got shape {tuple(q_txt.shape)} (use "
                         f"seqpar.attention for image-only attention){rs}")


class _GatherText(torch.autograd.Function):
    """Every rank's text slot -> all text outputs; backward: sum the partial gradients, keep this slot's."""

    @staticmethod
    def forward(ctx, own_BCHD: torch.Tensor, groups: SeqParallelGroups, plan: TextPlan) -> torch.Tensor:
        ctx.groups, ctx.plan = groups, plan
        parts = groups.all_gather(own_BCHD.contiguous())
        return torch.cat([p[:, :n] for p, n in zip(parts, plan.counts)], 1)

    @staticmethod
    def backward(ctx, d_BTHD: torch.Tensor):
        groups, plan = ctx.groups, ctx.plan
        full = d_BTHD.contiguous().clone()
        for g in ([groups.group] if groups.group is not None else [groups.ulysses, groups.ring]):
            dist.all_reduce(full, group=g)
        start, count = plan.offsets[groups.index], plan.counts[groups.index]
        own = full.new_zeros((full.shape[0], plan.slot, *full.shape[2:]))
        own[:, :count] = full[:, start:start + count]
        return own, None, None


class JointAttention(nn.Module):
    """MM-DiT (SD3-style) joint attention: separate projections per stream, one attention over both.

    Args:
        dim: model width C; ``heads`` heads of ``dim // heads``.
        mesh, method, kernel, **options: the sequence-parallel placement (``joint_attention``); ``method=None``
            runs the same block on one device over the whole sequence (the reference).
        qk_norm: RMSNorm on queries and keys per head (as SD3.5 / Flux).

    ``forward(img (B, L, C), txt (B, T, C)) -> (img_out (B, L, C), txt_out (B, T, C))``: image tokens local
    (any partition of the image), text tokens replicated (Note [Replicated text: partial-sum gradients]).
    """

    def __init__(self, dim: int, heads: int, *, mesh: Any = None, method: str | None = "usp", kernel: str = "auto",
                 qk_norm: bool = True, **options: Any):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads must divide dim, got dim={dim}, heads={heads}{rank_suffix()}")
        if method is not None:
            methods.get(method)
        self.heads, self.head_dim = heads, dim // heads
        self.mesh, self.method, self.kernel, self.options = mesh, method, kernel, options
        self.img_qkv, self.txt_qkv = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.img_out, self.txt_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        norm = (lambda: nn.RMSNorm(self.head_dim, eps=1e-6)) if qk_norm else nn.Identity
        self.img_q_norm, self.img_k_norm, self.txt_q_norm, self.txt_k_norm = norm(), norm(), norm(), norm()

    def _heads(self, x: torch.Tensor, proj: nn.Linear, q_norm: nn.Module, k_norm: nn.Module):
        q, k, v = proj(x).unflatten(-1, (3, self.heads, self.head_dim)).unbind(2)      # (B, S, H, D) each
        return q_norm(q), k_norm(k), v

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qi, ki, vi = self._heads(img, self.img_qkv, self.img_q_norm, self.img_k_norm)
        qt, kt, vt = self._heads(txt, self.txt_qkv, self.txt_q_norm, self.txt_k_norm)
        if self.method is None:
            out_img, out_txt = _dense_joint(qi, ki, vi, qt, kt, vt)
        else:
            out_img, out_txt = joint_attention(qi, ki, vi, qt, kt, vt, mesh=self.mesh, method=self.method,
                                               kernel=self.kernel, **self.options)
        return self.img_out(out_img.flatten(2)), self.txt_out(out_txt.flatten(2))

    def extra_repr(self) -> str:
        return f"heads={self.heads}, head_dim={self.head_dim}, method={self.method!r}"


def _dense_joint(qi, ki, vi, qt, kt, vt) -> tuple[torch.Tensor, torch.Tensor]:
    """One device: SDPA over ``[txt; img]`` (the reference ``JointAttention(method=None)`` runs)."""
    T = qt.shape[1]
    q, k, v = (torch.cat([t, i], 1).transpose(1, 2) for t, i in ((qt, qi), (kt, ki), (vt, vi)))
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(q.shape[-1])).transpose(1, 2)
    return out[:, T:], out[:, :T]
