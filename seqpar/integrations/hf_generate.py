"""transformers' ``generate`` over a sequence-sharded KV cache: a sharded prompt, decode on every rank.

    import seqpar.integrations.huggingface as sp_hf

    kw = dict(mesh=mesh, method="ring", max_new_tokens=256, return_dict_in_generate=True)
    out = sp_hf.generate(model, input_ids, **kw)      # on every rank: == model.generate(input_ids, ...) on one
    out2 = sp_hf.generate(model, torch.cat([out.sequences, reply], 1), cache=out.cache, **kw)   # or past_key_values

Note [Generate with a sharded prompt]
    Every rank passes the same global ``input_ids``. The prompt minus its last token is prefilled sharded
    (``ShardedKVCache.begin_prefill``: each rank runs the model on its share of the tokens, at their global
    RoPE positions; attention is ``seqpar.attention`` with ``method``/``layout`` on an empty cache, pass-KV or
    pass-Q on a cache a previous turn filled), in chunks of ``prefill_chunk`` tokens. Then transformers' own
    ``generate`` runs unchanged on every rank with the global ids and the prefilled cache: as for any cache
    reuse, it feeds only the tokens the cache lacks - the last prompt token - so every forward it makes is a
    decode step whose tokens every rank has; each layer attends to the sharded cache and merges exactly
    (Note [Exact decode merge] in ``seqpar.inference.decode``). Logits are then bitwise identical on every
    rank, so greedy search, sampling with the same seed, logits processors and stopping criteria agree
    everywhere and match one process up to rounding. Nothing of transformers is patched: ``SeqparCache`` is a
    ``transformers.Cache``, and the model runs under a temporary ``attn_implementation`` whose function sends
    the cache's own tokens to it (other caches keep raising).

Padding: a batch's rows may start late (left padding, the layout for generation; ``attention_mask`` given or
inferred from ``pad_token_id`` as transformers does); a row never sees its padding, and RoPE positions count
from its first real token, as transformers computes them. Not supported (refused): beam search,
``num_return_sequences > 1``, assisted decoding, ``inputs_embeds``, right padding, media of models other than
Gemma 3 (Note [Images in generate]).

Special masks: sliding layers keep their own window each (interleaved sliding and global layers: Gemma 2/3,
gpt-oss, Qwen), with the cache evicting what no later query sees. Llama 4's position-scaled NoPE queries are
scaled at the tokens' cache positions (Note [Position-scaled queries] in ``hf.layers``).

Note [Chunked layers in generate]
    Llama 4's chunked layers see only the keys of their query's ``attention_chunk_size`` chunk, counted from the
    row's first real token (after its left padding), as transformers counts them. The sharded cache plans them
    as documents: each row group's bounds are cut every chunk size from its start (``RowGroup.bounds``), and causal
    attention within documents is chunked attention, in the first fill, in extensions (pass-KV, pass-Q) and in
    decode steps alike. A static decode step (graph-captured) plans no documents, so it serves a chunked layer
    only while its static cache fits in one chunk and refuses it otherwise.

Note [Prefill at the first forward]
    ``generate`` does not prefill and then call ``model.generate``: it calls ``model.generate`` with the prefill
    pending (``SeqparCache.promised`` tokens, which the lengths transformers reads count) and runs it from a
    forward pre-hook at the model's first call, the last prompt token's step. transformers' set-up before that
    call makes host-device syncs (tensors built on the device from Python values); made after the prefill was
    queued, each waited for the whole prefill, and the last token's step - a host-bound forward of one token
    - then ran on an idle GPU: 32K prefill through ``generate`` 1.21x ``model.generate`` on one H100, where the
    prefill alone was 1.02x. Deferred, the set-up runs on an idle GPU and the step's host work overlaps the
    prefill's kernels.

Note [Padding checked a step behind]
    Every forward through the cache checks that transformers' 2D ``attention_mask`` is the cache's left padding.
    Read on the host, that check was a device-to-host sync per forward (after the prefill: a wait for all of
    it). The comparison now runs on the device, and its verdict is read at the next forward's check - whose
    kernels are long done, since transformers reads each step's tokens - or by ``settle`` when ``serving``
    ends. On CUDA the verdict is copied to pinned host memory as soon as it is computed, so the read waits on
    an event and launches nothing after the call's last kernel. A bad mask still raises on every rank before
    ``generate`` returns anything.

Note [The prefill's dead attention]
    ``prefill`` runs the decoder over the prompt for the keys and values it stores and discards the hidden
    states (``model.generate``'s first forward computes the last prompt token's own, with its logits). The last
    decoder layer's attention output over the prompt feeds only that layer's MLP and the final norm, whose
    results are discarded, so that layer stores its keys and values and skips its attention: no kernel, no
    exchange, zeros returned (``attend_stored(output=False)``), on every rank alike. It saves 1/L of the
    prefill's attention (a 32-layer model: 3%; the inference bench's 4-layer model: a quarter), the way
    transformers' ``logits_to_keep`` skips the logits nobody reads. The layer's projections and MLP still run
    on the zeros (they are the model's code), and nothing the cache keeps changes.

Note [Images in generate]
    Gemma 3 (``Gemma3ForConditionalGeneration``) with ``pixel_values`` and ``token_type_ids``: every rank
    computes the prompt's input embeddings as the model's forward does (token embeddings, the vision tower's
    features scattered at the image tokens: ``get_image_features``, ``get_placeholder_mask``), once, before the
    model attends through the cache; each prefill chunk feeds its rows of them (``chunk.take``) as
    ``inputs_embeds``. The image spans (runs of ``token_type_ids == 1``, the same in every row, as in training)
    are the first chunk's ``mask_mod=spans(...)`` (``ShardedKVCache.begin_prefill``), which attends every layer
    with ``causal=False``, that mask and the layer's left window as ``window_size=(w - 1, -1)``: ``window AND
    (causal OR same image)``, Gemma 3's rule on full and sliding layers (Note [Layer masks] in ``hf.layers``;
    the same set as training's ``spans(..., window=w - 1)``). Every later query - the last prompt token, which
    ``model.generate`` runs, and every decode step - is a text token after every image, for which Gemma 3's
    rule is causal: so ``model.generate`` gets neither ``pixel_values`` (no image features are computed again)
    nor ``token_type_ids`` (no image blocks in its masks). Refused by name: a last prompt token that is an image
    token, an image past the first prefill chunk (``prefill_chunk``: extensions attend causally), a turn that
    continues a cache and adds images (a text-only turn after an image turn is served), rows whose images
    differ, image tokens without ``pixel_values``, and the media of every other model. Without
    ``token_type_ids`` transformers attends images causally, and so does the cache.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from .. import methods
from ..errors import rank_suffix
from ..inference import ShardedKVCache, attend_stored
from ..inference.cache import host_to_device
from ..masks import spans
from .hf.attention import enable
from .hf.batch import _image_spans

try:
    from transformers import Cache
except ImportError as e:   # pragma: no cover - depends on the environment
    raise ImportError(f"seqpar.integrations.hf_generate needs transformers >= 4.56 (Cache with layers): {e}") from e

__all__ = ["SeqparCache", "cache_kwargs", "generate", "prefill", "serving"]

_REFUSED = {
    "num_beams": (1, "beam search"),
    "num_return_sequences": (1, "num_return_sequences > 1"),
    "assistant_model": (None, "assisted decoding"),
    "prompt_lookup_num_tokens": (None, "prompt-lookup decoding"),
    "inputs_embeds": (None, "inputs_embeds (pass input_ids)"),
    "cache_implementation": (None, "cache_implementation (the cache is seqpar's)"),
    "use_cache": (True, "use_cache=False (the sharded cache is the point)"),
}
# Inputs of media towers and masks that no model's sharded generate serves (Note [Images in generate]).
_MEDIA = ("pixel_values_videos", "image_sizes", "image_grid_thw", "video_grid_thw", "input_features",
          "mm_token_type_ids", "image_spans")
_MEDIA_TOKENS = ("image_token_id", "image_token_index", "video_token_id", "audio_token_id")


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the name ``model``'s forward gives the KV cache: ``cache`` in transformers >= 5.2x,
    ``past_key_values`` before (the old name still works there, with a deprecation warning per process)."""
    return {_cache_name(type(model)): cache}


