"""What one transformers attention layer attends to, read from the layer and its config, as a ``seqpar.attention``
call (Note [Layer masks]); what transformers' mask functions may contain (Note [Reading transformers' mask
functions]); Llama 4's position-scaled queries (Note [Position-scaled queries]).

Note [Layer masks]
    transformers builds one mask per layer type and hands each layer the one of ``config.layer_types[i]``.
    seqpar needs no dense mask: each call gets the same rule, in global positions, from the layer itself.

        layer (config.layer_types[i], module)          seqpar.attention
        full_attention, or no layer_types              causal=module.is_causal
        sliding_attention, sliding_window=w            window_size=(w - 1, 0); (w - 1, w - 1) when not causal
        chunked_attention (Llama 4), chunk c           causal, mask_mod=chunked(c); with documents, chunks restart
                                                       at each document (transformers numbers the chunks by
                                                       position_ids): mask_mod=tree(cuts, no parents)
        + image_spans (Gemma 3; shard_batch's          full layer: causal=False, mask_mod=spans(image_spans)
          token_type_ids == 1 runs, global positions)  sliding layer: causal=False, mask_mod=spans(image_spans,
                                                       window=w - 1), window_size=(w - 1, -1)
        any other layer type                           NotImplementedError naming it

    Gemma 3 (``create_masks_for_vision_model``): full layers see ``causal OR same image``; sliding layers see
    ``(k > q - w) AND (causal OR same image)``: an image token sees every token of its image that is fewer than
    w positions behind it, and all of its image ahead of it. ``spans(window=w - 1)`` is the causal window OR
    the whole span, and ``window_size=(w - 1, -1)`` cuts the span's part w positions behind: exactly that set.
    Image spans are honoured on Gemma 3 layers only (``model_type`` ``gemma3_text``, the rule read in
    transformers' gemma3 code); other models refuse them by name.

    Under ``layout="balanced"`` the placement of tokens would follow a call's named mask
    (``seqpar.config.balance_rule``), but every layer of a model must see the tokens ``shard_batch`` placed (by
    causal work, no mask). So every call passes ``balance="causal"``: the placement stays the batch's and the
    named mask keeps its pieces and dense kernels.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import rank_suffix
from ...masks import PieceMask, chunked, spans, tree

__all__ = ["LayerMask", "check_mask_function", "layer_mask", "query_scales", "rescale_queries"]

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""Layer types whose attention seqpar expresses (Note [Layer masks]); any other type that calls attention raises."""
IMAGE_SPAN_MODELS = frozenset({"gemma3_text", "gemma3"})
"""``model_type`` of the configs whose layers take Gemma 3's bidirectional image spans."""


@dataclass(frozen=True)
class LayerMask:
    """One layer's ``seqpar.attention`` mask arguments (Note [Layer masks])."""

    causal: bool
    window: tuple[int, int]
    mask: PieceMask | None = None
    chunk: int | None = None
    """A chunked layer's chunk size (a KV cache serves it only while every position is in chunk 0)."""



def layer_mask(module: torch.nn.Module, *, causal: bool, sliding_window: Any, cu: tuple[int, ...] | None,
               image_spans: Any, where: str) -> LayerMask:
    """The mask of ``module``'s attention call (Note [Layer masks]).

    Args:
        module: the calling attention module (``config``, ``layer_idx``).
        causal: the layer's causality (``is_causal``).
        sliding_window: the layer's ``sliding_window`` (HF convention: w keys, the query's own included) or None.
        cu: the batch's global document boundaries (host ints) or None.
        image_spans: ``((start, end), ...)`` global image spans (``shard_batch``'s ``image_spans``) or None.
        where: "layer i (Class)" for messages.
    """
    rs = rank_suffix()
    config = getattr(module, "config", None)
    kind = _layer_type(config, getattr(module, "layer_idx", None), where)
    window = _window(sliding_window, causal, where)
    if kind == "sliding_attention" and window == (-1, -1):
        raise NotImplementedError(f"{where} is a sliding_attention layer but passes no sliding_window: its window "
                                  f"is unknown to seqpar{rs}")
    chunk = None
    mask: PieceMask | None = None
    if kind == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise NotImplementedError(f"{where} is a chunked_attention layer but config.attention_chunk_size is "
                                      f"{chunk!r}, not a positive int{rs}")
        if not causal:
            raise NotImplementedError(f"chunked attention without causality (is_causal=False) is not supported, in "
                                      f"{where}{rs}")
        mask = chunked(chunk) if cu is None else _chunks_of_documents(cu, chunk)
        causal = cu is None                                      # a tree carries its own causality
    spans_ = _spans(image_spans, where)
    if spans_:
        model_type = getattr(config, "model_type", None)
        if model_type not in IMAGE_SPAN_MODELS:
            raise NotImplementedError(
                f"image_spans (bidirectional image tokens, Gemma 3's rule) are honoured on Gemma 3 layers only, got "
                f"them in {where} of a {model_type!r} model: transformers' {model_type} has no such rule (drop "
                f"token_type_ids from the batch, or name it in shard_batch(seq_keys=...) to shard it as it is){rs}")
        if not causal:
            raise NotImplementedError(f"image_spans on a non-causal layer ({where}) are not supported: a "
                                      f"bidirectional layer already sees every image token{rs}")
        if mask is not None:
            raise NotImplementedError(f"image_spans on a {kind} layer ({where}) are not supported{rs}")
        if window != (-1, -1):
            mask, window = spans(spans_, window=window[0]), (window[0], -1)
        else:
            mask = spans(spans_)
        causal = False                                            # spans carry their own causality
    return LayerMask(causal=causal, window=window, mask=mask, chunk=chunk)


