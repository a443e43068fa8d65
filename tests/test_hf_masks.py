"""Models whose layers carry special masks, through ``seqpar.integrations.huggingface``, against one process.

Tiny random-weight models, fp32, gloo ranks (Note [Layer masks] in ``seqpar.integrations.hf.layers``):

- Gemma 3 with its vision tower: image tokens (``token_type_ids == 1`` runs) attend bidirectionally within
  their image, on the full layer and on the sliding one (window 6, shorter than an image's 16 tokens, so the
  window cuts inside images); ``shard_batch`` turns ``token_type_ids`` into global image spans. Loss, logits and
  every gradient, the vision tower's included, match transformers' own path (``pixel_values``, ``input_ids``,
  ``token_type_ids``); packed documents match each document run alone.
- Llama 4's text model: chunked layers (``attention_chunk_size`` 8; chunks restart at each packed document, as
  transformers numbers them by ``position_ids``) and a NoPE layer whose queries are scaled by position
  (``floor_scale`` 4: every rank's tokens past position 3 are scaled, by their global index).
- Gemma 3's text model with alternating sliding (window 4) and full layers: each layer's own window.
- generate over the sharded cache: Gemma 3 text (its sliding layers), Gemma 3 with images (image spans in the
  prefill, cut by the sliding window) and Llama 4 within one chunk and past it.
- Controls: each behaviour switched off in the integration makes its comparison fail, so each test depends on
  what it claims to check.
- What cannot be expressed is refused by name, on every rank, naming the rank.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")

from _workers_hf_masks import expect_error, gemma3_images, generate_compare, train_compare

from seqpar.integrations.hf import batch as hf_batch
from seqpar.integrations.hf import layers

TOL = 1e-5
CONTROL = 3 * TOL     # a control (something switched off) must miss by this much (matches give ~1e-7)


def _check(results: list, label: str) -> None:
    for r, errors in enumerate(results):
        bad = {k: f"{v:.2e}" for k, v in errors.items() if isinstance(v, float) and not v <= TOL}
        assert not bad, f"{label} rank {r}: {bad}"
        assert "loss" in errors and any(k.startswith("grad:") for k in errors), errors


def _fails(results: list, label: str) -> None:
    for r, errors in enumerate(results):
        worst = max((v for v in errors.values() if isinstance(v, float)), default=0.0)
        assert worst >= CONTROL, f"control {label} rank {r} still matches ({worst:.1e}): the test does not see it"


GEMMA3 = {2: [{"method": "ring", "layout": "zigzag", "seq": 48, "images": (4, 26)},
              {"method": "ring", "layout": None, "seq": 48, "images": (4, 26), "cu": (0, 20, 48)}],   # balanced
          4: [{"method": "usp", "layout": "zigzag", "ulysses": 2, "seq": 48, "images": (10, 30)},
              {"method": "ulysses", "layout": "contiguous", "seq": 48, "images": (2, 30), "cu": (0, 22, 48)}]}


@pytest.mark.parametrize("world", [2, 4])
def test_gemma3_images_match_single_process(pools, world):
    """Gemma 3 with images (two per row, one step): shard_batch's image spans and every layer's mask."""
    for spec in GEMMA3[world]:
        _check(pools(world).run(gemma3_images, spec), str(spec))
    if world == 2:                        # without the image spans / without the window inside an image
        for spec, without in ((GEMMA3[2][1], "masks"), (GEMMA3[2][0], "masks"), (GEMMA3[2][0], "windows")):
            _fails(pools(2).run(gemma3_images, {**spec, "without": without}), without)


LLAMA4 = {2: [{"method": "ring", "layout": "zigzag", "seq": 32},
              {"method": "ring", "layout": None, "seq": 32, "cu": (0, 5, 19, 32)}],        # balanced
          4: [{"method": "usp", "layout": "zigzag", "ulysses": 2, "seq": 32},
              {"method": "ulysses", "layout": "contiguous", "seq": 32, "cu": (0, 11, 32)}]}
CHUNKED = "Chunked(size=8)"


@pytest.mark.parametrize("world", [2, 4])
def test_llama4_chunked_layers_match_single_process(pools, world):
    """Llama 4 text, two SGD steps: chunked layers 0-2 (chunked(8), or chunks per document when packed), layer 3
    plain causal with its queries scaled at global positions."""
    for spec in LLAMA4[world]:
        spec = {**spec, "kind": "llama4"}
        results = pools(world).run(train_compare, spec)
        _check(results, str(spec))
        for errors in results:
            masks = [m for _, _, m in errors["calls"]]
            assert masks[3] == "None" and len(masks) == 4, masks
            if "cu" not in spec:
                assert masks[:3] == [CHUNKED] * 3 and [c for c, _, _ in errors["calls"]] == [True] * 4, errors["calls"]
            else:                         # chunks restart at each document: a tree of chunks, causal within each
                assert all("Tree(cuts=" in m for m in masks[:3]), masks
    if world == 2:
        for without in ("masks", "scales"):
            spec = {**LLAMA4[2][0], "kind": "llama4", "without": without}
            _fails(pools(2).run(train_compare, spec), without)


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_sliding_layers_get_their_own_windows(pools, world):
    """Gemma 3 text, layers sliding (4) / full / sliding / full: each call gets its layer's window."""
    spec = {"kind": "gemma3_text", "method": "ring", "layout": "zigzag", "seq": 32}
    if world == 4:                        # fp64: a second SGD step on Gemma's zero-started norm weights lifts
        spec = {**spec, "method": "usp", "ulysses": 2, "cu": (0, 13, 32), "layout": None,   # fp32 noise to 1e-5
                "dtype": "float64"}
    results = pools(world).run(train_compare, spec)
    _check(results, str(spec))
    for errors in results:
        assert [w for _, w, _ in errors["calls"]] == [(3, 0), (-1, -1), (3, 0), (-1, -1)], errors["calls"]
    if world == 2:
        _fails(pools(2).run(train_compare, {**spec, "without": "windows"}), "windows")


