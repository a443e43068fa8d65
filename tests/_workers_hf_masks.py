"""Worker-side code of tests/test_hf_masks.py: tiny models whose layers carry special masks, sequence-parallel
against one process.

Gemma 3 with its vision tower (image tokens attending bidirectionally within their image, on full and sliding
layers), Llama 4's text model (chunked layers, a NoPE layer with position-scaled queries), Gemma 3's text model
with alternating sliding and full layers; generate over the sharded cache; and the misuses that must raise.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import itertools
from typing import Any

import torch
import torch.distributed as dist

import seqpar
from seqpar.integrations import hf_generate
from seqpar.integrations import huggingface as sp_hf
from seqpar.integrations.hf import attention as hf_attention
from seqpar.integrations.hf.grads import _reduce_groups
from seqpar.testing import rel_error

VOCAB = 64
IMAGE = 63             # Gemma 3's image token id (inside the vocabulary: no remapping)
IMAGE_TOKENS = 16      # tokens per image (4 x 4 after pooling)
inference_attend = importlib.import_module("seqpar.inference.attend")   # the module (the package exports the function)


def _text(layers: int, **over: Any) -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                attention_dropout=0.0, use_cache=False, tie_word_embeddings=False, **over)


def config(kind: str, **over: Any):
    """A tiny config: "gemma3" (vision tower + text, a sliding layer of window 6 < an image's 16 tokens, and a full
    one), "gemma3_text" (4 layers: sliding 4, full, sliding 4, full), "llama4" (chunks of 8: layers 0-2 chunked,
    layer 3 NoPE full with position-scaled queries from position 3 on)."""
    import transformers as tf

    if kind == "gemma3":
        text = _text(2, sliding_window=6, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"],
                     pad_token_id=0, bos_token_id=None, eos_token_id=None)
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      image_size=16, patch_size=2, num_channels=3)
        return tf.Gemma3Config(text_config={**text, **over}, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                               image_token_index=IMAGE, boi_token_index=61, eoi_token_index=62)
    if kind == "gemma3_text":
        return tf.Gemma3TextConfig(**{**_text(4, sliding_window=4, query_pre_attn_scalar=8, pad_token_id=0,
                                              bos_token_id=None, eos_token_id=None,
                                              layer_types=["sliding_attention", "full_attention"] * 2), **over})
    if kind == "llama":
        return tf.LlamaConfig(**{**_text(2), **over})
    if kind == "llama4":
        cfg = {**_text(4, attention_chunk_size=8, floor_scale=4, moe_layers=[], intermediate_size_mlp=64,
                       pad_token_id=0, bos_token_id=None, eos_token_id=None), **over}
        return tf.Llama4TextConfig(**cfg)
    raise ValueError(kind)


def build(kind: str, attn: Any, seed: int = 0, **over: Any):
    """The model of ``kind`` from ``seed`` with attention ``attn`` (a name, or a dict per sub-config)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = copy.deepcopy(config(kind, **over))
    if kind == "gemma3":
        model = tf.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation=attn)
        with torch.no_grad():            # transformers zeroes the projection: images would be zero vectors
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(
                std=0.5, generator=torch.Generator().manual_seed(seed))
        return model
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


def _mesh(spec: dict[str, Any]):
    return seqpar.make_mesh(ulysses=spec.get("ulysses", 2), device_type="cpu") if spec["method"] == "usp" else None


def _grad_errors(model_sp, model_ref, out: dict[str, float], what: str = "grad") -> None:
    """Per parameter: max |sp - ref| over max |ref|, that scale at least 1e-3 of the largest over all parameters
    (Gemma's norm weights start at 0, and a gradient zero in exact arithmetic is rounding noise on both sides)."""
    ref = dict(model_ref.named_parameters())
    pairs = {n: (p.grad, ref[n].grad) if what == "grad" else (p.detach(), ref[n].detach())
             for n, p in model_sp.named_parameters()}
    floor = 1e-3 * max((b.abs().max().item() for _, b in pairs.values() if b is not None), default=1.0)
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            err = 0.0 if a is None and b is None else float("inf")
        else:
            err = (a - b).abs().max().item() / max(b.abs().max().item(), floor)
        out[f"{what}:{name}"] = max(out.get(f"{what}:{name}", 0.0), err)


