"""Worker-side code of tests/test_hf.py: tiny transformers models trained sequence-parallel and on one process.

Every rank builds the same model twice from one seed: the reference with transformers' own "sdpa" attention on
the global batch, and the sequence-parallel one with attn_implementation="seqpar" on its shard. Both take the
same optimizer steps; the worker returns the largest normalised errors (loss per step, every parameter's
gradient at every step, the final parameters) and the parent asserts on them.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

import seqpar
from seqpar.integrations import huggingface as sp_hf
from seqpar.integrations.hf import attention as hf_attention
from seqpar.integrations.hf.grads import _reduce_groups
from seqpar.testing import rel_error

VOCAB = 64
REFERENCE_ATTN = {"gpt_oss": "eager", "gemma2": "eager"}
"""The single-process attention of families transformers serves without SDPA (sinks, softcapping)."""


def model_config(family: str, dtype: torch.dtype = torch.float32, **over: Any):
    """A tiny config of ``family`` (GQA: 4 query heads, 2 KV heads, head_dim 8; 2 layers)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                  attention_dropout=0.0, use_cache=False, tie_word_embeddings=False, dtype=dtype)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "mistral":            # every layer slides
        cfg = tf.MistralConfig(**common, sliding_window=8)
    elif family == "qwen2":              # layer 0 full, layer 1 sliding
        cfg = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    elif family == "qwen3":              # q/k norms; layer 1 sliding
        cfg = tf.Qwen3Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    elif family == "gpt_oss":            # attention sinks (s_aux), a sliding layer, experts
        cfg = tf.GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"])
    elif family == "gemma2":             # logit softcapping (softcap), a sliding layer, its own scaling
        cfg = tf.Gemma2Config(**common, attn_logit_softcapping=5.0, final_logit_softcapping=None,
                              query_pre_attn_scalar=8, sliding_window=8)
    elif family == "gemma":              # head dim 256
        cfg = tf.GemmaConfig(**{**common, "head_dim": 256})
    elif family == "deepseek_v3":        # MLA: q/k head dim 24 (16 + rope 8), v head dim 8; experts
        mla = {k: v for k, v in common.items() if k != "head_dim"}
        cfg = tf.DeepseekV3Config(**{**mla, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=2,
                                  num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=16,
                                  first_k_dense_replace=1, n_group=1, topk_group=1, rope_scaling=None)
    else:
        raise ValueError(family)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def build(family: str, attn: str, seed: int = 0, dtype: torch.dtype = torch.float32, **over: Any):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(family, dtype, **over), attn_implementation=attn)
    return model.to(dtype)


def checkpoint_layers(model) -> None:
    """Activation checkpointing of every decoder layer (transformers >= 5.2x renamed the method)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def make_mesh(spec: dict[str, Any]):
    """The sequence-parallel mesh of this rank: the whole world, or with ``spec["dp"]`` one of dp groups."""
    dp = spec.get("dp", 1)
    if dp == 1:
        if spec["method"] == "usp":
            return seqpar.make_mesh(ulysses=spec.get("ulysses", 2), device_type="cpu")
        return None
    from torch.distributed.device_mesh import init_device_mesh

    sp = dist.get_world_size() // dp
    if spec["method"] == "usp":
        u = spec.get("ulysses", 2)
        mesh = init_device_mesh("cpu", (dp, sp // u, u), mesh_dim_names=("dp", "ring", "ulysses"))
        return mesh["ring", "ulysses"]
    return init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp", "sp"))["sp"]


def dp_index(spec: dict[str, Any]) -> int:
    """Which data-parallel replica this rank belongs to (replicas are consecutive blocks of ranks)."""
    return dist.get_rank() // (dist.get_world_size() // spec.get("dp", 1))


def global_batch(spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The same global batch on every rank: tokens, labels, and the document structure ``spec["docs"]``."""
    g = torch.Generator().manual_seed(spec.get("data_seed", 1) + 1000 * dp_index(spec))
    B, S = spec.get("batch", 1), spec.get("seq", 32)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "labels": ids.clone()}
    docs = spec.get("docs")
    if docs == "positions":              # DataCollatorWithFlattening style: restarting position_ids
        cu = spec.get("cu", (0, 5, 19, S))
        pos = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])
        batch["position_ids"] = pos.expand(B, S).clone()
        for a in cu[1:-1]:
            batch["labels"][:, a] = -100
    elif docs == "cu":                   # ... with return_flash_attn_kwargs=True
        cu = spec.get("cu", (0, 5, 19, S))
        pos = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])
        batch["position_ids"] = pos.expand(B, S).clone()
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32)
        for a in cu[1:-1]:
            batch["labels"][:, a] = -100
    elif docs in ("right", "left"):
        mask = torch.ones(B, S, dtype=torch.long)
        if docs == "right":
            mask[:, S - 7:] = 0
        else:
            mask[:, :9] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return batch


