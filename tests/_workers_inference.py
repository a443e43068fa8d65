"""Worker-side code of tests/test_inference.py: the sharded KV cache driven on every rank.

``cache_run`` drives ``seqpar.inference`` directly on seeded global q/k/v (prefill chunks, decode steps,
static decode steps) and returns, per layer, this rank's outputs with their cache positions; the parent
reassembles the sequence and compares it with the dense fp64 oracle. ``generate_run`` runs
``seqpar.integrations.huggingface.generate`` on tiny transformers models and returns tokens and per-step
logits; the parent compares them with ``model.generate`` on one process and with an fp64 forward.
Each function loops over many cases in one pool call (start-up dominates on a busy CPU).
"""

from __future__ import annotations

from typing import Any

import torch

import seqpar
from seqpar.inference import ShardedKVCache, attend

VOCAB = 64


def cache_inputs(spec: dict[str, Any], total: int) -> list[dict[str, torch.Tensor]]:
    """Per layer, global ``q (B, S, H, D)``, ``k, v (B, S, Hkv, D|Dv)`` and ``sinks (H,)``, from the spec's seed."""
    g = torch.Generator().manual_seed(spec.get("seed", 0))
    B, H, Hkv, D = spec.get("batch", 1), spec.get("heads", 4), spec.get("kv_heads", 2), spec.get("head_dim", 8)
    Dv = spec.get("value_head_dim", D)
    dt = getattr(torch, spec.get("dtype", "float64"))
    return [{"q": torch.randn(B, total, H, D, generator=g).to(dt),
             "k": torch.randn(B, total, Hkv, D, generator=g).to(dt),
             "v": torch.randn(B, total, Hkv, Dv, generator=g).to(dt),
             "sinks": torch.randn(H, generator=g)} for _ in range(spec.get("layers", 2))]


def _mesh(spec: dict[str, Any]):
    if spec.get("ulysses"):
        return seqpar.make_mesh(ulysses=spec["ulysses"], device_type="cpu")
    return None


def _window(spec: dict[str, Any], layer: int) -> tuple[int, int]:
    w = spec.get("windows", {}).get(layer, -1)
    return (w, 0) if w >= 0 else (-1, -1)