def _layer_type(config: Any, layer_idx: Any, where: str) -> str | None:
    types = getattr(config, "layer_types", None)
    if types is None:
        return None
    if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(types):
        raise NotImplementedError(f"{where} has layer_idx={layer_idx!r}, which does not index config.layer_types "
                                  f"({len(types)} entries): its layer type is unknown{rank_suffix()}")
    kind = types[layer_idx]
    if kind not in LAYER_TYPES:
        raise NotImplementedError(
            f"layer type {kind!r} (config.layer_types[{layer_idx}] of a {getattr(config, 'model_type', '?')!r} "
            f"model, {where}) is not expressed by seqpar, which knows {list(LAYER_TYPES)}: refused rather than "
            f"attended as plain causal{rank_suffix()}")
    return kind


def _window(sliding_window: Any, causal: bool, where: str) -> tuple[int, int]:
    """HF's ``sliding_window=w``: a query sees the ``w`` keys ending at itself, i.e. flash-attn ``(w - 1, 0)``."""
    if sliding_window is None or sliding_window is False:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r} in {where}"
                         f"{rank_suffix()}")
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _spans(image_spans: Any, where: str) -> tuple[tuple[int, int], ...]:
    if image_spans is None:
        return ()
    try:
        out = tuple((int(a), int(b)) for a, b in image_spans)
    except (TypeError, ValueError):
        raise ValueError(f"image_spans must be ((start, end), ...) global positions (shard_batch makes them), got "
                         f"{image_spans!r:.80} in {where}{rank_suffix()}") from None
    return out


@functools.lru_cache(maxsize=16)
def _chunks_of_documents(cu: tuple[int, ...], size: int) -> PieceMask:
    """Chunks of ``size`` counted from each document's start, each causal on its own: a tree with no parents."""
    cuts = set(cu)
    for a, b in itertools.pairwise(cu):
        cuts.update(range(a + size, b, size))
    cuts_ = tuple(sorted(cuts))
    return tree(cuts_, (-1,) * (len(cuts_) - 1))


# -- transformers' mask functions --------------------------------------------------------------------------------

# Note [Reading transformers' mask functions]
#     transformers builds a layer type's mask from small functions (masking_utils): a base (causal or
#     bidirectional), overlays (sliding window, chunks, padding, packed sequences, a model's own) and combinators
#     (and_masks, or_masks, position remaps), then calls the registered mask function with the result. seqpar
#     attends from the layer itself (Note [Layer masks]), so a piece it does not derive from the layer would be
#     dropped silently. ``check_mask_function`` walks the closure tree and refuses every piece it does not know:
#     Gemma 3's image blocks built from token_type_ids given to the model (shard_batch turns them into global
#     image_spans instead), PaliGemma's prefix, any model's own overlay. A renamed transformers function is
#     refused too: loudly, never as plain causal. Under torch.compile the walk is skipped (dynamo does not give
#     a nested function's name, and reading it would break the graph every forward): run a model's first
#     forward eagerly to have its masks read; the attention function's own checks run either way.

_MU = "transformers.masking_utils"
_COMBINATORS = {(_MU, "and_masks.<locals>.and_mask"), (_MU, "or_masks.<locals>.or_mask"),
                (_MU, "remap_positions_for_packed_sequence.<locals>.inner_mask"),
                (_MU, "add_offsets_to_mask_function.<locals>.inner_mask")}
_LEAVES = {(_MU, "causal_mask_function"), (_MU, "bidirectional_mask_function"),
           (_MU, "sliding_window_overlay.<locals>.inner_mask"),
           (_MU, "sliding_window_bidirectional_overlay.<locals>.inner_mask"),
           (_MU, "padding_mask_function.<locals>.inner_mask"),
           (_MU, "packed_sequence_mask_function.<locals>.inner_mask"),
           # Gemma 3 with use_bidirectional_attention: |q - k| < w on sliding layers (module.is_causal is False)
           ("transformers.models.gemma3.modeling_gemma3", "_bidirectional_window_overlay.<locals>.inner_mask")}
_CHUNKS = (_MU, "chunked_overlay.<locals>.inner_mask")
_BLOCKS = (_MU, "blockwise_overlay.<locals>.inner_mask")