def reference_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What one process feeds transformers: the global batch, labels shifted by transformers itself."""
    ref = {k: v for k, v in batch.items() if k in ("input_ids", "labels", "position_ids", "attention_mask")}
    mask = batch.get("attention_mask")
    if mask is not None:                 # a padded query's target never counts (shard_batch's rule)
        labels = ref["labels"].clone()
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
        ref["labels"] = labels
    return ref


def _errors(prefix: str, model_sp, model_ref, out: dict[str, float], what: str = "grad") -> None:
    """Per parameter: ``max |sp - ref|`` over ``max |ref|``, that scale at least 1e-3 of the largest over all
    parameters (a gradient that is zero in exact arithmetic - a key bias's: softmax ignores a shift shared by
    all keys - is rounding noise on both sides and is compared at the model's scale)."""
    ref = dict(model_ref.named_parameters())
    pairs = {}
    for name, p in model_sp.named_parameters():
        a = p.grad if what == "grad" else p.detach()
        b = ref[name].grad if what == "grad" else ref[name].detach()
        pairs[name] = (a, b)
    floor = 1e-3 * max((b.double().abs().max().item() for _, b in pairs.values() if b is not None), default=1.0)
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            err = 0.0 if a is None and b is None else float("inf")
        else:
            err = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), floor)
        out[f"{prefix}{name}"] = max(out.get(f"{prefix}{name}", 0.0), err)


def train_compare(spec: dict[str, Any]) -> dict[str, float]:
    """``spec["steps"]`` optimizer steps sequence-parallel vs one process; the largest errors per quantity.

    spec keys: family, method, layout, options (method options), ulysses (usp), steps, seq, batch, docs,
    dtype, optimizer ("sgd" / "adamw"), checkpointing, compile, pad.
    """
    dtype = getattr(torch, spec.get("dtype", "float32"))
    mesh = make_mesh(spec)
    name = f"seqpar_{spec['method']}"
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout", "zigzag"), name=name,
                          **spec.get("options", {}))
    try:
        return _train_compare(spec, dtype, mesh, handle)
    finally:
        handle.disable()


def _train_compare(spec, dtype, mesh, handle) -> dict[str, float]:
    family = spec["family"]
    ref = build(family, REFERENCE_ATTN.get(family, "sdpa"), dtype=dtype)
    sp = build(family, handle.name, dtype=dtype)
    if spec.get("checkpointing"):
        checkpoint_layers(sp)
        sp.train()
    forward = torch.compile(sp, backend=spec["compile"]) if spec.get("compile") else sp
    opt = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
           "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)}[spec.get("optimizer", "sgd")]
    opt_ref, opt_sp = opt(ref), opt(sp)
    batch = global_batch(spec)
    local = handle.shard_batch(batch, pad=spec.get("pad", False))
    errors: dict[str, float] = {"loss": 0.0, "logits": 0.0}
    for _ in range(spec.get("steps", 3)):
        for o in (opt_ref, opt_sp):
            o.zero_grad(set_to_none=True)
        out_ref = ref(**reference_inputs(batch))
        out_sp = forward(**local)
        out_ref.loss.backward()
        out_sp.loss.backward()
        sp_hf.all_reduce_gradients(sp.parameters(), mesh)
        total = out_sp.loss.detach().clone()
        for g in _reduce_groups(mesh):
            dist.all_reduce(total, group=g)
        errors["loss"] = max(errors["loss"], rel_error(total, out_ref.loss.detach()))
        cu = local.get("cu_seq_lens_q")
        cu = None if cu is None else tuple(cu.tolist())
        truth = seqpar.shard(out_ref.logits.detach(), mesh=mesh, method=handle.method, dim=1,
                             layout=sp_hf.batch_layout(handle.method, handle.layout, cu), cu_seqlens=cu,
                             pad=spec.get("pad", False))
        seen = local["shift_labels"] != -100        # positions whose logits count (padding's are arbitrary)
        errors["logits"] = max(errors["logits"], rel_error(out_sp.logits.detach()[seen], truth[seen]))
        _errors("grad:", sp, ref, errors)
        opt_ref.step()
        opt_sp.step()
    _errors("param:", sp, ref, errors, what="param")
    return errors