def _global_loss(loss: torch.Tensor, mesh) -> torch.Tensor:
    total = loss.detach().clone()
    for g in _reduce_groups(mesh):
        dist.all_reduce(total, group=g)
    return total


# -- Gemma 3 with images -------------------------------------------------------------------------------------------


def merged_embeddings(model, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """What Gemma3Model.forward feeds its language model: token embeddings with every image token replaced by its
    image's features (the vision tower runs here, on the whole batch)."""
    inner = model.model
    embeds = inner.get_input_embeddings()(ids)
    feats = inner.get_image_features(pixels, return_dict=True).pooler_output.to(embeds.dtype)
    return embeds.masked_scatter((ids == IMAGE)[..., None].expand_as(embeds), feats)


def _image_batch(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``input_ids`` with ``spec["images"]`` (start positions) of 16 image tokens each, in every row; pixels."""
    g = torch.Generator().manual_seed(spec.get("data_seed", 3))
    B, S = spec.get("batch", 1), spec["seq"]
    ids = torch.randint(1, 60, (B, S), generator=g)
    for a in spec["images"]:
        ids[:, a:a + IMAGE_TOKENS] = IMAGE
    labels = ids.masked_fill(ids == IMAGE, -100)
    for a in spec.get("cu", (0, S))[1:-1]:        # a document's first token is never the previous one's target
        labels[:, a] = -100
    pixels = torch.randn(B * len(spec["images"]), 3, 16, 16, generator=g)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels, "token_type_ids": (ids == IMAGE).long()}


def gemma3_images(spec: dict[str, Any]) -> dict[str, float]:
    """Gemma 3 with images, one SGD step: loss, logits and every gradient (vision tower included) against one
    process. Without documents the reference is transformers' own path (input_ids, pixel_values,
    token_type_ids); with ``spec["cu"]`` (packed documents) it is each document run alone."""
    mesh = _mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout"), name="seqpar_g3")
    try:
        ref = build("gemma3", "sdpa")
        sp = build("gemma3", {"text_config": handle.name, "vision_config": "sdpa"})
        batch = _image_batch(spec)
        cu = spec.get("cu")
        errors: dict[str, float] = {}
        if cu is None:
            out_ref = ref(**batch)
            loss_ref, logits_ref = out_ref.loss, out_ref.logits.detach()
        else:
            loss_ref, logits_ref = _per_document(ref, batch, cu), None
        loss_ref.backward()
        embeds = merged_embeddings(sp, batch["input_ids"], batch["pixel_values"])
        glob = {"inputs_embeds": embeds, "token_type_ids": batch["token_type_ids"], "labels": batch["labels"]}
        if cu is not None:
            glob["position_ids"] = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])[None]
        local = handle.shard_batch(glob)
        errors["spans"] = float(local["image_spans"] != tuple((a, a + IMAGE_TOKENS) for a in spec["images"]))
        with _patched(_without(spec.get("without"))):
            out = sp(**local)
        out.loss.backward()
        sp_hf.all_reduce_gradients(sp.parameters(), mesh)
        errors["loss"] = rel_error(_global_loss(out.loss, mesh), loss_ref.detach())
        if logits_ref is not None:
            truth = seqpar.shard(logits_ref, mesh=mesh, method=handle.method, layout=handle.layout, dim=1)
            errors["logits"] = rel_error(out.logits.detach(), truth)
        _grad_errors(sp, ref, errors)
        return errors
    finally:
        handle.disable()


def _per_document(model, batch: dict[str, torch.Tensor], cu: tuple[int, ...]) -> torch.Tensor:
    """The packed batch's mean target loss from each document run alone on one process."""
    embeds = merged_embeddings(model, batch["input_ids"], batch["pixel_values"])
    total, count = 0.0, 0
    for a, b in itertools.pairwise(cu):
        labels = batch["labels"][:, a:b]
        n = int((labels[:, 1:] != -100).sum())
        out = model(inputs_embeds=embeds[:, a:b], token_type_ids=batch["token_type_ids"][:, a:b], labels=labels)
        total = total + out.loss * n
        count += n
    return total / count


# -- Llama 4 and interleaved sliding layers: training ----------------------------------------------------------------


def _without(what: str | None):
    """A control: the integration with one thing it honours switched off ("scales": Llama 4's query scaling,
    "masks": every layer's special mask, "windows": every sliding window), to show a test depends on it."""
    if what == "scales":
        return {"query_scales": lambda module, where: None}
    if what in ("masks", "windows"):
        real = hf_attention.layer_mask

        def plain(module, **kw):
            lm = real(module, **kw)
            if what == "windows":
                return dataclasses.replace(lm, window=(-1, -1))
            return dataclasses.replace(lm, mask=None, causal=bool(getattr(module, "is_causal", True)))
        return {"layer_mask": plain}
    return {}


@contextlib.contextmanager
def _patched(names: dict[str, Any], module: Any = hf_attention):
    saved = {k: getattr(module, k) for k in names}
    try:
        for k, v in names.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def train_compare(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["kind"]`` ("llama4", "gemma3_text"), ``spec["steps"]`` SGD steps sequence-parallel vs one process:
    the largest errors of loss, logits, gradients and final parameters; and the (causal, window, mask) of every
    ``seqpar.attention`` call of the first forward, in call order. ``spec["without"]``: a control (``_without``)."""
    mesh = _mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout"), name="seqpar_tc")
    calls: list[tuple] = []
    inner = hf_attention.attention

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append((kwargs["causal"], kwargs["window_size"], repr(kwargs.get("mask_mod"))))
        return inner(*args, **kwargs)

    try:
        dtype = getattr(torch, spec.get("dtype", "float32"))
        ref = build(spec["kind"], "sdpa", **spec.get("over", {})).to(dtype)
        sp = build(spec["kind"], handle.name, **spec.get("over", {})).to(dtype)
        opt_ref, opt_sp = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, sp))
        batch = _text_batch(spec)
        local = handle.shard_batch(batch)
        cu = local.get("cu_seq_lens_q")
        cu = None if cu is None else tuple(cu.tolist())
        layout = sp_hf.batch_layout(handle.method, handle.layout, cu)
        errors: dict[str, Any] = {"loss": 0.0, "logits": 0.0}
        for step in range(spec.get("steps", 2)):
            for o in (opt_ref, opt_sp):
                o.zero_grad(set_to_none=True)
            out_ref = ref(**batch)
            with _patched({"attention": recording if step == 0 else inner, **_without(spec.get("without"))}):
                out = sp(**local)
            out_ref.loss.backward()
            out.loss.backward()
            sp_hf.all_reduce_gradients(sp.parameters(), mesh)
            errors["loss"] = max(errors["loss"], rel_error(_global_loss(out.loss, mesh), out_ref.loss.detach()))
            truth = seqpar.shard(out_ref.logits.detach(), mesh=mesh, method=handle.method, dim=1, layout=layout,
                                 cu_seqlens=cu)
            errors["logits"] = max(errors["logits"], rel_error(out.logits.detach(), truth))
            _grad_errors(sp, ref, errors)
            opt_ref.step()
            opt_sp.step()
        _grad_errors(sp, ref, errors, what="param")
        errors["calls"] = calls
        return errors
    finally:
        handle.disable()


def _text_batch(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.get("data_seed", 1))
    B, S = spec.get("batch", 1), spec["seq"]
    ids = torch.randint(1, VOCAB, (B, S), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    cu = spec.get("cu")
    if cu is not None:                   # packed documents, DataCollatorWithFlattening style
        batch["position_ids"] = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)]).expand(B, S)
        for a in cu[1:-1]:
            batch["labels"][:, a] = -100
    return batch


# -- generate ------------------------------------------------------------------------------------------------------


def generate_compare(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy ``sp_hf.generate`` against ``model.generate`` on one process: tokens equal, per-step logits error
    (``spec["without"]``: a control, ``_generate_control``). Kind "gemma3": a prompt with ``spec["images"]``
    (``_image_batch``), its pixel_values and token_type_ids; ``spec["turn"]`` text tokens then continue the
    conversation on the sharded cache, against the whole conversation generated from scratch (``turn_*``)."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = build(spec["kind"], "sdpa", use_cache=True, **spec.get("over", {})).to(dtype).eval()
    B, S = spec.get("batch", 1), spec["seq"]
    media: dict[str, torch.Tensor] = {}
    if spec["kind"] == "gemma3":
        batch = _image_batch(spec)
        ids = batch["input_ids"]
        media = {"pixel_values": batch["pixel_values"].to(dtype), "token_type_ids": batch["token_type_ids"]}
    else:
        ids = torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(spec.get("data_seed", 2)))
    mask = torch.ones(B, S, dtype=torch.long)
    for b, n in enumerate(spec.get("pad", ())):
        ids[b, :n] = 0
        mask[b, :n] = 0
    kw = dict(max_new_tokens=spec.get("new", 5), do_sample=False, return_dict_in_generate=True, output_logits=True)
    sp_kw = dict(mesh=_mesh(spec), method=spec["method"], layout=spec.get("layout"), prefill_chunk=spec.get("chunk"))
    ref = model.generate(ids, attention_mask=mask, **media, **kw)
    with _generate_control(spec.get("without")):
        res = sp_hf.generate(model, ids, attention_mask=mask, **sp_kw, **media, **kw)
    out = {"same_tokens": bool(torch.equal(res.sequences, ref.sequences)),
           "logits": rel_error(torch.stack(res.logits, 1), torch.stack(ref.logits, 1))}
    if spec.get("turn"):
        extra = torch.randint(1, 60, (B, spec["turn"]), generator=torch.Generator().manual_seed(9))
        ids = torch.cat([ref.sequences, extra], 1)
        mask = torch.cat([mask, torch.ones_like(ids[:, S:])], 1)
        types = torch.cat([media["token_type_ids"], torch.zeros_like(ids[:, S:])], 1)
        ref = model.generate(ids, attention_mask=mask, pixel_values=media["pixel_values"], token_type_ids=types, **kw)
        res = sp_hf.generate(model, ids, attention_mask=mask, cache=res.cache, token_type_ids=types, **sp_kw, **kw)
        out.update(turn_same_tokens=bool(torch.equal(res.sequences, ref.sequences)),
                   turn_logits=rel_error(torch.stack(res.logits, 1), torch.stack(ref.logits, 1)))
    return out


def _generate_control(what: str | None):
    """``_without(what)``, or for Gemma 3's images in generate's prefill: "spans" (no image spans) or
    "image_windows" (a sliding window that does not cut images: ``causal window OR same image``)."""
    if what == "spans":
        return _patched({"spans": lambda _: None}, hf_generate)
    if what != "image_windows":
        return _patched(_without(what))
    real = inference_attend.sp_attention

    def uncut(*args: Any, mask_mod: Any = None, window_size: tuple[int, int] = (-1, -1), **kwargs: Any) -> Any:
        if mask_mod is not None and window_size[0] >= 0:
            mask_mod, window_size = seqpar.masks.spans(mask_mod.spans, window=window_size[0]), (-1, -1)
        return real(*args, mask_mod=mask_mod, window_size=window_size, **kwargs)
    return _patched({"sp_attention": uncut}, inference_attend)


# -- what must raise ---------------------------------------------------------------------------------------------------


def expect_error(spec: dict[str, Any]) -> tuple[str, str] | None:
    """Run one misuse (``spec["case"]``); ``(type name, message)`` of what it raised, None if nothing raised."""
    handle = sp_hf.enable(None, method="ring", layout="zigzag", name="seqpar_bad")
    try:
        _misuse(spec["case"], handle)
    except Exception as e:   # the parent inspects the type and the message
        return type(e).__name__, str(e)
    finally:
        handle.disable()
    return None


def _misuse(case: str, handle) -> None:
    seq = {"seq": 32, "images": (8,)}
    if case == "types_to_model":         # token_type_ids sharded as a plain input: the model builds image blocks
        batch = _image_batch(seq)
        local = handle.shard_batch({"input_ids": batch["input_ids"], "token_type_ids": batch["token_type_ids"]},
                                   seq_keys=["token_type_ids"])
        build("gemma3", {"text_config": handle.name, "vision_config": "sdpa"})(**local)
    elif case == "spans_on_llama":       # Gemma 3's image spans given to a model without them
        batch = _image_batch(seq)
        local = handle.shard_batch({"input_ids": batch["input_ids"], "token_type_ids": batch["token_type_ids"]})
        build("llama", handle.name)(**local)
    elif case == "vision_tower":         # the tower's attention registered as seqpar's
        batch = _image_batch(seq)
        model = build("gemma3", handle.name)
        merged_embeddings(model, batch["input_ids"], batch["pixel_values"])
    elif case == "layer_type":           # a layer type seqpar does not know (Llama's masks ignore layer_types)
        model = build("llama", handle.name)
        model.config.layer_types = ["full_attention", "compressed_sparse_attention"]
        model(**handle.shard_batch({"input_ids": torch.ones(1, 32, dtype=torch.long)}))
    elif case == "mask_4d":
        model = build("llama4", handle.name)
        local = handle.shard_batch({"input_ids": torch.ones(1, 32, dtype=torch.long)})
        L = local["input_ids"].shape[1]
        model(**local, attention_mask=torch.ones(1, 1, L, L, dtype=torch.bool).tril())
    elif case == "images_in_llama_generate":     # only Gemma 3's images are served
        batch = _image_batch(seq)
        sp_hf.generate(build("llama", "sdpa", use_cache=True).eval(), batch["input_ids"],
                       pixel_values=batch["pixel_values"], max_new_tokens=2)
    elif case in ("image_tokens_in_generate", "image_cut_by_prefill_chunk", "image_last_token",
                  "ragged_images_in_generate", "images_in_continuation"):
        _misuse_gemma3_generate(case)
    elif case == "ragged_images":        # rows with different images
        batch = _image_batch({**seq, "batch": 2})
        batch["token_type_ids"][1, 8] = 0
        handle.shard_batch({"input_ids": batch["input_ids"], "token_type_ids": batch["token_type_ids"]})
    else:
        raise ValueError(case)


def _misuse_gemma3_generate(case: str) -> None:
    """Gemma 3 image prompts the sharded generate refuses (Note [Images in generate])."""
    model = build("gemma3", "sdpa", use_cache=True).eval()
    batch = _image_batch({"seq": 32, "images": (8,), "batch": 2 if case == "ragged_images_in_generate" else 1})
    ids, media = batch["input_ids"], {"pixel_values": batch["pixel_values"], "token_type_ids": batch["token_type_ids"]}
    kw = dict(method="ring", layout="zigzag", max_new_tokens=2)
    if case == "image_tokens_in_generate":       # image tokens without their pixels
        sp_hf.generate(model, ids, token_type_ids=media["token_type_ids"], **kw)
    elif case == "image_cut_by_prefill_chunk":   # the image [8, 24) crosses the first chunk's end, 12
        sp_hf.generate(model, ids, prefill_chunk=12, **media, **kw)
    elif case == "image_last_token":             # the image [8, 24) ends the prompt
        sp_hf.generate(model, ids[:, :24], pixel_values=media["pixel_values"],
                       token_type_ids=media["token_type_ids"][:, :24], **kw)
    elif case == "ragged_images_in_generate":    # rows with different images
        media["token_type_ids"][1, 8] = 0
        sp_hf.generate(model, ids, **media, **kw)
    else:                                        # a second turn that adds an image
        out = sp_hf.generate(model, ids, return_dict_in_generate=True, **media, **kw)
        more = torch.cat([out.sequences, ids], 1)
        types = torch.cat([torch.zeros_like(out.sequences), media["token_type_ids"]], 1)
        sp_hf.generate(model, more, cache=out.cache, pixel_values=media["pixel_values"], token_type_ids=types,
                       max_new_tokens=2)