GENERATE = [
    {"kind": "gemma3_text", "method": "ring", "seq": 20, "new": 6},
    {"kind": "llama4", "method": "ring", "seq": 20, "new": 6, "batch": 2, "pad": (0, 3),
     "over": {"attention_chunk_size": 32, "no_rope_layers": [1, 0, 1, 1]}},      # a NoPE layer before the last
    {"kind": "llama4", "method": "ring", "layout": "contiguous", "seq": 20, "new": 6, "chunk": 7,
     "over": {"attention_chunk_size": 32, "no_rope_layers": [1, 0, 1, 1]}},      # prefill in chunks: extension
    # past the first chunk: chunks of 8 cache positions in the fill, the extensions and every decode step
    {"kind": "llama4", "method": "ring", "seq": 20, "new": 6, "batch": 2, "pad": (0, 3),
     "over": {"attention_chunk_size": 8, "no_rope_layers": [1, 0, 1, 1]}},
    {"kind": "llama4", "method": "ring", "layout": "contiguous", "seq": 20, "new": 6, "chunk": 7,
     "over": {"attention_chunk_size": 8}},
]


def test_generate_with_sliding_and_chunked_layers(pools):
    """Greedy generate over the sharded cache, W = 2: Gemma 3 text (sliding layers) and Llama 4 within one chunk
    and past it (left padding; a prompt prefilled in chunks) give transformers' tokens and logits."""
    for spec in GENERATE:
        for r, res in enumerate(pools(2).run(generate_compare, spec)):
            assert res["same_tokens"] and res["logits"] <= TOL, (spec, r, res)
    for spec, without in ((GENERATE[0], "windows"), (GENERATE[1], "scales")):
        for r, res in enumerate(pools(2).run(generate_compare, {**spec, "without": without})):
            assert res["logits"] >= CONTROL, (without, r, res)


GENERATE_IMAGES = {
    2: [{"method": "ring", "layout": "zigzag", "seq": 48, "images": (4, 26), "turn": 4},   # + a text-only turn
        {"method": "ulysses", "layout": "contiguous", "seq": 45, "images": (3, 22), "batch": 2, "pad": (0, 2),
         "chunk": 40}],                   # left padding; the second prefill chunk extends the cache causally
    4: [{"method": "usp", "layout": "zigzag", "ulysses": 2, "seq": 48, "images": (10, 30)},
        {"method": "ring", "layout": "zigzag", "seq": 48, "images": (4, 26), "chunk": 44}],
}


@pytest.mark.parametrize("world", [2, 4])
def test_generate_with_images_matches_single_process(pools, world):
    """Gemma 3 with images (window 6 < an image's 16 tokens: the sliding layer's window cuts inside images):
    greedy generate over the sharded cache gives transformers' tokens and logits (Note [Images in generate])."""
    for spec in GENERATE_IMAGES[world]:
        spec = {**spec, "kind": "gemma3", "new": 5}
        for r, res in enumerate(pools(world).run(generate_compare, spec)):
            assert res["same_tokens"] and res["logits"] <= TOL, (spec, r, res)
            assert "turn" not in spec or (res["turn_same_tokens"] and res["turn_logits"] <= TOL), (spec, r, res)
    if world == 2:                        # without the image spans / a window that cuts images / any window
        for without in ("spans", "image_windows", "windows"):
            spec = {**GENERATE_IMAGES[2][0], "kind": "gemma3", "new": 5, "turn": None, "without": without}
            for r, res in enumerate(pools(2).run(generate_compare, spec)):
                assert res["logits"] >= CONTROL, (without, r, res)


