"""The low-level call: attend this rank's queries to the sharded cache (prefill, extension and decode).

    chunk = cache.begin_prefill(S, method="ring", layout="zigzag")      # or cache.begin_decode()
    for layer in range(n_layers):
        q, k, v = ...                                                    # this rank's rows of the chunk, RoPE
        out = seqpar.inference.attend(q, k, v, cache, layer)             # at chunk.position_ids
    # after the last layer the chunk is committed (cache.length grows)

Same tensor contract as ``seqpar.attention``: ``q (B, L, H, D)``, ``k (B, L, Hkv, D)``, ``v (B, L, Hkv, Dv)``,
out ``(B, L, H, Dv)`` in q's dtype, lse ``(B, H, L)`` fp32 (fp64 for fp64) natural log. L is this rank's rows of
the chunk: its share of a sharded chunk (``chunk.take`` gives its tokens), or all of a decode chunk's tokens.
Attention is causal in cache positions, with an optional left window and per-head sinks (Note [Attention
sinks] in ``_local``); rows before a batch row's start (left padding) are never seen by it. What runs (Note
[Chunks] in ``cache``):

    chunk mode   how
    fill         ``seqpar.attention`` with the chunk's method and layout (any seqpar method), and its named
                 ``mask_mod`` if ``begin_prefill`` got one (Gemma 3's image spans)
    extend       pass-KV or pass-Q over every rank's slice (``choice``; Notes in ``extend``)
    decode       each rank's slice, then one all-gather and an exact merge (Note [Exact decode merge])
"""

from __future__ import annotations

import logging

import torch

from ..api import attention as sp_attention
from ..errors import rank_suffix
from ..numerics import apply_sinks
from ..types import AttnOutput
from .choice import PassDecision, choose_extend_pass
from .decode import decode_attend
from .extend import Partials, Peers, out_like, pass_kv, pass_q, run_tasks
from .plans import check_window

__all__ = ["attend", "attend_stored", "decision"]

log = logging.getLogger("seqpar.inference")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, layer: int, *,
           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
           sinks: torch.Tensor | None = None, return_lse: bool = False, chunk: int | None = None
           ) -> torch.Tensor | AttnOutput:
    """Store the open chunk's ``k, v`` of ``layer`` in ``cache``, then attend ``q`` to everything cached.

    Args:
        q: ``(B, L, H, D)`` this rank's queries of the chunk (RoPE at ``chunk.position_ids``).
        k, v: ``(B, L, Hkv, D)``, ``(B, L, Hkv, Dv)`` the same rows' keys and values.
        cache: a ``ShardedKVCache`` with an open chunk.
        layer: the layer index.
        softmax_scale: default ``D ** -0.5``.
        window_size: ``(left, 0)`` sliding window in cache positions (-1 = none); causal, so right is 0 or -1.
        sinks: per-head sink logits ``(H,)`` (Note [Attention sinks]), or None.
        return_lse: also return lse ``(B, H, L)``.
        chunk: chunked attention (Llama 4): a query sees the keys of its own ``chunk``-position piece of the cache
            (cut at multiples of ``chunk`` in cache positions), causally; None = none. Not with a window.

    Returns:
        ``out (B, L, H, Dv)`` in q's dtype, or ``AttnOutput(out, lse)``.
    """
    cache.store(layer, k, v)
    return attend_stored(q, cache, layer, softmax_scale=softmax_scale, window_size=window_size, sinks=sinks,
                         return_lse=return_lse, chunk=chunk)


def _check_query(q: torch.Tensor, cache, layer: int, sinks: torch.Tensor | None) -> None:
    c = cache.chunk
    k, _ = c.stored[layer]
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4D tensor (batch, tokens, heads, head_dim), got "
                         f"{getattr(q, 'shape', type(q).__name__)}{rank_suffix()}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q must be (batch, tokens, heads, head_dim) = ({k.shape[0]}, {k.shape[1]}, a multiple of "
                         f"{k.shape[2]}, {k.shape[3]}) to match k, got {tuple(q.shape)}{rank_suffix()}")
    if q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"q must have k's dtype and device ({k.dtype}, {k.device}), got {q.dtype}, {q.device}"
                         f"{rank_suffix()}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q.shape[2],)):
        raise ValueError(f"sinks must be a tensor of shape ({q.shape[2]},) (one logit per head), got "
                         f"{getattr(sinks, 'shape', type(sinks).__name__)}{rank_suffix()}")