def check_mask_function(fn: Any, config: Any, name: str) -> None:
    """Raise ``NotImplementedError`` if transformers' ``mask_function`` holds a piece seqpar does not derive from
    the layer (Note [Reading transformers' mask functions]); ``config`` is the one transformers passes."""
    if fn is None or torch.compiler.is_compiling():       # dynamo cannot read a nested function's name
        return
    model = getattr(config, "model_type", "?")
    for leaf in _pieces(fn):
        key = (getattr(leaf, "__module__", None), getattr(leaf, "__qualname__", None) or type(leaf).__name__)
        if key in _LEAVES:
            continue
        if key == _CHUNKS:
            _check_chunks(leaf, config, name)
        elif key == _BLOCKS:
            raise NotImplementedError(
                f"the {model!r} model builds image blocks that attend bidirectionally (transformers' "
                f"blockwise_overlay, from token_type_ids given to the model): give token_type_ids to shard_batch "
                f"instead, which turns them into global image spans for attn_implementation={name!r}{rank_suffix()}")
        elif key[1].endswith("<lambda>") and getattr(config, "use_bidirectional_attention", False):
            continue                  # Gemma 3's bidirectional full layers: every key (module.is_causal is False)
        else:
            raise NotImplementedError(
                f"the {model!r} model builds its attention mask with {key[1]} (from {key[0]}), which seqpar does "
                f"not express: attn_implementation={name!r} refuses it rather than attend as plain causal"
                f"{rank_suffix()}")


def _pieces(fn: Any, depth: int = 0) -> list[Any]:
    """The leaves of a mask function's closure tree (combinators are walked through)."""
    if isinstance(fn, functools.partial):
        return _pieces(fn.func, depth + 1)
    key = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
    if key not in _COMBINATORS or depth > 32:
        return [fn]
    out = []
    for value in _cells(fn, ("mask_functions", "mask_function")).values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if inspect.isfunction(x) or isinstance(x, functools.partial):
                out.extend(_pieces(x, depth + 1))
    return out


def _cells(fn: Any, wanted: tuple[str, ...]) -> dict[str, Any]:
    """The closure cells ``wanted`` of ``fn`` by name; the others (tensors) are never read, so that under
    torch.compile the walk installs no guard on a batch's tensors (no recompile per batch)."""
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    out = {}
    for n, c in zip(names, fn.__closure__ or ()):
        if n in wanted:
            try:
                out[n] = c.cell_contents
            except ValueError:        # an empty cell
                pass
    return out


def _check_chunks(leaf: Any, config: Any, name: str) -> None:
    size = _cells(leaf, ("chunk_size",)).get("chunk_size")
    types = getattr(config, "layer_types", None) or ()
    if "chunked_attention" not in types or getattr(config, "attention_chunk_size", None) != size:
        raise NotImplementedError(
            f"the {getattr(config, 'model_type', '?')!r} model builds a chunked mask (chunk {size}) but its config "
            f"does not say which layers are chunked (layer_types {list(types)[:8]}, attention_chunk_size "
            f"{getattr(config, 'attention_chunk_size', None)}): attn_implementation={name!r} cannot place it"
            f"{rank_suffix()}")


# -- Llama 4's position-scaled queries ----------------------------------------------------------------------------

# Note [Position-scaled queries]
#     Llama 4's NoPE layers (``attn_temperature_tuning``, ``use_rope`` False) scale each query by
#     ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` with p = ``arange(L) + cache length``: the index of
#     the token in the tensor the layer got, not ``position_ids``. On a shard that index is local (0..L-1 on
#     every rank), so every rank past the first floor_scale tokens would be scaled wrong. The attention function
#     undoes the layer's factor and applies the one of the token's global index (its position in the packed row,
#     what one process computes; for a cache chunk, its cache position): ``q * s(global) / s(local)``, exact to
#     rounding. Nothing changes (and nothing runs) while every index is below ``floor_scale - 1``.


def query_scales(module: torch.nn.Module, where: str) -> tuple[int, float] | None:
    """``(floor_scale, attn_scale)`` of a layer that scales its queries by position (Note [Position-scaled
    queries]), None for any other layer."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    floor_scale, attn_scale = getattr(module, "floor_scale", None), getattr(module, "attn_scale", None)
    if not isinstance(floor_scale, int) or floor_scale < 1 or not isinstance(attn_scale, (int, float)):
        raise NotImplementedError(f"{where} scales its queries by position (attn_temperature_tuning) with "
                                  f"floor_scale={floor_scale!r}, attn_scale={attn_scale!r}, which seqpar does not "
                                  f"know how to place at global positions{rank_suffix()}")
    return floor_scale, float(attn_scale)


def rescale_queries(query_BHLD: torch.Tensor, true_pos: torch.Tensor, model_pos: torch.Tensor,
                    scales: tuple[int, float]) -> torch.Tensor:
    """``query (B, H, L, D)`` scaled at ``model_pos (L,)`` -> scaled at ``true_pos (L,)`` (Note [Position-scaled
    queries])."""
    floor_scale, attn_scale = scales

    def s(p: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((p.float() + 1.0) / floor_scale)) * attn_scale + 1.0

    ratio = (s(true_pos.to(query_BHLD.device)) / s(model_pos.to(query_BHLD.device)))
    return (query_BHLD * ratio.view(1, 1, -1, 1)).to(query_BHLD.dtype)
