"""The planner's inference cases: prefill of the tokens a cache does not hold yet, then decode.

    seqpar.plan(seq_len=131072, heads=32, kv_heads=8, world=8, cached=126976, layers=32)   # ranking + this
    seqpar.planner.inference_case(context=131072, cached=126976, world=8, heads=32, kv_heads=8, layers=32)

A context of C tokens of which the first P are cached (a previous turn, a shared system prompt; P = 0 for a
first prompt): prefill attends the T = C - P new tokens to all C - the cache slices travel (pass-KV) or the
queries travel and their partial outputs come home (pass-Q), whichever moves fewer bytes per rank and step
(Note [Extending a cache: which pass] in ``seqpar.inference.choice``) - then decode adds one token at a time
against the C cached tokens. Both answers are ``seqpar.inference.plan_inference``'s: once with the P cached
and T new tokens (the prefill's pass and its reason), once at C (the cache per rank, and what each decode
step's merge moves per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..inference import PassDecision

__all__ = ["InferenceCase", "inference_case"]


@dataclass(frozen=True)
class InferenceCase:
    """Prefill and decode for a context of ``context`` tokens, ``cached`` of them already in the cache."""

    context: int
    cached: int
    world: int
    layers: int
    prefill: PassDecision
    """How the ``context - cached`` new tokens attend to the context: pass-KV or pass-Q, bytes, the reason."""
    kv_bytes_per_rank: int
    """The cache's bytes on one rank once it holds the whole context (all layers)."""
    decode_bytes_per_layer: int
    """What one decode step's merge moves per layer and rank (independent of the context)."""

    def __str__(self) -> str:
        new = self.context - self.cached
        return (f"inference: {self.context} tokens ({self.cached} cached) on {self.world} ranks, {self.layers} "
                f"layer(s)\n  prefill of {new} new tokens: {self.prefill.reason}\n  decode at {self.context} tokens: "
                f"KV {self.kv_bytes_per_rank / 2**30:.2f} GiB per rank; each step moves "
                f"{self.decode_bytes_per_layer} B per layer per rank (independent of the context)")


def inference_case(*, context: int, cached: int, world: int, heads: int, kv_heads: int, head_dim: int = 128,
                   layers: int = 1, batch: int = 1, dtype: Any = "bfloat16") -> InferenceCase:
    """Prefill of ``context - cached`` new tokens against ``context``, and decode at ``context`` (module
    docstring).

    Args:
        context: C, the tokens attended to once prefill is done.
        cached: P, the tokens already cached (0 <= P < C).
        world, heads, kv_heads, head_dim, layers, batch: W, H, Hkv, D, the cache's layers, B.
        dtype: the cache's dtype (a torch dtype or its name).
    """
    import torch

    from ..inference import plan_inference

    if not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached < context:
        raise ValueError(f"cached must be an int in [0, seq_len={context}) (the tokens already cached), got {cached!r}")
    dt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."))
    shape = dict(world=world, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, batch=batch, dtype=dt)
    prefill = plan_inference(context=cached, new_tokens=context - cached, **shape)
    decode = plan_inference(context=context, new_tokens=1, **shape)
    return InferenceCase(context, cached, world, layers, prefill.extend, decode.kv_bytes_per_rank,
                         decode.decode_bytes_per_layer)