def attend_stored(q: torch.Tensor, cache, layer: int, *, softmax_scale: float | None = None,
                  window_size: tuple[int, int] = (-1, -1), sinks: torch.Tensor | None = None,
                  return_lse: bool = False, chunk: int | None = None, output: bool = True
                  ) -> torch.Tensor | AttnOutput:
    """``attend`` for a layer whose ``k, v`` the cache already stored (``cache.store``): the HF cache's path.

    ``chunk``: Llama 4's chunked attention, chunks of this many cache positions (``RowGroup.bounds``); the same
    for a layer on every call. ``output=False``: the caller discards this layer's output (the prefill's last
    layer, Note [The prefill's dead attention] in ``seqpar.integrations.hf_generate``): the layer is recorded
    as attended and zeros come back, computed by no kernel and no exchange (every rank must pass the same)."""
    c = cache._open(layer, "attend")
    if layer not in c.stored:
        raise RuntimeError(f"layer {layer} must store the open chunk's k, v before attending{rank_suffix()}")
    if layer in c.attended:
        raise RuntimeError(f"layer {layer} already attended the open chunk{rank_suffix()}")
    _check_query(q, cache, layer, sinks)
    left = check_window(window_size)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or left >= 0):
        raise ValueError(f"chunk must be a positive int or None (and no window with it), got chunk={chunk!r}, "
                         f"window_size={window_size!r}{rank_suffix()}")
    cache.set_window(layer, left)
    if not output:
        if return_lse:
            raise ValueError(f"return_lse=True needs output=True (an output nobody reads has no lse){rank_suffix()}")
        cache.mark_attended(layer)
        return q.new_zeros(*q.shape[:3], c.stored[layer][1].shape[-1])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if c.mode == "fill":
        out, lse = _fill(q, cache, layer, left, scale, chunk)
    elif c.mode == "extend":
        out, lse = _extend(q, cache, layer, left, scale, chunk)
    else:
        k_SBHD, v_SBHD = cache.slice(layer)
        out, lse = decode_attend(q, k_SBHD, v_SBHD, cache.decode_tasks(layer, left, chunk), cache.row_groups,
                                 cache.groups, scale, cache.spec.kernel)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    cache.mark_attended(layer)
    out = out.to(q.dtype)
    return AttnOutput(out, lse) if return_lse else out


def _fill(q: torch.Tensor, cache, layer: int, left: int, scale: float, chunk: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sharded chunk on an empty cache: ``seqpar.attention`` per row group (its own documents); a chunk's
    ``mask_mod`` carries its own causality, so the window keeps only its left bound (``begin_prefill``)."""
    c = cache.chunk
    k, v = c.stored[layer]
    causal = c.mask_mod is None
    acc = Partials(out_like(q, v.shape[-1]), cache.row_groups)
    for gi, g in enumerate(acc.groups):
        bounds = g.bounds(c.end, chunk)
        res = sp_attention(*(Partials._rows(x, g) for x in (q, k, v)), mesh=cache.mesh, method=c.method,
                           layout=c.layout, causal=causal, softmax_scale=scale, kernel=cache.spec.kernel,
                           window_size=(left, 0 if causal else -1) if left >= 0 else (-1, -1),
                           mask_mod=c.mask_mod, cu_seqlens=bounds if len(bounds) > 2 else None,
                           seq_len=c.tokens if c.padded != c.tokens else None, return_lse=True, **c.options)
        acc.add(gi, slice(0, q.shape[1]), res.out, res.lse)
    return acc.result(q.dtype)                    # one group: seqpar.attention's own output, never widened


def decision(cache, layer: int, q: torch.Tensor) -> PassDecision:
    """The pass an extending chunk uses at ``layer`` (Note [Extending a cache: which pass])."""
    c = cache.chunk
    k, _ = c.stored[layer]
    cached = sum(stop - first for first, stop in (cache.live(layer, j) for j in range(cache.world)))
    d = choose_extend_pass(batch=q.shape[0], new_tokens=c.padded, cached_tokens=cached, world=cache.world,
                           heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3], dtype=q.dtype)
    if cache.spec.passes != "auto":
        d = PassDecision(cache.spec.passes, d.kv_bytes, d.q_bytes,
                         f"pass-{cache.spec.passes.upper()}: forced (passes={cache.spec.passes!r}); by bytes it "
                         f"would be pass-{d.choice.upper()}")
    return d


def _extend(q: torch.Tensor, cache, layer: int, left: int, scale: float, chunk: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A sharded chunk against the whole cache (its own rows included): pass-KV or pass-Q."""
    c = cache.chunk
    d = decision(cache, layer, q)
    if layer not in c.passes:
        c.passes[layer] = d
        log.info("chunk at %d (+%d tokens), layer %d: %s", c.start, c.tokens, layer, d.reason)
    pairs = cache.pairs(layer, left, chunk)
    k_SBHD, v_SBHD = cache.slice(layer)
    peers = Peers(cache.groups.group, cache.ranks, cache.index)
    acc = Partials(out_like(q, v_SBHD.shape[-1]), cache.row_groups)
    if pairs.n_steps == 1:
        run_tasks(acc, q, k_SBHD.transpose(0, 1), v_SBHD.transpose(0, 1), pairs.tasks[cache.index][cache.index],
                  scale, cache.spec.kernel)
    elif d.choice == "kv":
        lengths = [stop - first for first, stop in (cache.live(layer, j) for j in range(cache.world))]
        pass_kv(q, k_SBHD, v_SBHD, lengths, pairs, peers, acc, scale, cache.spec.kernel)
    else:
        pass_q(q, k_SBHD, v_SBHD, pairs, peers, acc, scale, cache.spec.kernel)
    return acc.result(q.dtype)
