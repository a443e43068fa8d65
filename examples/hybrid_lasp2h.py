"""A small hybrid language model (gated linear attention + softmax attention layers), trained with LASP-2H.

Linear layers (GLA-style per-dim gates) run LASP-2; softmax layers (GQA, RoPE at global positions) run
all-gather KV context parallelism; both on one zigzag token layout (``seqpar.hybrid``). The same model on
one process (``SingleDeviceContext``) is the reference: a few optimizer steps must give the same losses and
parameter gradients.

    PYTHONPATH=. python examples/hybrid_lasp2h.py --world 4 --steps 3     # CPU / gloo: SP vs single process

On GPUs, launch ``train_sp`` under torchrun with an NCCL group and a CUDA device instead.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from seqpar.hybrid import HybridContext, SingleDeviceContext

__all__ = ["HybridLM", "ModelConfig", "compare", "make_batch", "train", "train_sp"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    layers: str = "LSLS"          # L = gated linear attention, S = softmax attention
    gate_norm: float = 16.0       # GLA's gate temperature: log gates logsigmoid(x) / gate_norm
    dtype: str = "float64"


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x_BSHD: torch.Tensor, pos_S: torch.Tensor) -> torch.Tensor:
    """Rotary embedding at GLOBAL positions (this rank's positions in its layout order)."""
    half = x_BSHD.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=x_BSHD.dtype, device=x_BSHD.device) / half)
    ang = pos_S.to(x_BSHD.dtype)[:, None] * freq[None, :]                  # (S, half)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = x_BSHD[..., :half], x_BSHD[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class GatedLinearAttention(nn.Module):
    """GLA-style: per-dim log gates from the input; the recurrence runs through ``ctx.linear`` (LASP-2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        inner = cfg.heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, 3 * inner, bias=False)
        self.gate = nn.Linear(cfg.dim, inner)
        self.out = nn.Linear(inner, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: Any, pos: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        H, D = self.cfg.heads, self.cfg.head_dim
        q, k, v = self.qkv(x).view(B, L, 3, H, D).unbind(2)
        g = F.logsigmoid(self.gate(x)).view(B, L, H, D) / self.cfg.gate_norm
        o = ctx.linear(q, k, v, gates=g, feature_map="elu1")
        return self.out(o.reshape(B, L, H * D))


class SoftmaxAttention(nn.Module):
    """Causal GQA softmax attention with RoPE; runs through ``ctx.softmax`` (all-gather KV)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.dim, H * D, bias=False)
        self.kv = nn.Linear(cfg.dim, 2 * Hkv * D, bias=False)
        self.out = nn.Linear(H * D, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: Any, pos: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        H, Hkv, D = self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim
        q = rope(self.q(x).view(B, L, H, D), pos)
        k, v = self.kv(x).view(B, L, 2, Hkv, D).unbind(2)
        o = ctx.softmax(q, rope(k, pos), v, causal=True)
        return self.out(o.reshape(B, L, H * D))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.attn = GatedLinearAttention(cfg) if kind == "L" else SoftmaxAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.SiLU(), nn.Linear(4 * cfg.dim, cfg.dim))

    def forward(self, x: torch.Tensor, ctx: Any, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), ctx, pos)
        return x + self.mlp(self.norm2(x))


class HybridLM(nn.Module):
    """Embedding -> blocks in the order of ``cfg.layers`` -> norm -> tied LM head (scaled by dim^-1/2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if set(cfg.layers) - {"L", "S"}:
            raise ValueError(f"layers must be a string of 'L' and 'S', got {cfg.layers!r}")
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, kind) for kind in cfg.layers)
        self.norm = RMSNorm(cfg.dim)

    def forward(self, tokens: torch.Tensor, ctx: Any, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, ctx, pos)
        return (self.norm(x) @ self.embed.weight.T) * self.embed.weight.shape[1] ** -0.5


def make_model(cfg: ModelConfig, seed: int = 0) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(cfg).to(getattr(torch, cfg.dtype))


def make_batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    """Global token ids ``(batch, seq_len + 1)``: inputs are ``[:, :-1]``, labels ``[:, 1:]`` (shift first)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (batch, seq_len + 1), generator=g)


def train(model: HybridLM, ctx: Any, tokens: torch.Tensor, steps: int, lr: float = 0.05) -> dict[str, list]:
    """``steps`` AdamW steps on one batch; returns per-step global losses and parameter gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    S = tokens.shape[1] - 1
    inputs, labels = ctx.shard(tokens[:, :-1]), ctx.shard(tokens[:, 1:], pad_value=-100)
    pos = ctx.positions(S, device=inputs.device)
    n_tok = tokens[:, 1:].numel()
    hist: dict[str, list] = {"loss": [], "grads": []}
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(inputs, ctx, pos)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / n_tok
        loss.backward()
        ctx.all_reduce_grads(model.parameters())
        hist["loss"].append(ctx.sum(loss))
        hist["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return hist


def train_sp(cfg: ModelConfig, batch: int, seq_len: int, steps: int, softmax_method: str, layout: str = "zigzag",
             cu_seqlens: tuple[int, ...] | None = None, chunk_size: int = 4) -> dict[str, list]:
    """One rank of the sequence-parallel run (call on every rank of the default group)."""
    ctx = HybridContext(layout=layout, softmax_method=softmax_method, cu_seqlens=cu_seqlens, seq_len=seq_len,
                        softmax_kernel="reference", linear_kernel="chunked", chunk_size=chunk_size)
    return train(make_model(cfg), ctx, make_batch(cfg, batch, seq_len), steps)


def train_single(cfg: ModelConfig, batch: int, seq_len: int, steps: int,
                 cu_seqlens: tuple[int, ...] | None = None, chunk_size: int = 4) -> dict[str, list]:
    ctx = SingleDeviceContext(cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return train(make_model(cfg), ctx, make_batch(cfg, batch, seq_len), steps)


def compare(sp: dict[str, list], single: dict[str, list]) -> dict[str, float]:
    """Largest relative difference of the losses and of every parameter gradient, over all steps."""
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    loss = max(rel(a, b) for a, b in zip(sp["loss"], single["loss"]))
    grads = max(rel(ga[n], gb[n]) for ga, gb in zip(sp["grads"], single["grads"]) for n in gb)
    return {"loss": loss, "grads": grads}


def main() -> None:
    import seqpar
    from seqpar.testing import ProcessPool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=29)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    cfg = ModelConfig()
    method = "allgather" if "allgather" in seqpar.methods.available() else "ring"
    with ProcessPool(args.world) as pool:
        sp = pool.run(train_sp, cfg, args.batch, args.seq_len, args.steps, method)[0]
    single = train_single(cfg, args.batch, args.seq_len, args.steps)
    diff = compare(sp, single)
    print(f"softmax layers: {method}; losses {[round(x.item(), 6) for x in sp['loss']]}")
    print(f"max relative difference vs single process: loss {diff['loss']:.2e}, gradients {diff['grads']:.2e}")
    if not max(diff.values()) <= 1e-9 * math.sqrt(args.world):
        raise SystemExit("sequence-parallel run differs from the single-process run")


if __name__ == "__main__":
    main()
