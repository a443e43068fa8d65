"""Pass-KV or pass-Q for a prompt that extends a cache, by the bytes each moves, with the reason in words.

Note [Extending a cache: which pass]
    New tokens T (sharded: ``T / W`` query rows per rank) attend to a cache of P + T tokens (``(P + T) / W``
    key rows per rank). Per rank and per ring step (``seqpar.passes``, ALGORITHMS.md §7.1, forward only):

        pass-KV   the cache slice travels:              2 B (P + T)/W Hkv D e
        pass-Q    the queries travel, partial outputs   B T/W H (2 D e + 4)
                  and lse come home:

    so pass-Q wins when ``T / (T + P) < 2 Hkv / (H (1 + 2 / (D e)))`` - Meta's rule (arXiv 2411.01783:
    pass-KV if T/(T+P) >= 2 N_KV / N_H) with the lse bytes counted. A chunked prefill's later chunks, a second
    turn against a long first one, decode-like extensions: pass-Q. A first long prompt: pass-KV. Ties go to
    pass-KV (the simpler schedule). Hiding either transfer under compute (CCR >= 1, §12.3) makes both free;
    the bytes still decide, because the one that moves less is hidden for a wider range of shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..passes import choose_pass

__all__ = ["InferencePlan", "PassDecision", "choose_extend_pass", "plan_inference"]


@dataclass(frozen=True)
class PassDecision:
    """``choice`` "kv" (the cache travels) or "q" (the queries travel); bytes per rank per step; ``reason``."""

    choice: str
    kv_bytes: int
    q_bytes: int
    reason: str


def choose_extend_pass(*, batch: int, new_tokens: int, cached_tokens: int, world: int, heads: int, kv_heads: int,
                       head_dim: int, dtype: torch.dtype = torch.bfloat16) -> PassDecision:
    """Pick the pass for ``new_tokens`` (global) attending to ``cached_tokens`` (global, the new ones included).

    Args:
        batch: B.
        new_tokens: T, the tokens of the extending chunk (all ranks together).
        cached_tokens: the cache's tokens the chunk attends to, the chunk's own included (P + T).
        world: W, ranks holding the cache.
        heads, kv_heads, head_dim: H, Hkv, D.
        dtype: activation dtype on the wire.

    Returns:
        A ``PassDecision`` (Note [Extending a cache: which pass]).
    """
    q_len = max(1, -(-new_tokens // world))
    kv_len = max(1, -(-cached_tokens // world))
    pc = choose_pass(batch=batch, q_len=q_len, kv_len=kv_len, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, backward=False)
    share = new_tokens / max(cached_tokens, 1)
    e = torch.finfo(dtype).bits // 8
    bar = 2 * kv_heads / (heads * (1 + 2 / (head_dim * e)))
    side = "below" if share < bar else "at or above"
    moved = "the queries travel and partial outputs come home" if pc.choice == "q" else "the cache slices travel"
    reason = (f"pass-{pc.choice.upper()}: {moved}; per rank and step pass-Q moves {pc.q_bytes} B and pass-KV "
              f"{pc.kv_bytes} B. New tokens are {share:.1%} of the attended context (T/(T+P)), {side} "
              f"2 Hkv / (H (1 + 2/(D e))) = {bar:.1%}")
    return PassDecision(pc.choice, pc.kv_bytes, pc.q_bytes, reason)


@dataclass(frozen=True)
class InferencePlan:
    """What serving a context of ``context`` tokens on ``world`` ranks costs, per rank (``plan_inference``)."""

    world: int
    context: int
    kv_bytes_per_rank: int
    """The cache's bytes on one rank (all layers; round-robin decode keeps ranks within a token)."""
    decode_bytes_per_layer: int
    """What one decode step's merge moves per layer and rank: W partials of ``B H (Dv + 1)`` fp32 floats."""
    extend: PassDecision
    """How a chunk of ``new_tokens`` extending the cache attends to it."""

    def __str__(self) -> str:
        return (f"{self.context} tokens on {self.world} ranks: KV {self.kv_bytes_per_rank / 2**30:.2f} GiB per "
                f"rank; decode all-gathers {self.decode_bytes_per_layer} B per layer per rank (independent of the "
                f"context); extension: {self.extend.reason}")


def plan_inference(*, context: int, new_tokens: int, world: int, layers: int, heads: int, kv_heads: int,
                   head_dim: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> InferencePlan:
    """The inference cases of the planner: cache memory per rank, decode traffic, and the extension pass.

    Args:
        context: tokens cached (P) before a chunk of ``new_tokens`` (T) extends them.
        world, layers, heads, kv_heads, head_dim, batch, dtype: W, layers, H, Hkv, D, B, the cache's dtype.
    """
    e = torch.finfo(dtype).bits // 8
    per_rank = -(-context // world)
    kv = 2 * layers * batch * per_rank * kv_heads * head_dim * e
    gather = world * batch * heads * (head_dim + 1) * 4
    ext = choose_extend_pass(batch=batch, new_tokens=new_tokens, cached_tokens=context + new_tokens, world=world,
                             heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return InferencePlan(world, context, kv, gather, ext)
