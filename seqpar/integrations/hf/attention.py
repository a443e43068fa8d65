"""The transformers attention function: ``enable``, the ``Handle`` it returns and what transformers calls.

What the model asks for and what seqpar does with it (Note [What the attention function honours]):

    transformers passes                     seqpar
    query (B, H, L, D), key/value (B, Hkv, L, D)   -> q, k, v (B, L, H|Hkv, D): transposed views, GQA as is
    module.is_causal / is_causal=           -> causal (in global positions)
    scaling                                 -> softmax_scale
    sliding_window= (or module.sliding_window) -> window_size=(w - 1, 0), global positions (HF: w keys incl. self)
    config.layer_types[i] == chunked_attention -> mask_mod=chunked(attention_chunk_size) (Llama 4; per document
                                               when the batch has documents)
    image_spans= (shard_batch, from token_type_ids) -> Gemma 3's bidirectional images: causal=False,
                                               mask_mod=spans(image_spans[, window]) on full and sliding layers
    cu_seq_lens_q / cu_seq_lens_k           -> cu_seqlens: GLOBAL document boundaries (shard_batch sets them)
    position_ids                            -> checked against this rank's global positions (RoPE already applied)
    Llama 4's position-scaled NoPE queries  -> rescaled to the tokens' global indices (Note [Position-scaled queries])
    attention_mask (any tensor, 4D included) -> ValueError: shard_batch turns padding into documents instead
    dropout > 0, output_attentions, a KV cache with past tokens -> NotImplementedError
    (except seqpar's own cache under ``generate``: its tokens, sinks and left padding are honoured)

Special masks (Note [Layer masks] in ``layers``): each layer's call gets its own rule, read from the layer and its
config the way transformers picks the layer's mask - full, sliding (its own window per layer, so interleaved
sliding and global layers - Gemma 2/3, gpt-oss, Qwen - each get theirs), chunked (Llama 4's
``attention_chunk_size`` on its ``chunked_attention`` layers, plain causal on the others), and Gemma 3's image
tokens (``token_type_ids == 1`` runs, one image each) attending bidirectionally within their image on full and
sliding layers. What cannot be expressed is refused by name, never attended as plain causal: a layer type
other than full/sliding/chunked, image spans on a model other than Gemma 3, token_type_ids handed to the model
itself, any piece of transformers' mask function seqpar does not derive from the layer (Note [Reading
transformers' mask functions]), a vision or audio tower's attention (its patches are not sharded: give the
tower its own implementation, ``attn_implementation={"text_config": name, "vision_config": "sdpa"}``).
Gemma 3 images: compute ``inputs_embeds`` on the whole batch (the vision tower and the embedding merge, on
every rank), then ``shard_batch({"inputs_embeds": ..., "token_type_ids": ..., "labels": ...})``.
Under ``layout="balanced"`` every call passes ``balance="causal"`` so that every layer sees the tokens
where ``shard_batch`` placed them, with each named mask on its dense kernels (Note [Layer masks]).

Nothing is global in seqpar: the ``Handle`` returned by ``enable`` holds the configuration and is captured by the
functions it registers. ``handle.disable()`` (or leaving ``with enable(...):``) restores what was registered
under the name before (or a stub that raises, when nothing was: transformers has no public unregister).

torch.compile: a compiled model has no graph break at attention (``seqpar.attention`` traces as one custom op)
and reads packed batches' boundaries on the host once per batch, never once per layer (Note [Compiling a model
with seqpar attention]).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ... import methods
from ...api import attention, attention_config, positions
from ...config import AttentionConfig
from ...errors import rank_suffix
from ...groups import SeqParallelGroups
from ...layouts import DOCUMENT_LAYOUTS
from .batch import _as_tuple, _check_boundary_tensor, batch_layout, shard_batch
from .layers import _window, check_mask_function, layer_mask, query_scales, rescale_queries

__all__ = ["DEFAULT_NAME", "Handle", "enable", "host_boundaries"]

_window = _window   # hf_ring_flash reads it through huggingface (it moved to layers)

DEFAULT_NAME = "seqpar"
_UNSET = object()

# Keyword arguments transformers' models pass to attention functions that do not change attention itself
# (position_ids is checked separately; the cu_seq_lens_* and max_length_* are ours, set by shard_batch).
_BENIGN = frozenset({
    "position_ids", "use_cache", "cache_position", "num_items_in_batch", "shift_labels", "labels",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "output_hidden_states", "return_dict",
    "logits_to_keep", "past_key_values", "position_embeddings",
})
# Keyword arguments that would change the result; a non-default value raises (Note [What the attention
# function honours]): we never accept an option and ignore it.
_REFUSED = {
    "output_attentions": "output_attentions=True (the attention matrix over the whole sequence is never formed)",
    "position_bias": "an additive position bias (position_bias=...)",
    "head_mask": "a head mask (head_mask=...)",
    "cache": "a paged KV cache (cache=...)",
    "attention_chunk_size": "chunked attention passed as attention_chunk_size=... (seqpar reads it from the config)",
    "token_type_ids": "token_type_ids passed to attention (give them to shard_batch: Gemma 3's image tokens become "
                      "global image_spans)",
}
# The model types of towers whose attention runs on unsharded inputs (image patches, audio frames).
_TOWERS = ("vision", "audio")


def enable(mesh: Any = None, method: str = "usp", layout: str | None = None, kernel: str = "auto", *,
           name: str = DEFAULT_NAME, check_positions: bool = True, ignore_kwargs: Iterable[str] = (),
           deterministic: bool = False, grad_dtype: torch.dtype = torch.float32, check_ranks: bool | int = True,
           **options: Any) -> Handle:
    """Register seqpar as the transformers attention implementation ``name`` and return its handle.

    Args:
        mesh: the sequence-parallel mesh: a DeviceMesh (2D with dims "ulysses", "ring" for ``usp``), a
            ProcessGroup, or None for the default group. Checked now when torch.distributed is initialised.
        method: a name from ``seqpar.methods.available()`` (or "auto").
        layout: the token layout ("zigzag", "contiguous", "stripe", "balanced"; each method accepts a subset).
            None: per batch, ``balanced`` for a batch with documents (packed or padded; ``shard_batch``
            turns them into ``cu_seq_lens_q``) where the method accepts it, else the method's default
            (zigzag where it has it). ``shard_batch`` and the attention calls decide from the same fact.
        kernel: "auto" or a kernel name (``seqpar.kernels.available_kernels()``).
        name: the ``attn_implementation`` name to register (two handles with two names can coexist).
        check_positions: check once per forward that ``position_ids`` are this rank's global positions (or
            per-document positions of the batch's documents): catches a model fed local positions. Costs one
            small device-to-host read per forward; position schemes that are not ``(B, L)`` are not checked.
        ignore_kwargs: extra keyword arguments a model may pass to attention functions that you know do not
            change attention (unknown non-None keyword arguments raise otherwise).
        deterministic, grad_dtype, check_ranks, **options: as in ``seqpar.attention``; a model compiled with
            ``torch.compile(mode="reduce-overhead")`` over several ranks needs ``check_ranks=False`` (the
            agreement round reads its result on the host, which a CUDA graph cannot capture).

    Returns:
        A ``Handle``: use ``attn_implementation=name``; ``handle.disable()`` or ``with`` restores the registry.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError("seqpar.integrations.huggingface needs transformers >= 4.53 (AttentionInterface and "
                          f"masking_utils.AttentionMaskInterface): {e}") from e
    handle = Handle(mesh=mesh, method=method, layout=layout, kernel=kernel, name=name,
                    check_positions=check_positions, ignore_kwargs=frozenset(ignore_kwargs),
                    deterministic=deterministic, grad_dtype=grad_dtype, check_ranks=check_ranks,
                    options=dict(options))
    handle._register(AttentionInterface, AttentionMaskInterface)
    return handle