def cache_run(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every spec on this rank; per spec: ``out[layer]`` as (positions, rows) pieces, chunk modes, passes."""
    return [_cache_case(spec) for spec in specs]


def _cache_case(spec: dict[str, Any]) -> dict[str, Any]:
    chunks = spec["chunks"]
    total = sum(n for _, n, *_ in chunks)
    layers = spec.get("layers", 2)
    data = cache_inputs(spec, total)
    cache = ShardedKVCache(layers=layers, batch=spec.get("batch", 1), mesh=_mesh(spec), max_len=spec.get("max_len"),
                           passes=spec.get("passes", "auto"))
    pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]
    passes = []
    for kind, n, *rest in chunks:
        if kind == "static":
            _static(cache, n, data, spec, pieces)
            continue
        if kind == "prefill":
            opts = dict(rest[0]) if rest else {}
            chunk = cache.begin_prefill(n, starts=spec.get("starts") if cache.length == 0 else None, **opts)
        else:
            chunk = cache.begin_decode(n)
        P = chunk.start
        for layer, d in enumerate(data):
            q, k, v = (chunk.take(d[x][:, P:P + n]) for x in ("q", "k", "v"))
            out = attend(q, k, v, cache, layer, window_size=_window(spec, layer),
                         sinks=d["sinks"] if spec.get("sinks") else None)
            keep = chunk.positions < chunk.end
            pieces[layer].append((chunk.positions[keep], out[:, keep]))
        passes.append({layer: d.choice for layer, d in chunk.passes.items()})
    return {"out": [(torch.cat([p for p, _ in ps]), torch.cat([o for _, o in ps], 1)) for ps in pieces],
            "passes": passes, "memory": cache.memory(), "length": cache.length,
            "appended": cache.rows[cache.index].total}


def _static(cache: ShardedKVCache, n: int, data, spec, pieces) -> None:
    dec = cache.static_decode()
    for _ in range(n):
        p = int(dec.position)                  # the test reads it to pick its inputs; an engine would not
        dec.begin()
        for layer, d in enumerate(data):
            q, k, v = (d[x][:, p:p + 1] for x in ("q", "k", "v"))
            out = dec.attend(q, k, v, layer, softmax_scale=None, window_size=_window(spec, layer),
                             sinks=d["sinks"] if spec.get("sinks") else None)
            pieces[layer].append((torch.tensor([p]), out))
        dec.end()
    dec.close()


def model_config(family: str, **over: Any):
    """A tiny config of ``family`` (GQA 4/2 heads, head_dim 8, hidden 32, 2 layers, vocab 64)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, attention_dropout=0.0,
                  tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "mistral":            # every layer slides
        cfg = tf.MistralConfig(**common, sliding_window=6)
    elif family == "qwen3":              # q/k norms; layer 1 slides
        cfg = tf.Qwen3Config(**common, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    elif family == "gpt_oss":            # attention sinks, a sliding layer, mixture of experts
        cfg = tf.GptOssConfig(**{**common, "intermediate_size": 32, "max_position_embeddings": 131072},  # its YaRN
                              num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(family)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def build(family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The model of ``family`` from ``seed`` (initialised in fp32 whatever ``dtype``: the same weights)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = "eager" if family == "gpt_oss" else "sdpa"               # transformers' gpt-oss sinks: eager
    model = AutoModelForCausalLM.from_config(model_config(family), attn_implementation=attn).to(dtype)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(generator=torch.Generator().manual_seed(seed))   # sinks that matter
    return model.eval()


def prompt(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``: seeded tokens, rows left-padded by ``spec["pad"]`` tokens (pad id 0)."""
    g = torch.Generator().manual_seed(spec.get("data_seed", 1))
    B, S = spec.get("batch", 1), spec["seq"]
    ids = torch.randint(1, VOCAB, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    for b, n in enumerate(spec.get("pad", ())):
        ids[b, :n] = 0
        mask[b, :n] = 0
    return ids, mask


def generate_run(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every spec on this rank: tokens and per-step logits of sharded generate (and of each turn)."""
    from seqpar.integrations import huggingface as sp_hf

    out = []
    for spec in specs:
        model = build(spec["family"])
        ids, mask = prompt(spec)
        mesh = seqpar.make_mesh(ulysses=spec["ulysses"], device_type="cpu") if spec.get("ulysses") else None
        kw = dict(max_new_tokens=spec.get("new", 5), do_sample=spec.get("sample", False), return_dict_in_generate=True,
                  output_logits=True, mesh=mesh, method=spec.get("method", "ring"), layout=spec.get("layout"),
                  prefill_chunk=spec.get("chunk"), passes=spec.get("passes", "auto"),
                  method_options=spec.get("options"))
        turns = []
        cache = None
        for t in range(1 + len(spec.get("turns", ()))):
            if t:
                extra = torch.randint(1, VOCAB, (ids.shape[0], spec["turns"][t - 1]),
                                      generator=torch.Generator().manual_seed(100 + t))
                ids = torch.cat([turns[-1]["sequences"], extra], 1)
                mask = torch.cat([mask, torch.ones_like(ids[:, mask.shape[1]:])], 1)
            torch.manual_seed(spec.get("sample_seed", 0))
            given = {"cache": cache} if t % 2 else {"past_key_values": cache}       # both names are accepted
            res = sp_hf.generate(model, ids, attention_mask=mask, **given, **kw)
            cache = res["cache"] if "cache" in res else res["past_key_values"]      # transformers >= 5.2x: cache
            turns.append({"sequences": res.sequences, "logits": torch.stack(res.logits, 1)})
        out.append({"turns": turns, "memory": cache.kv.memory()})
    return out


def prefill_timing() -> dict[str, Any]:
    """When ``generate`` prefills (Note [Prefill at the first forward]): the cache's stored and promised tokens as
    ``model.generate`` is entered and at the model's first forward, and the greedy tokens (against the model on
    one process)."""
    from seqpar.integrations import huggingface as sp_hf

    model, seen = build("llama"), {}
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    cache = sp_hf.SeqparCache(ShardedKVCache(layers=model.config.num_hidden_layers, batch=1))
    inner = model.generate

    def entered(*args: Any, **kwargs: Any) -> Any:
        seen["entry"] = (cache.kv.length, cache.promised, cache.get_seq_length())
        def first(*_: Any) -> None:
            seen.setdefault("forward", (cache.kv.length, cache.promised))

        handle = model.register_forward_pre_hook(first)
        try:
            return inner(*args, **kwargs)
        finally:
            handle.remove()

    model.generate = entered
    got = sp_hf.generate(model, ids, cache=cache, max_new_tokens=3, do_sample=False)
    return {**seen, "after": (cache.kv.length, cache.promised), "equal": torch.equal(got, want)}


def dead_layer_prefill() -> dict[str, Any]:
    """Note [The prefill's dead attention]: ``generate`` with a chunked prefill, once as shipped and once with
    every layer's attention computed; the cached keys/values and the tokens of the two, and how often each
    layer's attention was computed or skipped in the first."""
    import contextlib

    from seqpar.integrations import hf_generate as g

    model = build("llama")
    layers = model.config.num_hidden_layers
    ids = torch.randint(1, VOCAB, (1, 13), generator=torch.Generator().manual_seed(5))
    calls: dict[str, int] = {}
    real_attend, real_discarding = g.attend_stored, g._discarding

    def counted(q, kv, layer, **kw):
        key = f"{layer}:{'out' if kw.get('output', True) else 'skipped'}"
        calls[key] = calls.get(key, 0) + 1
        return real_attend(q, kv, layer, **kw)

    runs = {}
    try:
        for skip in (True, False):
            g.attend_stored = counted if skip else real_attend
            g._discarding = real_discarding if skip else (lambda cache, layer: contextlib.nullcontext())
            cache = g.SeqparCache(ShardedKVCache(layers=layers, batch=1))
            out = g.generate(model, ids, cache=cache, prefill_chunk=5, max_new_tokens=3, do_sample=False)
            runs[skip] = (out, [cache.kv.slice(i) for i in range(layers)])
    finally:
        g.attend_stored, g._discarding = real_attend, real_discarding
    return {"calls": calls, "layers": layers, "tokens_equal": torch.equal(runs[True][0], runs[False][0]),
            "kv_equal": all(torch.equal(a, b) for x, y in zip(runs[True][1], runs[False][1]) for a, b in zip(x, y))}


def bench_run(baseline: bool) -> list[dict]:
    """``seqpar.bench.inference`` on CPU with the tiny preset: eager and static decode (and, on 1 rank, the
    transformers baseline with ``check``: its greedy tokens must equal seqpar's)."""
    from seqpar.bench.inference import BenchConfig, run

    cfg = BenchConfig(preset="tiny", contexts=(40,), new_tokens=4, device="cpu", baseline=baseline, check=baseline)
    return run(cfg, echo=False)


def cache_errors() -> list[tuple[str, str]]:
    """Misuses of the cache and of generate, each run on this rank: ``(exception type, message)`` of each."""
    from seqpar.integrations import huggingface as sp_hf

    def new(**kw: Any) -> ShardedKVCache:
        return ShardedKVCache(layers=2, batch=1, **kw)

    def decode_empty() -> None:
        new().begin_decode()

    def bad_shape() -> None:
        c = new()
        c.begin_prefill(8)
        c.store(0, torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8))

    def layer_missing() -> None:
        c = new()
        chunk = c.begin_prefill(8)
        kv = torch.zeros(1, chunk.positions.numel(), 2, 8)
        attend(torch.zeros(1, kv.shape[1], 4, 8), kv, kv, c, 0)
        c.begin_decode()

    def window_changes() -> None:
        c = new()
        for window in ((-1, -1), (3, 0)):
            chunk = c.begin_prefill(8) if c.length == 0 else c.begin_decode()
            kv = torch.zeros(1, chunk.positions.numel(), 2, 8)
            for layer in range(2):
                attend(torch.zeros(1, kv.shape[1], 4, 8), kv, kv, c, layer, window_size=window)

    def static_full() -> None:
        c = new(max_len=8, spare_rows=0)
        c.begin_prefill(24)
        kv = torch.zeros(1, 12, 2, 8)
        c.store(0, kv, kv)

    def beams() -> None:
        sp_hf.generate(build("llama"), torch.ones(1, 6, dtype=torch.long), num_beams=2, max_new_tokens=2)

    def right_padding() -> None:
        sp_hf.generate(build("llama"), torch.ones(1, 6, dtype=torch.long),
                       attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]), max_new_tokens=2)

    def both_caches() -> None:
        c = sp_hf.SeqparCache(new())
        sp_hf.generate(build("llama"), torch.ones(1, 6, dtype=torch.long), cache=c, past_key_values=c)

    def mask_not_the_cache_padding() -> None:      # checked on the device, read when serving ends
        from seqpar.integrations.hf_generate import cache_kwargs

        model, ids = build("llama"), torch.ones(1, 6, dtype=torch.long)
        cache = sp_hf.SeqparCache(new())
        with sp_hf.serving(model, cache):
            sp_hf.prefill(model, cache, ids[:, :5])
            model(input_ids=ids[:, 5:], attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1]]),
                  position_ids=torch.tensor([[5]]), **cache_kwargs(model, cache))

    cases = [decode_empty, bad_shape, layer_missing, window_changes, static_full, beams, right_padding,
             lambda: new(passes="x"), lambda: new().begin_prefill(8, starts=(0, 1)), both_caches,
             mask_not_the_cache_padding]
    out = []
    for case in cases:
        try:
            case()
        except Exception as e:   # the parent inspects the type and the message
            out.append((type(e).__name__, str(e)))
        else:
            out.append(("", ""))
    return out