ERRORS = [
    ("types_to_model", "NotImplementedError", ["'gemma3_text' model builds image blocks", "blockwise_overlay",
                                               "give token_type_ids to shard_batch"]),
    ("spans_on_llama", "NotImplementedError", ["image_spans", "Gemma 3 layers only", "LlamaAttention", "'llama'"]),
    ("vision_tower", "NotImplementedError", ["SiglipAttention", "'siglip_vision_model' tower", "'vision_config'"]),
    ("layer_type", "NotImplementedError", ["layer type 'compressed_sparse_attention'", "config.layer_types[1]",
                                           "refused rather than attended as plain causal"]),
    ("mask_4d", "ValueError", ["attention_mask must be None", "(1, 1, 16, 16)", "Llama4TextAttention"]),
    ("images_in_llama_generate", "NotImplementedError", ["pixel_values is not supported", "(LlamaForCausalLM)",
                                                         "only Gemma 3's images"]),
    ("image_tokens_in_generate", "NotImplementedError", ["media token 63 (image_token_id) without its features",
                                                         "give pixel_values"]),
    ("image_cut_by_prefill_chunk", "NotImplementedError", ["images must lie in the first prefill chunk",
                                                           "prefill_chunk=12", "images at [(8, 24)]"]),
    ("image_last_token", "NotImplementedError", ["last prompt token (position 23) must be text"]),
    ("ragged_images_in_generate", "NotImplementedError", ["token_type_ids must mark the same image positions"]),
    ("images_in_continuation", "NotImplementedError", ["continues a cache of 33 tokens", "must add no images",
                                                       "got pixel_values"]),
    ("ragged_images", "NotImplementedError", ["token_type_ids must mark the same image positions in every row"]),
]


def test_what_cannot_be_expressed_is_refused_on_every_rank(pools):
    """Each misuse raises the same clear error on both ranks, with the rank, before attending as plain causal."""
    for case, etype, fragments in ERRORS:
        results = pools(2).run(expect_error, {"case": case})
        for r, res in enumerate(results):
            assert res is not None, f"rank {r} accepted {case}"
            name, msg = res
            assert name == etype, (case, name, msg)
            assert f"(rank {r} of 2)" in msg, msg
            for frag in fragments:
                assert frag in msg, f"{case}: {frag!r} not in {msg!r}"
        assert len({re.sub(r" \(rank \d+ of \d+\)", "", m) for _, m in results}) == 1, results


def test_mask_function_pieces():
    """transformers' mask functions: known pieces pass, others are refused by name (one process)."""
    from transformers import Gemma3TextConfig, Llama4TextConfig, LlamaConfig
    from transformers import masking_utils as mu

    llama4 = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8)
    ok = [mu.causal_mask_function, mu.sliding_window_causal_mask_function(4),
          mu.chunked_causal_mask_function(8, None),
          mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None),
                       mu.packed_sequence_mask_function(None)), None]
    for fn in ok:
        layers.check_mask_function(fn, llama4, "sp")
    cases = [(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(None)), llama4, "blockwise_overlay"),
             (mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q >= 0), llama4, "<lambda>"),
             (mu.chunked_causal_mask_function(8, None), LlamaConfig(), "builds a chunked mask (chunk 8)")]
    for fn, cfg, frag in cases:
        with pytest.raises(NotImplementedError, match=re.escape(frag)):
            layers.check_mask_function(fn, cfg, "sp")
    bidirectional = Gemma3TextConfig(use_bidirectional_attention=True)       # Gemma 3's "everything" overlay
    layers.check_mask_function(mu.or_masks(mu.causal_mask_function, lambda *a: True), bidirectional, "sp")


def test_image_spans_from_token_type_ids():
    """Runs of token_type_ids == 1 (any other value is text, as in transformers' gemma3), the same in every row."""
    import torch

    types = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 2, 1]]).expand(2, 10)
    assert hf_batch._image_spans(types, 2, 10) == ((0, 2), (4, 7), (9, 10))
    assert hf_batch._image_spans(torch.zeros(1, 10, dtype=torch.long), 1, 10) == ()
    with pytest.raises(TypeError, match=r"\['token_type_ids'\] must be a \(1, 10\) integer tensor"):
        hf_batch._image_spans(torch.zeros(1, 10), 1, 10)