class Handle:
    """The configuration of one ``enable`` call; its bound methods are what transformers calls.

    Attributes:
        mesh, method, layout, kernel, options: where tokens live and how attention runs (fixed).
        config: the validated ``AttentionConfig`` of every call (per-call: causal, window, documents).
        name: the registered ``attn_implementation``.
    """

    def __init__(self, *, mesh: Any, method: str, layout: str | None, kernel: str, name: str, check_positions: bool,
                 ignore_kwargs: frozenset[str], deterministic: bool, grad_dtype: torch.dtype,
                 options: dict[str, Any], check_ranks: bool | int = True):
        if not isinstance(name, str) or not name or name in ("eager", "sdpa", "flex_attention") \
                or name.startswith(("flash_attention", "paged")):
            raise ValueError(f"name must be a new attn_implementation name, got {name!r}{rank_suffix()}")
        if method != "auto":
            self.config: AttentionConfig | None = attention_config(
                method, layout=layout, kernel=kernel, deterministic=deterministic, grad_dtype=grad_dtype, **options)
            if dist.is_available() and dist.is_initialized():
                SeqParallelGroups.resolve(mesh, methods.get(method).mesh_dims)
        else:
            self.config = None
        self.mesh, self.method, self.layout, self.kernel, self.name = mesh, method, layout, kernel, name
        self.options = dict(options)
        self.deterministic, self.grad_dtype, self.check_ranks = deterministic, grad_dtype, check_ranks
        self.check_positions, self.ignore_kwargs = check_positions, ignore_kwargs
        self.active = False
        self._previous: tuple[Any, Any] = (None, None)
        self._interfaces: tuple[Any, Any] = (None, None)
        # Note [Host reads of refillable buffers]: small caches keyed by object identity AND content stamp
        self._cu_seen = _BoundaryReads()
        self._pos_seen: tuple[Any, tuple[int, int] | None, Any] = (None, None, None)
        self._glob: dict[tuple, torch.Tensor] = {}
        self.attention_fn = self._attention
        self.kv_cache: Any = None   # a hf_generate.SeqparCache while generate() runs: its tokens go to it

    # -- registry ------------------------------------------------------------------------------------------

    def _register(self, attn_iface: Any, mask_iface: Any) -> None:
        self._interfaces = (attn_iface, mask_iface)
        self._previous = (attn_iface().get(self.name), mask_iface().get(self.name))
        attn_iface.register(self.name, self.attention_fn)
        mask_iface.register(self.name, self._mask)
        self.active = True

    def disable(self) -> None:
        """Restore the registry entries ``name`` had before ``enable`` (a raising stub if there were none)."""
        if not self.active:
            return
        attn_iface, mask_iface = self._interfaces
        prev_attn, prev_mask = self._previous
        attn_iface.register(self.name, prev_attn if prev_attn is not None else _disabled(self.name))
        mask_iface.register(self.name, prev_mask if prev_mask is not None else _disabled(self.name))
        self.active = False

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.disable()

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in sorted(self.options.items()))
        return (f"Handle(name={self.name!r}, method={self.method!r}, layout={self.layout!r}, kernel={self.kernel!r}"
                f"{extra}, active={self.active})")

    # -- what transformers calls ---------------------------------------------------------------------------

    def _mask(self, *args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
        """The mask function registered for ``name``: seqpar needs no dense mask; any padding mask raises.

        Without a registered mask function transformers would drop a user's 2D ``attention_mask`` silently
        for an unknown implementation; registering this one makes that an error instead. It also reads the
        pieces transformers built the mask from and refuses those seqpar does not derive from the layer (Note
        [Reading transformers' mask functions] in ``layers``).
        """
        check_mask_function(kwargs.get("mask_function"), kwargs.get("config"), self.name)
        if attention_mask is not None and self.kv_cache is not None:     # seqpar's KV cache: its left padding
            self.kv_cache.check_padding(attention_mask)
            return None
        if attention_mask is not None:
            raise ValueError(
                f"attention_mask must be None with attn_implementation={self.name!r}, got a tensor of shape "
                f"{tuple(attention_mask.shape)}: pass the batch through shard_batch, which turns padding and "
                f"packed documents into global document boundaries (cu_seq_lens_q) and drops the mask"
                f"{rank_suffix()}")
        return None

    def _attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   sliding_window: Any = _UNSET, is_causal: bool | None = None, **kwargs: Any
                   ) -> tuple[torch.Tensor, None]:
        """transformers' attention-function signature -> ``seqpar.attention`` -> ``(out (B, L, H, D), None)``.

        Args:
            module: the calling attention module (``is_causal``, ``sliding_window``, ``layer_idx``, ``config``
                are read: Note [Layer masks]).
            query: ``(B, H, L, D)`` this rank's queries (RoPE applied at global positions).
            key, value: ``(B, Hkv, L, D)``.
            attention_mask: must be None (see ``_mask``); a 4D mask raises as well.
        """
        where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
        cached = self.kv_cache is not None and self.kv_cache.serves(getattr(module, "layer_idx", None), key)
        sinks = kwargs.pop("s_aux", None)                              # gpt-oss's per-head sink logits
        if sinks is None:
            sinks = kwargs.pop("sinks", None)
        softcap = kwargs.pop("softcap", None)                          # Gemma 2's attn_logit_softcapping
        image_spans = kwargs.pop("image_spans", None)                  # shard_batch's, from token_type_ids
        if cached and softcap:
            raise NotImplementedError(f"logit softcapping (softcap={softcap}) is not served by seqpar's KV cache "
                                      f"(decode and extension kernels do not cap scores), in {where}{rank_suffix()}")
        self._refuse(where, attention_mask, dropout, kwargs)
        self._refuse_tower(module, where)
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if sliding_window is _UNSET:
            sliding_window = getattr(module, "sliding_window", None)
        if cached:                                                     # seqpar's KV cache: prefill or decode
            return self._cached(module, query, causal, scaling, sliding_window, image_spans, sinks, where), None
        if key.shape[2] != query.shape[2]:
            raise NotImplementedError(
                f"decoding with a KV cache is not supported by attn_implementation={self.name!r} (query length "
                f"{query.shape[2]}, key length {key.shape[2]} in {where}): call the model with use_cache=False, "
                f"every token of the sequence sharded{rank_suffix()}")
        if torch.compiler.is_compiling():      # Note [Compiling a model with seqpar attention]
            cu_t = kwargs.get("cu_seq_lens_q")
            cu = host_boundaries(cu_t) if isinstance(cu_t, torch.Tensor) else cu_t
        else:
            cu = self._documents(kwargs)
            self._check_positions(kwargs.get("position_ids"), cu, query.shape[2])
        scales = query_scales(module, where)
        if scales is not None:
            query = self._global_scaled(query, scales, cu, where)
        lm = layer_mask(module, causal=causal, sliding_window=sliding_window, cu=cu if isinstance(cu, tuple) else None,
                        image_spans=image_spans, where=where)
        if lm.chunk is not None and isinstance(cu, torch.Tensor):
            raise NotImplementedError(
                f"chunked attention over packed documents under torch.compile is not supported (its chunks restart "
                f"at each document, which is read on the host), in {where}: run the model eagerly{rank_suffix()}")
        layout = batch_layout(self.method, self.layout, cu)
        q_BSHD, k_BSHD, v_BSHD = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        out_BSHD = attention(q_BSHD, k_BSHD, v_BSHD, mesh=self.mesh, method=self.method, layout=layout,
                             causal=lm.causal, softmax_scale=scaling, kernel=self.kernel, window_size=lm.window,
                             cu_seqlens=cu, deterministic=self.deterministic, grad_dtype=self.grad_dtype,
                             softcap=float(softcap or 0.0), sinks=sinks, mask_mod=lm.mask, balance="causal",
                             check_ranks=self.check_ranks, **self.options)
        return out_BSHD, None

    def _cached(self, module: torch.nn.Module, query: torch.Tensor, causal: bool, scaling: float | None,
                sliding_window: Any, image_spans: Any, sinks: torch.Tensor | None, where: str) -> torch.Tensor:
        """A layer's call on seqpar's KV cache (``generate``): causal, its window, a chunked layer's chunks (Note
        [Chunked layers in generate]); no image spans."""
        if image_spans is not None:
            raise NotImplementedError(f"image_spans (Gemma 3's bidirectional images) are not served by seqpar's KV "
                                      f"cache (generate decodes causally), in {where}{rank_suffix()}")
        lm = layer_mask(module, causal=causal, sliding_window=sliding_window, cu=None, image_spans=None, where=where)
        scales = query_scales(module, where)
        if scales is not None:                 # Note [Position-scaled queries]: the chunk's cache positions
            chunk = self.kv_cache.kv.chunk
            if chunk is not None and chunk.sharded:
                L = query.shape[2]
                model_pos = torch.arange(L) + self.kv_cache.get_seq_length(module.layer_idx)
                query = rescale_queries(query, chunk.positions.cpu(), model_pos, scales)
        return self.kv_cache.attention(module.layer_idx, query, causal=causal, scaling=scaling, window=lm.window,
                                       sinks=sinks, chunk=lm.chunk, where=where)

    def _global_scaled(self, query: torch.Tensor, scales: tuple[int, float], cu: Any, where: str) -> torch.Tensor:
        """Queries a layer scaled at local indices, scaled at their global ones (Note [Position-scaled queries])."""
        L = query.shape[2]
        S = L * self._world()
        if S < scales[0]:                      # every factor is 1, locally and globally
            return query
        if torch.compiler.is_compiling():
            raise NotImplementedError(f"Llama 4's position-scaled queries (attn_temperature_tuning) past "
                                      f"floor_scale={scales[0]} tokens are not supported under torch.compile, in "
                                      f"{where}: run the model eagerly{rank_suffix()}")
        layout = batch_layout(self.method, self.layout, cu)
        glob = positions(S, mesh=self.mesh, method=self.method, layout=layout, device="cpu",
                         cu_seqlens=cu if layout in DOCUMENT_LAYOUTS else None)
        return rescale_queries(query, glob, torch.arange(L), scales)

    # Note [Compiling a model with seqpar attention]
    #     seqpar.attention traces as one custom op (seqpar.runtime.op), so a compiled model has no graph break
    #     at attention. What this function adds is host-side: reading cu_seq_lens_q into ints and checking
    #     position_ids. Under compile both would be data-dependent reads, so the boundaries stay a tensor
    #     (an input of the op, read on the host inside it: a new packed batch neither recompiles nor guards on
    #     data), and positions are checked in eager calls only. The op reads its boundary tensor with
    #     .tolist() in forward and again in backward, which for a tensor on the GPU (a training loop that
    #     moves the whole batch there) is a device-to-host sync per layer, twice. So the tensor first goes
    #     through ``host_boundaries``, one more opaque op, which returns it on the host: it reads a device
    #     tensor once per content (Note [Host reads of refillable buffers]: every layer of a forward, its
    #     backward and a checkpointed recompute get the copy made by the first layer; a buffer refilled in
    #     place is read again) and copies a host tensor, with no sync. seqpar.attention then gets a CPU int
    #     tensor and saves it for backward; transformers' own attention paths, which would want it on the
    #     GPU, are not called (seqpar's attention is the registered one).

    def _refuse(self, where: str, attention_mask: Any, dropout: float, kwargs: dict[str, Any]) -> None:
        rs = rank_suffix()
        if attention_mask is not None:
            shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be None with attn_implementation={self.name!r}, got {shape} in "
                             f"{where}: shard_batch turns padding and documents into cu_seq_lens_q{rs}")
        if dropout:
            raise NotImplementedError(
                f"attention dropout is not supported (seqpar has no position-keyed dropout RNG), got dropout="
                f"{dropout} in {where}: set config.attention_dropout=0.0 or call model.eval(){rs}")
        for key, value in kwargs.items():
            if key in _REFUSED:
                if value is not None and value is not False:
                    raise NotImplementedError(f"{_REFUSED[key]} is not supported by attn_implementation="
                                              f"{self.name!r}, got {key}={_short(value)} in {where}{rs}")
            elif key not in _BENIGN and key not in self.ignore_kwargs and value is not None and value is not False:
                raise NotImplementedError(
                    f"keyword argument {key!r} passed to attention is not understood by attn_implementation="
                    f"{self.name!r} (got {_short(value)} in {where}); if it does not change attention, list it "
                    f"in enable(..., ignore_kwargs=[{key!r}]){rs}")

    def _refuse_tower(self, module: torch.nn.Module, where: str) -> None:
        """A vision or audio tower's attention runs on unsharded patches or frames: never sequence-parallel."""
        model_type = str(getattr(getattr(module, "config", None), "model_type", ""))
        if any(t in model_type for t in _TOWERS):
            raise NotImplementedError(
                f"{type(module).__name__} of the {model_type!r} tower called attn_implementation={self.name!r}, "
                f"but its inputs (image patches, audio frames) are not sharded over the sequence: give the tower "
                f"its own implementation, e.g. model.set_attn_implementation({{'text_config': {self.name!r}, "
                f"'vision_config': 'sdpa'}}){rank_suffix()}")

    def _world(self) -> int:
        dims = _mesh_dims(self.mesh, self.method)
        return SeqParallelGroups.resolve(self.mesh, dims).world

    def _documents(self, kwargs: dict[str, Any]) -> tuple[int, ...] | None:
        """Global document boundaries from ``cu_seq_lens_q`` (read on the host once per content)."""
        cu_q = kwargs.get("cu_seq_lens_q")
        if cu_q is None:
            if kwargs.get("cu_seq_lens_k") is not None:
                raise ValueError(f"cu_seq_lens_k must come with cu_seq_lens_q (self-attention), got only "
                                 f"cu_seq_lens_k{rank_suffix()}")
            return None
        cu = self._host_cu(cu_q)
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu_q and self._host_cu(cu_k) != cu:
            raise NotImplementedError(f"cu_seq_lens_k must equal cu_seq_lens_q (self-attention over the same "
                                      f"documents), got {self._host_cu(cu_k)[:8]} and {cu[:8]}{rank_suffix()}")
        return cu

    def _host_cu(self, cu: Any) -> tuple[int, ...]:
        """Host ints of a boundary tensor, read once per content (Note [Host reads of refillable buffers])."""
        if not isinstance(cu, torch.Tensor):
            return _as_tuple(cu)
        return self._cu_seen.read(cu)[0]

    # Note [Host reads of refillable buffers]
    #     A forward calls the attention function once per layer with the same cu_seq_lens_q and position_ids
    #     objects; reading a CUDA boundary tensor or checking CUDA positions costs a device-to-host sync, so
    #     each is done once per forward and remembered. The memory is keyed on the object (held, so its id
    #     cannot be reused) AND its stamp (``_stamp``: the version counter every in-place op bumps, and the
    #     storage pointer): a collator or a CUDA-graph feeder that refills one buffer in place between steps
    #     changes the stamp, so the next forward reads the new documents and checks the new positions instead
    #     of reusing the previous batch's. Inference tensors (``torch.inference_mode``) carry no version
    #     counter: they are read on every call (one read per layer; use ``torch.no_grad`` to read once).

    def _check_positions(self, pos: Any, cu: tuple[int, ...] | None, local_len: int) -> None:
        """``position_ids`` must be global positions (or positions within documents), checked once per content.

        Note [RoPE sees global positions]: RoPE is applied before attention, from ``position_ids``. A model
        called on a shard without them numbers the shard's tokens 0..L-1 and every rank but the first is
        silently wrong; so is a zigzag shard given positions in global order. This check turns both into an
        error (``shard_batch`` gives the right ones).
        """
        if not self.check_positions or not isinstance(pos, torch.Tensor):
            return
        pos_BL = pos[None] if pos.dim() == 1 else pos
        if pos_BL.dim() != 2 or pos_BL.shape[-1] != local_len:
            return                                            # other position schemes (e.g. M-RoPE): not ours
        seen, seen_stamp, seen_cu = self._pos_seen
        stamp = _stamp(pos)
        if seen is pos and stamp is not None and seen_stamp == stamp and seen_cu == cu:
            return                                            # Note [Host reads of refillable buffers]
        layout = batch_layout(self.method, self.layout, cu)
        key = (local_len, str(pos.device), layout, cu if layout in DOCUMENT_LAYOUTS else None)
        if key not in self._glob:
            self._glob = {key: positions(local_len * self._world(), mesh=self.mesh, method=self.method,
                                         layout=layout, device=pos.device, cu_seqlens=key[3])}
        glob = self._glob[key]
        ok = pos_BL == glob
        if cu is not None:
            bounds = torch.tensor(cu, dtype=torch.long, device=pos.device)
            starts = bounds[torch.searchsorted(bounds[1:], glob, right=True).clamp_(max=len(cu) - 2)]
            ok = ok | (pos_BL == glob - starts)
        if not bool(ok.all()):
            first = pos_BL[0, :6].tolist()
            raise ValueError(
                f"position_ids must be the global positions of this rank's tokens (or positions within the "
                f"batch's documents), got {first}... where the {layout} layout of method={self.method!r} "
                f"holds positions {glob[:6].tolist()}...: build the batch with shard_batch (RoPE must see global "
                f"positions), or pass check_positions=False to enable() for another position scheme"
                f"{rank_suffix()}")
        self._pos_seen = (pos, stamp, cu)

    # -- conveniences bound to this handle's placement -----------------------------------------------------

    def shard_batch(self, batch: Mapping[str, Any], **kwargs: Any) -> dict[str, Any]:
        """``shard_batch(batch, self.mesh, self.method, self.layout, **kwargs)``."""
        return shard_batch(batch, self.mesh, self.method, self.layout, **kwargs)

    def positions(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's tokens, int64 ``(L,)`` (``seqpar.positions``)."""
        return positions(seq_len, mesh=self.mesh, method=self.method, layout=self.layout, device=device)


GRAPH_BREAK_REASON = "seqpar attention runs eagerly (host-side schedules over collectives)"


def _eager(fn: Any) -> Any:
    """``fn`` excluded from torch.compile tracing: one documented graph break per attention call."""
    try:
        return torch.compiler.disable(fn, recursive=True, reason=GRAPH_BREAK_REASON)
    except TypeError:                      # torch < 2.8: no reason argument
        return torch.compiler.disable(fn, recursive=True)


class _BoundaryReads:
    """The last ``keep`` boundary tensors read to the host, each held with its stamp and both host forms
    (ints and a CPU tensor of the same dtype): Note [Host reads of refillable buffers]."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.seen: dict[int, tuple[torch.Tensor, tuple[int, int] | None, tuple[tuple[int, ...], torch.Tensor]]] = {}
        self.reads = 0
        """Tensors read (one device-to-host copy each for a device tensor)."""

    def read(self, cu: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor]:
        stamp = _stamp(cu)
        hit = self.seen.get(id(cu))
        if hit is not None and hit[0] is cu and stamp is not None and hit[1] == stamp:
            return hit[2]
        _check_boundary_tensor(cu)
        self.reads += 1
        host = cu.detach().to("cpu", copy=True)
        value = (tuple(int(x) for x in host.tolist()), host)
        if stamp is not None:
            if len(self.seen) >= self.keep and id(cu) not in self.seen:
                self.seen.pop(next(iter(self.seen)))
            self.seen[id(cu)] = (cu, stamp, value)
        return value


_OP_READS = _BoundaryReads()
"""The reads of ``host_boundaries``: module-level because a custom op takes only tensors (a few small tensors)."""


@torch.library.custom_op("seqpar::host_boundaries", mutates_args=(), schema="(Tensor cu) -> Tensor")
def host_boundaries(cu: torch.Tensor) -> torch.Tensor:
    """``cu`` (any device) as a CPU tensor of its dtype, read once per content (Note [Compiling a model with
    seqpar attention]); opaque to torch.compile."""
    return _OP_READS.read(cu)[1].clone()                   # an op's output is never shared between calls


@host_boundaries.register_fake
def _(cu: torch.Tensor) -> torch.Tensor:
    return torch.empty(cu.shape, dtype=cu.dtype, device="cpu")


def _disabled(name: str):
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the seqpar attention registered as {name!r} was disabled: call "
                           f"seqpar.integrations.huggingface.enable(..., name={name!r}) again{rank_suffix()}")
    return fn


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def _stamp(t: Any) -> tuple[int, int] | None:
    """What changes when a tensor is refilled in place: its version counter and its storage pointer; None
    when it cannot be told (not a tensor, or an inference tensor, which has no version counter)."""
    if not isinstance(t, torch.Tensor) or t.is_inference():
        return None
    return (t._version, t.data_ptr())


def _mesh_dims(mesh: Any, method: str) -> int:
    if method == "auto":
        return 2 if getattr(mesh, "ndim", 1) == 2 else 1
    return methods.get(method).mesh_dims