def expect_error(spec: dict[str, Any]) -> tuple[str, str] | None:
    """Run one misuse (``spec["kind"]``); ``(type name, message)`` of what it raised, None if nothing raised."""
    mesh = make_mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout", "zigzag"), name="seqpar_err")
    try:
        _misuse(spec, handle)
    except Exception as e:   # the parent inspects the type and the message
        return type(e).__name__, str(e)
    finally:
        handle.disable()
    return None


def _misuse(spec: dict[str, Any], handle) -> None:
    kind = spec["kind"]
    batch = global_batch(spec)
    if kind == "shard":                  # shard_batch refuses the batch
        for key, value in spec.get("set", {}).items():
            batch[key] = value
        handle.shard_batch(batch, **spec.get("shard_kwargs", {}))
        return
    model = build(spec.get("family", "llama"), handle.name, **spec.get("over", {}))
    local = handle.shard_batch(batch)
    if kind == "dropout":
        model.train()
        model(**local)
    elif kind == "mask_to_model":
        model(**local, attention_mask=torch.ones_like(local["input_ids"]))
    elif kind == "local_positions":      # RoPE would see 0..L-1 on every rank
        local.pop("position_ids")
        model(**local)
    elif kind == "output_attentions":
        model(**local, output_attentions=True)
    elif kind == "decode":
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=True)
        model(input_ids=local["input_ids"][:, :1], position_ids=local["position_ids"][:, :1],
              past_key_values=out.past_key_values, use_cache=True)
    elif kind == "unknown_kwarg":
        model(**local, my_bias=torch.zeros(1))
    elif kind == "local_cu":             # FA2-style local cu_seqlens instead of global boundaries
        L = local["input_ids"].shape[1]
        cu = torch.tensor([0, L // 2, L], dtype=torch.int32)
        model(**{**local, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    else:
        raise ValueError(kind)


def compile_graph_breaks(spec: dict[str, Any]) -> list[str]:
    """The reasons ``torch._dynamo.explain`` gives for the graph breaks of a seqpar model's forward."""
    handle = sp_hf.enable(make_mesh(spec), method=spec["method"], layout=spec.get("layout", "zigzag"),
                          name="seqpar_explain")
    try:
        model = build(spec.get("family", "llama"), handle.name)
        local = handle.shard_batch(global_batch(spec))
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(model)(**local)
        return [str(b.reason) for b in explanation.break_reasons]
    finally:
        handle.disable()


def encoder_compare(spec: dict[str, Any]) -> dict[str, float]:
    """A non-causal encoder (BERT: absolute positions, ``is_causal=False``) vs one process: hidden states and
    every parameter gradient of a fixed projection of them."""
    from transformers import AutoModel, BertConfig

    mesh = make_mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout", "zigzag"), name="seqpar_enc")
    try:
        cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        models = {}
        for attn in ("sdpa", handle.name):
            torch.manual_seed(0)
            models[attn] = AutoModel.from_config(cfg, attn_implementation=attn, add_pooling_layer=False)
        batch = global_batch({**spec, "batch": 2})
        g = torch.Generator().manual_seed(5)
        weight = torch.randn((*batch["input_ids"].shape, 32), generator=g)
        ref = models["sdpa"](input_ids=batch["input_ids"]).last_hidden_state
        (ref * weight).sum().backward()
        local = handle.shard_batch({"input_ids": batch["input_ids"]})
        where = {"mesh": mesh, "method": handle.method, "layout": handle.layout}
        out = models[handle.name](**local).last_hidden_state
        (out * seqpar.shard(weight, **where)).sum().backward()
        sp_hf.all_reduce_gradients(models[handle.name].parameters(), mesh)
        errors = {"hidden": rel_error(out.detach(), seqpar.shard(ref.detach(), **where))}
        _errors("grad:", models[handle.name], models["sdpa"], errors)
        return errors
    finally:
        handle.disable()


def refill_compare(spec: dict[str, Any]) -> dict[str, Any]:
    """One set of batch buffers refilled in place between forwards (as a collator or a CUDA-graph feeder does)
    against fresh tensors of the same batches: the largest logits and loss errors over the steps, and what a
    forward raised after the position buffer was refilled with wrong positions (None if nothing raised).

    spec keys: method, layout, check_positions, cus (one boundary tuple per step, all of one length).
    """
    mesh = make_mesh(spec)
    handle = sp_hf.enable(mesh, method=spec["method"], layout=spec.get("layout"), name="seqpar_refill",
                          check_positions=spec.get("check_positions", True))
    try:
        model = build("llama", handle.name)
        errors = {"logits": 0.0, "loss": 0.0}
        buffers = None
        with torch.no_grad():
            for cu in spec["cus"]:
                local = handle.shard_batch(global_batch({"docs": "cu", "cu": cu, "data_seed": cu[1]}))
                fresh = model(**local)
                if buffers is None:
                    buffers = handle.shard_batch(global_batch({"docs": "cu", "cu": cu, "data_seed": cu[1]}))
                else:
                    for key, t in buffers.items():
                        if isinstance(t, torch.Tensor):
                            t.copy_(local[key])
                        else:
                            buffers[key] = local[key]
                out = model(**buffers)
                errors["logits"] = max(errors["logits"], rel_error(out.logits, fresh.logits))
                errors["loss"] = max(errors["loss"], rel_error(out.loss, fresh.loss))
            buffers["position_ids"].add_(1)          # wrong positions, written into the checked buffer
            try:
                model(**buffers)
                errors["wrong_positions"] = None
            except ValueError as e:
                errors["wrong_positions"] = str(e)
        return errors
    finally:
        handle.disable()


def refill(buffers: dict[str, Any] | None, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` copied into ``buffers`` in place (a collator or CUDA-graph feeder reusing one set of tensors);
    the first call makes the buffers."""
    if buffers is None:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    for key, t in buffers.items():
        if isinstance(t, torch.Tensor):
            t.copy_(batch[key])
    return buffers


def compile_boundaries(spec: dict[str, Any]) -> dict[str, Any]:
    """A compiled model on packed batches (``spec["cus"]``, one per step, refilled into one set of buffers):
    per step the host reads of the boundaries over forward and backward, the loss error against the eager
    model on fresh tensors, and, from the graphs dynamo hands the backend, where every attention op's
    ``cu_seqlens`` comes from (Note [Compiling a model with seqpar attention])."""
    from torch._dynamo import lookup_backend

    handle = sp_hf.enable(make_mesh(spec), method=spec["method"], layout=spec.get("layout"), name="seqpar_bounds")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    try:
        model = build("llama", handle.name)
        eager = build("llama", handle.name)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        reads, errors, buffers = [], [], None
        for cu in spec["cus"]:
            local = handle.shard_batch(global_batch({"docs": "cu", "cu": cu, "data_seed": cu[1]}))
            buffers = refill(buffers, local)
            before = hf_attention._OP_READS.reads
            loss = compiled(**buffers).loss
            loss.backward()
            reads.append(hf_attention._OP_READS.reads - before)
            ref = eager(**local).loss
            errors.append(rel_error(loss.detach(), ref.detach()))
        sources = []
        for gm in graphs:
            for node in gm.graph.nodes:
                if node.op == "call_function" and "seqpar.attention" in str(node.target):
                    cu_arg = node.args[4] if len(node.args) > 4 else node.kwargs.get("cu_seqlens")
                    sources.append(str(getattr(cu_arg, "target", cu_arg)))
        return {"reads": reads, "errors": errors, "sources": sources, "graphs": len(graphs)}
    finally:
        handle.disable()