@functools.lru_cache(maxsize=64)
def _cache_name(model_class: type) -> str:
    """Read once per model class: a decode step calls ``cache_kwargs`` and should do no signature work."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class SeqparCache(Cache):
    """transformers' ``Cache`` over a ``seqpar.inference.ShardedKVCache`` (``kv``).

    ``update`` stores this rank's share of the new tokens' K/V (a decode step's tokens when no prompt chunk
    is open) and returns them unchanged; the attention function of the model's temporary implementation then
    recognises them (``serves``) and attends to the whole sharded cache (``attention``).
    """

    def __init__(self, kv: ShardedKVCache):
        super().__init__(layers=[])
        self.kv = kv
        self._returned: dict[int, torch.Tensor] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.promised = 0
        """Prompt tokens a deferred prefill will store before the model's first forward (Note [Prefill at the
        first forward]): the lengths transformers reads before that forward count them."""
        self.dead_layer: int | None = None
        """A layer whose attention output the running forward discards (Note [The prefill's dead attention])."""
        self._starts: torch.Tensor | None = None
        self._verdict: tuple[torch.Tensor, tuple[int, ...]] | None = None

    def __repr__(self) -> str:
        return f"SeqparCache(length={self.kv.length}, layers={self.kv.spec.layers}, world={self.kv.world})"

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states (B, Hkv, L, D)``, ``value_states (B, Hkv, L, Dv)`` of ``layer_idx``; return them.

        During a static decode (``kv.static_decode()``) the step's k, v are written by its ``attend`` instead.
        """
        if self.kv.static_step is not None:
            self._pending[layer_idx] = (key_states, value_states)
        else:
            if self.kv.chunk is None:
                self.kv.begin_decode(key_states.shape[2])
            self.kv.store(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))
        self._returned[layer_idx] = key_states
        return key_states, value_states

    def serves(self, layer_idx: Any, key: torch.Tensor) -> bool:
        """Whether ``key`` is what ``update`` just returned for ``layer_idx`` (this cache's tokens)."""
        return self._returned.get(layer_idx) is key

    def attention(self, layer_idx: int, query: torch.Tensor, *, causal: bool, scaling: float | None,
                  window: tuple[int, int], sinks: torch.Tensor | None, chunk: int | None = None,
                  where: str | None = None) -> torch.Tensor:
        """``query (B, H, L, D)`` against the sharded cache: ``(B, L, H, Dv)``, the same as transformers' own.

        ``chunk``: the layer's chunk size (Llama 4's chunked attention): served while every cache position is in
        the first chunk, where chunked attention is causal attention (Note [Chunked layers in generate]).
        """
        where = where or f"layer {layer_idx}"
        if not causal:
            raise NotImplementedError(f"a KV cache serves causal attention only, got is_causal=False in {where}"
                                      f"{rank_suffix()}")
        del self._returned[layer_idx]
        q = query.transpose(1, 2)
        step = self.kv.static_step
        if step is not None:
            if chunk is not None:
                self._check_chunk(chunk, query.shape[2], where)
            k, v = self._pending.pop(layer_idx)
            return step.attend(q, k.transpose(1, 2), v.transpose(1, 2), layer_idx, softmax_scale=scaling,
                               window_size=window, sinks=sinks)
        return attend_stored(q, self.kv, layer_idx, softmax_scale=scaling, window_size=window, sinks=sinks,
                             chunk=chunk, output=layer_idx != self.dead_layer)

    def _check_chunk(self, chunk: int, tokens: int, where: str) -> None:
        """A static decode step serves a chunked layer only while its cache fits in one chunk (causal there)."""
        max_len = self.kv.spec.max_len
        if max_len is None or max_len > chunk:
            raise NotImplementedError(
                f"chunked attention (attention_chunk_size={chunk}, {where}) in a static decode step is served only "
                f"while the static cache fits in one chunk, where it is causal; got a static cache of "
                f"max_len={max_len}: use the dynamic steps (attend), which serve any length{rank_suffix()}")

    def check_padding(self, attention_mask: torch.Tensor) -> None:
        """The model's 2D padding mask must be the cache's left padding, checked on the device with no host read:
        the verdict is read at the next check or by ``settle`` (Note [Padding checked a step behind])."""
        self.settle()
        mask = attention_mask.to(torch.bool)
        if mask.dim() != 2 or mask.shape[0] != len(self.kv.starts):
            self._bad_padding(tuple(mask.shape))
        if self._starts is None or self._starts.device != mask.device:
            self._starts = host_to_device(torch.tensor(self.kv.starts), mask.device)
        want = torch.arange(mask.shape[-1], device=mask.device)[None, :] >= self._starts[:, None]
        bad, done = (mask != want).any(), None
        if bad.is_cuda:                 # copied as soon as it is computed: settle's read launches nothing
            bad, done = torch.empty((), dtype=torch.bool, pin_memory=True).copy_(bad, non_blocking=True), \
                torch.cuda.Event()
            done.record()
        self._verdict = bad, done, tuple(mask.shape)

    def settle(self) -> None:
        """Raise if the last padding mask checked was not the cache's left padding (reads its verdict)."""
        verdict, self._verdict = self._verdict, None
        if verdict is None:
            return
        bad, done, shape = verdict
        if done is not None:
            done.synchronize()
        if bool(bad):
            self._bad_padding(shape)

    def _bad_padding(self, shape: tuple[int, ...]) -> None:
        raise NotImplementedError(
            f"attention_mask must be the left padding the cache was filled with (rows start at {self.kv.starts}),"
            f" got a mask of shape {shape} that differs: padding inside a row or a changed batch is "
            f"not supported{rank_suffix()}")

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.kv.length + self.promised

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.kv.length + self.promised

    def get_mask_sizes(self, query: Any, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: every cached token and the new ones (``query``: a length or positions)."""
        n = query if isinstance(query, int) else int(query.shape[-1])
        return self.kv.length + self.promised + n, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.kv.spec.max_len is None else self.kv.spec.max_len

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        """No layer holds linear-attention state: transformers (>= 5.2x) feeds generate's first step only the
        tokens this cache lacks exactly when some layer is not linear (``Cache.is_linear`` reads ``layers``,
        which this cache keeps empty)."""
        return [False] * self.kv.spec.layers

    @property
    def batch_size(self) -> int:
        return self.kv.spec.batch

    def _refused(self, what: str) -> None:
        raise NotImplementedError(f"{what} is not supported by seqpar's sharded cache{rank_suffix()}")

    def reset(self) -> None:
        self._refused("reset (make a new cache)")

    def crop(self, tokens_to_remove: int) -> None:
        self._refused("crop (assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refused("reorder_cache (beam search)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refused("batch_repeat_interleave (num_return_sequences, beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refused("batch_select_indices")


def generate(model: Any, input_ids: torch.Tensor, *, mesh: Any = None, method: str = "ring", layout: str | None = None,
             kernel: str = "auto", passes: str = "auto", prefill_chunk: int | None = None, max_len: int | None = None,
             past_key_values: SeqparCache | None = None, attention_mask: torch.Tensor | None = None,
             method_options: dict[str, Any] | None = None, cache: SeqparCache | None = None,
             pixel_values: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
             **generate_kwargs: Any) -> Any:
    """``model.generate(input_ids, **generate_kwargs)`` with the prompt and the KV cache sharded over ``mesh``.

    Call it on every rank with the same arguments (Note [Generate with a sharded prompt]).

    Args:
        model: a transformers causal LM (any attention implementation; seqpar's is used for the call).
        input_ids: ``(B, S)`` the global prompt, the same on every rank (with ``past_key_values``: the whole
            conversation so far, the cached part included).
        mesh: the sequence-parallel group (DeviceMesh, 2D for ``usp``; ProcessGroup; None = world).
        method, layout, method_options: how the first prompt chunk is attended (``seqpar.attention``).
        kernel: local kernel ("auto" or a name).
        passes: "auto", "kv" or "q": how later chunks attend to the cache (``CacheSpec.passes``).
        prefill_chunk: prefill at most this many tokens per forward (None: the whole prompt at once).
        max_len: a static cache of this many tokens (None: dynamic).
        past_key_values, cache: a ``SeqparCache`` from an earlier call (multi-turn; ``out.past_key_values``, or
            ``out.cache`` in transformers >= 5.2x); its batch and padding must match. Give one of the two.
        attention_mask: ``(B, S)`` left padding (default: inferred from ``pad_token_id``, as transformers does).
        pixel_values, token_type_ids: Gemma 3's images (``Gemma3ForConditionalGeneration`` only; Note [Images in
            generate]): ``(N, C, H, W)`` the images of the prompt's image tokens, and ``(B, S)`` 1 at the image
            tokens (their bidirectional spans), as transformers' ``generate`` takes them; first turn only.
        **generate_kwargs: passed to ``model.generate`` (greedy, sampling, logits processors, stopping, ...).
            Sampling draws from the global RNG: seed every rank alike (``torch.manual_seed(s)``) and every rank
            draws the same tokens.

    Returns:
        What ``model.generate`` returns (the cache, if returned, is the ``SeqparCache``).
    """
    rs = rank_suffix()
    _refuse(model, generate_kwargs)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids must be a (batch, seq) integer tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}{rs}")
    mask = attention_mask if attention_mask is not None else _inferred_mask(model, input_ids, generate_kwargs)
    starts = _left_padding(mask, input_ids.shape)
    if cache is not None and past_key_values is not None:
        raise ValueError(f"give the cache as past_key_values or as cache, not both{rs}")
    cache = cache if cache is not None else past_key_values
    if cache is None:
        layers = model.config.get_text_config().num_hidden_layers
        cache = SeqparCache(ShardedKVCache(layers=layers, batch=input_ids.shape[0], mesh=mesh, max_len=max_len,
                                           kernel=kernel, passes=passes))
    _check_continuation(cache, input_ids, starts, mesh=mesh, kernel=kernel, passes=passes, max_len=max_len)
    images = _images(model, input_ids, pixel_values, token_type_ids, generate_kwargs, cached=cache.kv.length)
    embeds = None if pixel_values is None else _embeddings(model, input_ids[:, :-1], pixel_values)
    def fill() -> None:
        prefill(model, cache, input_ids[:, :-1], method=method, layout=layout, chunk=prefill_chunk, starts=starts,
                method_options=method_options, inputs_embeds=embeds, image_spans=images)

    with serving(model, cache, method=method, layout=layout), _at_first_forward(model, cache, fill,
                                                                                input_ids.shape[1] - 1):
        return model.generate(input_ids, attention_mask=mask, **cache_kwargs(model, cache), **generate_kwargs)


@contextlib.contextmanager
def _at_first_forward(model: Any, cache: SeqparCache, fill: Any, length: int) -> Iterator[None]:
    """Run ``fill()`` (the prefill up to ``length`` tokens) when ``model`` is first called, not now (Note [Prefill at
    the first forward]); until then the cache reports those tokens as held."""
    def hook(module: Any, args: Any, kwargs: Any) -> None:
        handle.remove()
        cache.promised = 0
        fill()

    cache.promised = length - cache.kv.length
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        if cache.promised:             # generate stopped before its first forward: nothing was promised
            cache.promised = 0


@contextlib.contextmanager
def serving(model: Any, cache: SeqparCache, *, method: str = "ring", layout: str | None = None
            ) -> Iterator[SeqparCache]:
    """For the duration, ``model`` attends through ``cache`` (a temporary ``attn_implementation``).

    What ``generate`` uses; engines that drive the model themselves (a benchmark, a server loop) use it with
    ``prefill`` and then call the model with the cache (``cache_kwargs``; decode: replicated tokens, RoPE
    positions ``cache.kv.length - start``; or a static step, ``cache.kv.static_decode()``).
    """
    kv = cache.kv
    handle = enable(kv.mesh, method=method, layout=layout or methods.get(method).default_layout(),
                    kernel=kv.spec.kernel, name=f"seqpar_cache_{id(cache)}", check_positions=False)
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(handle.name)
        handle.kv_cache = cache
        yield cache
        cache.settle()
    finally:
        handle.kv_cache = None
        model.set_attn_implementation(previous)
        handle.disable()


def prefill(model: Any, cache: SeqparCache, input_ids: torch.Tensor, *, method: str = "ring",
            layout: str | None = None, chunk: int | None = None, starts: tuple[int, ...] | None = None,
            method_options: dict[str, Any] | None = None, inputs_embeds: torch.Tensor | None = None,
            image_spans: tuple[tuple[int, int], ...] = ()) -> None:
    """Run ``model`` over the tokens of ``input_ids (B, T)`` the cache lacks, sharded, in chunks of ``chunk``.

    Call it inside ``serving``, on every rank with the same global ids. ``starts``: each row's first real token
    (left padding), with the cache's first tokens only. Only the decoder runs (``model.base_model``): no logits.
    ``inputs_embeds``: ``(B, T, E)`` what the decoder gets instead of the ids' embeddings (Gemma 3's images);
    ``image_spans``: ``((start, end), ...)`` positions whose tokens see their whole span, all in the first chunk
    of an empty cache (Note [Images in generate]).
    """
    rs = rank_suffix()
    kv = cache.kv
    end = input_ids.shape[1]
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int or None, got {chunk!r}{rs}")
    if end < kv.length:
        raise ValueError(f"input_ids must hold at least the {kv.length} cached tokens, got {end}{rs}")
    step = chunk or max(end - kv.length, 1)
    if image_spans and (kv.length or max(b for _, b in image_spans) > min(end, step)):
        raise NotImplementedError(
            f"images must lie in the first prefill chunk of an empty cache (prefill_chunk={chunk}: later chunks "
            f"attend to the cache causally), got images at {list(image_spans)} for tokens [{kv.length}, {end}) in "
            f"chunks of {step}{rs}")
    with torch.no_grad(), _discarding(cache, kv.spec.layers - 1):
        for a in range(kv.length, end, step):
            b = min(end, a + step)
            c = kv.begin_prefill(b - a, method=method, layout=layout, starts=starts if kv.length == 0 else None,
                                 mask_mod=spans(image_spans) if image_spans and a == 0 else None,
                                 **(method_options or {}))
            x = {"input_ids": c.take(input_ids[:, a:b])} if inputs_embeds is None else \
                {"inputs_embeds": c.take(inputs_embeds[:, a:b])}
            model.base_model(**x, position_ids=c.position_ids_on(input_ids.device), use_cache=True,
                             **cache_kwargs(model.base_model, cache))


@contextlib.contextmanager
def _discarding(cache: SeqparCache, layer: int) -> Iterator[None]:
    """While open, ``layer``'s attention output is not computed (Note [The prefill's dead attention])."""
    cache.dead_layer = layer
    try:
        yield
    finally:
        cache.dead_layer = None


def _refuse(model: Any, kwargs: dict[str, Any]) -> None:
    config = kwargs.get("generation_config") or model.generation_config
    for key, (default, what) in _REFUSED.items():
        value = kwargs.get(key, getattr(config, key, default))
        if value != default and value is not None:
            raise NotImplementedError(f"{what} is not supported by seqpar's sharded generate, got {key}={value!r}"
                                      f"{rank_suffix()}")


def _images(model: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
            token_type_ids: torch.Tensor | None, kwargs: dict[str, Any], *, cached: int) -> tuple[tuple[int, int], ...]:
    """Gemma 3's image spans among the prompt's uncached tokens; media the sharded generate cannot serve raise
    (Note [Images in generate])."""
    rs = rank_suffix()
    name = type(model).__name__
    config = model.config
    gemma3 = getattr(config, "model_type", None) == "gemma3"
    media = {"pixel_values": pixel_values, "token_type_ids": token_type_ids, **{k: kwargs.get(k) for k in _MEDIA}}
    for key, value in media.items():
        if value is not None and not (gemma3 and key in ("pixel_values", "token_type_ids")):
            raise NotImplementedError(f"{key} is not supported by seqpar's sharded generate ({name}): only Gemma 3's "
                                      f"images (Gemma3ForConditionalGeneration: pixel_values, token_type_ids) are "
                                      f"served; generate from text-only prompts{rs}")
    for key in _MEDIA_TOKENS:
        token = getattr(config, key, None)
        if isinstance(token, int) and pixel_values is None and bool((input_ids[:, cached:] == token).any()):
            raise NotImplementedError(f"the prompt holds {name}'s media token {token} ({key}) without its features: "
                                      f"give pixel_values (Gemma 3), or generate from text-only prompts{rs}")
    if not gemma3:
        return ()
    S = input_ids.shape[1]
    images = tuple(s for s in _image_spans(token_type_ids, *input_ids.shape) if s[1] > cached)
    if cached and (pixel_values is not None or images):
        got = "pixel_values" if pixel_values is not None else f"token_type_ids with an image at {list(images[0])}"
        raise NotImplementedError(f"a turn that continues a cache of {cached} tokens (past_key_values) must add no "
                                  f"images (extensions attend causally), got {got}{rs}")
    if bool((input_ids[:, -1] == config.image_token_id).any()) or (images and images[-1][1] == S):
        raise NotImplementedError(f"the last prompt token (position {S - 1}) must be text, got an image token: "
                                  f"model.generate runs it without image features, after the sharded prefill{rs}")
    return images


def _embeddings(model: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
    """``(B, T, E)``: what Gemma 3's forward feeds its decoder for ``input_ids (B, T)`` and ``pixel_values (N, C,
    H, W)``: token embeddings, the image tokens' replaced by the vision tower's features (Note [Images in
    generate]; the model's own steps, on every rank)."""
    inner = model.model
    token = model.config.image_token_id
    ids = input_ids.masked_fill(input_ids == token, 0) if token >= inner.vocab_size else input_ids
    with torch.no_grad():
        embeds = inner.get_input_embeddings()(ids)
        feats = inner.get_image_features(pixel_values, return_dict=True).pooler_output.to(embeds.device, embeds.dtype)
        return embeds.masked_scatter(inner.get_placeholder_mask(input_ids, embeds, feats), feats)


def _inferred_mask(model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """transformers' rule: padding where ``input_ids == pad_token_id`` if it occurs and is not an EOS token."""
    config = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", config.pad_token_id)
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    ones = torch.ones_like(input_ids)
    if pad is None or pad in eos or not bool((input_ids == pad).any()):
        return ones
    return (input_ids != pad).long()


def _left_padding(mask: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """Each row's first real token; the mask must be zeros then ones in every row."""
    rs = rank_suffix()
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(shape)}, got "
                         f"{getattr(mask, 'shape', type(mask).__name__)}{rs}")
    valid = mask.to(torch.bool)
    starts = shape[1] - valid.sum(1)
    left = torch.arange(shape[1], device=valid.device)[None, :] >= starts[:, None]
    verdict = torch.stack([starts, (valid == left).all(1).long()]).tolist()     # one read of the device
    for b, (s, ok) in enumerate(zip(*verdict)):
        if s >= shape[1] - 1 or not ok:
            raise NotImplementedError(f"attention_mask must be left padding with at least 2 real tokens per row, got "
                                      f"row {b}: {valid[b].int().tolist()[:16]}{rs}")
    return tuple(verdict[0])


def _check_continuation(cache: SeqparCache, input_ids: torch.Tensor, starts: tuple[int, ...], **given: Any) -> None:
    rs = rank_suffix()
    if not isinstance(cache, SeqparCache):
        raise TypeError(f"past_key_values must be a SeqparCache from an earlier generate, got "
                        f"{type(cache).__name__}{rs}")
    kv = cache.kv
    held = {"mesh": kv.mesh, "kernel": kv.spec.kernel, "passes": kv.spec.passes, "max_len": kv.spec.max_len}
    for name, value in given.items():
        if value is not held[name] and value != held[name]:
            raise ValueError(f"{name} must be the cache's ({held[name]!r}) when past_key_values is given, got "
                             f"{value!r}{rs}")
    if kv.spec.batch != input_ids.shape[0]:
        raise ValueError(f"input_ids must have the cache's batch {kv.spec.batch}, got {input_ids.shape[0]}{rs}")
    if kv.length and (kv.length >= input_ids.shape[1] or kv.starts != starts):
        raise ValueError(f"input_ids must extend the cached {kv.length} tokens with the same left padding "
                         f"{kv.starts}, got {input_ids.shape[1]} tokens starting at {starts}{rs}")