def static_overrun(spec: dict[str, Any]) -> dict[str, Any]:
    """A static decode driven to its bound and one step past it, eagerly or through ``replay`` of a stand-in
    graph (``spec["replay"]``: CPU has no CUDA graph; the stand-in counts its replays). Returns the bound, what
    the step past it raised, whether the cache's buffers and the step's device state were left untouched, and
    how many steps ``close()`` recorded."""
    P, layers = spec.get("prompt", 4), 2
    cache = ShardedKVCache(layers=layers, batch=1, max_len=spec["max_len"], spare_rows=0)
    data = cache_inputs({"dtype": "float32", "layers": layers}, P + spec["max_len"])
    chunk = cache.begin_prefill(P)
    for layer, d in enumerate(data):
        q, k, v = (chunk.take(d[x][:, :P]) for x in ("q", "k", "v"))
        attend(q, k, v, cache, layer)
    dec = cache.static_decode()
    limit = dec.steps_left                      # before any step: the whole bound

    def step() -> None:
        p = int(dec.position)                   # the test reads it to pick its inputs; an engine would not
        dec.begin()
        for layer, d in enumerate(data):
            dec.attend(*(d[x][:, p:p + 1] for x in ("q", "k", "v")), layer, softmax_scale=None)
        dec.end()

    class Graph:                                # stands in for a captured step: replay() is the step's work
        replays = 0

        def replay(self) -> None:
            Graph.replays += 1
            p = int(dec.position)
            dec.mine.copy_(dec.position % dec.cache.world == dec.cache.index)
            for layer, d in enumerate(data):
                dec.attend(*(d[x][:, p:p + 1] for x in ("q", "k", "v")), layer, softmax_scale=None)
            dec.end()

    graph = Graph()
    run = (lambda: dec.replay(graph)) if spec.get("replay") else step
    for _ in range(limit):
        run()
    before = [t.clone() for lay in cache.layers for t in (lay.k, lay.v)]
    before += [dec.slot_pos.clone(), dec.fill.clone(), dec.position.clone()]
    try:
        run()
        error = None
    except RuntimeError as e:
        error = str(e)
    after = [t for lay in cache.layers for t in (lay.k, lay.v)] + [dec.slot_pos, dec.fill, dec.position]
    return {"limit": limit, "left": dec.steps_left, "error": error, "replays": Graph.replays,
            "untouched": all(torch.equal(a, b) for a, b in zip(before, after)), "closed": dec.close(),
            "length": cache.length}
