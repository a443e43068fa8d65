"""transformers models on seqpar, through transformers' public attention registry.

    import seqpar.integrations.huggingface as sp_hf

    handle = sp_hf.enable(mesh, method="usp", layout="zigzag")        # registers attn_implementation "seqpar"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="seqpar")
    batch = handle.shard_batch(global_batch)        # this rank's tokens, global positions, shifted labels, docs
    loss = model(**batch).loss                      # this rank's share: local token-loss sum / global count
    loss.backward()
    sp_hf.all_reduce_gradients(model.parameters(), mesh)   # (or FSDP/DDP over the mesh: grad_reduction="mean")

What the model asks for and what seqpar does with it (Note [What the attention function honours]):

    transformers passes                     seqpar
    query (B, H, L, D), key/value (B, Hkv, L, D)   -> q, k, v (B, L, H|Hkv, D): transposed views, GQA as is
    module.is_causal / is_causal=           -> causal (in global positions)
    scaling                                 -> softmax_scale
    sliding_window= (or module.sliding_window) -> window_size=(w - 1, 0), global positions (HF: w keys incl. self)
    cu_seq_lens_q / cu_seq_lens_k           -> cu_seqlens: GLOBAL document boundaries (shard_batch sets them)
    position_ids                            -> checked against this rank's global positions (RoPE already applied)
    attention_mask (any tensor)             -> ValueError: shard_batch turns padding into documents instead
    dropout > 0, output_attentions, softcap, sinks, a KV cache with past tokens -> NotImplementedError
    (except seqpar's own cache under ``generate``: its tokens, sinks and left padding are honoured)

Nothing is global in seqpar: the ``Handle`` returned by ``enable`` holds the configuration and is captured by the
functions it registers. ``handle.disable()`` (or leaving ``with enable(...):``) restores what was registered
under the name before (or a stub that raises, when nothing was: transformers has no public unregister).

torch.compile: a compiled model has no graph break at attention (``seqpar.attention`` traces as one custom op)
and reads packed batches' boundaries on the host once per batch, never once per layer (Note [Compiling a model
with seqpar attention]).

Activation memory: transformers' ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable``
before 5.2x) works unchanged: each decoder layer keeps only its input and is recomputed in backward, seqpar's
attention (and its communication) included; every rank recomputes in the same order, so the collectives pair
up. Use ``use_reentrant=False``. The logits are the other long-context peak: compute the loss from the final
hidden states with ``sequence_parallel_loss(..., chunk_size=...)`` (Note [Tiled loss]) instead of asking the
model for logits. ``examples/train_long_context.py`` combines both with FSDP2 over a data x sequence mesh.

Training with a KV cache: pass ``use_cache=False`` (or set ``config.use_cache = False``): a cache would keep
every layer's K and V alive for nothing, and decoding with one raises.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from .. import methods
from ..api import attention, attention_config, placement, positions, shard
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..layouts import DOCUMENT_LAYOUTS

__all__ = ["Handle", "SPLoss", "SeqparCache", "all_reduce_gradients", "enable", "generate", "prefill",
           "reduce_loss", "sequence_parallel_loss", "serving", "shard_batch", "token_loss_sum"]

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
    "attention_chunk_size": "chunked attention (attention_chunk_size=...)",
}


# --------------------------------------------------------------------------------------------------------------
# enable / the handle


def enable(mesh: Any = None, method: str = "usp", layout: str | None = None, kernel: str = "auto", *,
           name: str = DEFAULT_NAME, check_positions: bool = True, ignore_kwargs: Iterable[str] = (),
           deterministic: bool = False, grad_dtype: torch.dtype = torch.float32, **options: Any) -> Handle:
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
        deterministic, grad_dtype, **options: as in ``seqpar.attention``.

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
                    deterministic=deterministic, grad_dtype=grad_dtype, options=dict(options))
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
                 options: dict[str, Any]):
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
        self.deterministic, self.grad_dtype = deterministic, grad_dtype
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
        for an unknown implementation; registering this one makes that an error instead.
        """
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
            module: the calling attention module (``is_causal``, ``sliding_window``, ``layer_idx`` are read).
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
        if cached and softcap:
            raise NotImplementedError(f"logit softcapping (softcap={softcap}) is not served by seqpar's KV cache "
                                      f"(decode and extension kernels do not cap scores), in {where}{rank_suffix()}")
        self._refuse(where, attention_mask, dropout, kwargs)
        if cached:                                                     # seqpar's KV cache: prefill or decode
            if sliding_window is _UNSET:
                sliding_window = getattr(module, "sliding_window", None)
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
            return self.kv_cache.attention(module.layer_idx, query, causal=causal, scaling=scaling,
                                           window=_window(sliding_window, causal, where), sinks=sinks), None
        if key.shape[2] != query.shape[2]:
            raise NotImplementedError(
                f"decoding with a KV cache is not supported by attn_implementation={self.name!r} (query length "
                f"{query.shape[2]}, key length {key.shape[2]} in {where}): call the model with use_cache=False, "
                f"every token of the sequence sharded{rank_suffix()}")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if sliding_window is _UNSET:
            sliding_window = getattr(module, "sliding_window", None)
        window = _window(sliding_window, causal, where)
        if torch.compiler.is_compiling():      # Note [Compiling a model with seqpar attention]
            cu = kwargs.get("cu_seq_lens_q")
            cu = host_boundaries(cu) if isinstance(cu, torch.Tensor) else cu
        else:
            cu = self._documents(kwargs)
            self._check_positions(kwargs.get("position_ids"), cu, query.shape[2])
        q_BSHD, k_BSHD, v_BSHD = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        out_BSHD = attention(q_BSHD, k_BSHD, v_BSHD, mesh=self.mesh, method=self.method,
                             layout=batch_layout(self.method, self.layout, cu), causal=causal,
                             softmax_scale=scaling, kernel=self.kernel, window_size=window, cu_seqlens=cu,
                             deterministic=self.deterministic, grad_dtype=self.grad_dtype,
                             softcap=float(softcap or 0.0), sinks=sinks, **self.options)
        return out_BSHD, None

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


def _as_tuple(cu: Any) -> tuple[int, ...]:
    if isinstance(cu, torch.Tensor):
        _check_boundary_tensor(cu)
        return tuple(int(x) for x in cu.tolist())
    return tuple(int(x) for x in cu)


def _check_boundary_tensor(cu: torch.Tensor) -> None:
    if cu.dim() != 1 or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise TypeError(f"cu_seq_lens_q must be a 1D integer tensor, got {cu.dtype} of shape {tuple(cu.shape)}"
                        f"{rank_suffix()}")


def _window(sliding_window: Any, causal: bool, where: str) -> tuple[int, int]:
    """HF's ``sliding_window=w``: a query sees the ``w`` keys ending at itself, i.e. flash-attn ``(w - 1, 0)``."""
    if sliding_window is None or sliding_window is False:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r} in {where}"
                         f"{rank_suffix()}")
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _mesh_dims(mesh: Any, method: str) -> int:
    if method == "auto":
        return 2 if getattr(mesh, "ndim", 1) == 2 else 1
    return methods.get(method).mesh_dims


# --------------------------------------------------------------------------------------------------------------
# shard_batch

_SEQ_KEYS = ("input_ids", "inputs_embeds")
_KNOWN = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels",
                    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "num_items_in_batch"})


def shard_batch(batch: Mapping[str, Any], mesh: Any = None, method: str = "usp", layout: str | None = None, *,
                pad: bool = False, pad_token_id: int = 0, ignore_index: int = -100,
                seq_keys: Iterable[str] = ()) -> dict[str, Any]:
    """This rank's share of a global causal-LM batch, ready for ``model(**batch)``.

    Every rank of the sequence-parallel group passes the same global batch (no communication happens).

    Note [Labels are shifted before sharding]: a causal LM predicts token t+1 at position t; after sharding,
    t and t+1 may live on different ranks (always, at a zigzag seam). So labels are shifted on the GLOBAL
    sequence (``shift_labels[t] = labels[t + 1]``, ``ignore_index`` at the end, exactly as transformers'
    loss does) and then sharded like the tokens; transformers' loss uses ``shift_labels`` when given.

    Documents (Note [Documents, padding and positions]): boundaries come from, in any combination,
    ``cu_seq_lens_q`` (global, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` makes them),
    ``position_ids`` that restart (transformers' packed-sequence rule: a position that is not the previous
    plus one starts a document), and an ``attention_mask`` whose valid tokens form one run per row (left or
    right padding: the padding becomes its own document and its tokens and targets are ignored in the loss).
    Boundaries must be the same in every row (seqpar's documents are per call); a mask with holes, rows with
    different documents, or ``cu_seq_lens_q`` that disagrees with restarting ``position_ids`` raise.
    Positions: the given ``position_ids``; else positions restarting at each ``cu_seq_lens_q`` document; else
    ``0..S-1`` (transformers' default, padding included).

    Args:
        batch: global tensors ``(B, S)`` (``inputs_embeds``: ``(B, S, C)``) with keys among ``input_ids`` or
            ``inputs_embeds``, ``attention_mask``, ``position_ids``, ``labels``, ``shift_labels``,
            ``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``, ``num_items_in_batch``, plus ``seq_keys``.
        mesh, method, layout: the placement (as in ``enable``; ``layout=None``: ``balanced`` when the batch has
            documents and the method accepts it, else the method's default, see ``batch_layout``).
        pad: end-pad a length the layout cannot split (with ``pad_token_id``, ignored labels, one more
            document) instead of raising.
        ignore_index: the label value that is not a target.
        seq_keys: other per-token ``(B, S, ...)`` keys to shard as they are.

    Returns:
        ``input_ids`` (or ``inputs_embeds``) and ``position_ids`` ``(B, L)``; with labels, ``labels`` and
        ``shift_labels`` (both the shifted, sharded targets) and ``num_items_in_batch`` (the global count of
        targets, so ``model(**batch).loss`` is this rank's share of the global mean); with documents,
        ``cu_seq_lens_q``/``_k`` (global boundaries, int32 on the CPU) and ``max_length_q``/``_k``.
    """
    seq_keys = tuple(seq_keys)
    rs = rank_suffix()
    unknown = sorted(set(batch) - _KNOWN - set(seq_keys))
    if unknown:
        raise TypeError(f"batch keys must be among {sorted(_KNOWN)} (or named in seq_keys= to shard as they are), "
                        f"got {unknown}{rs}")
    given = [k for k in _SEQ_KEYS if batch.get(k) is not None]
    if len(given) != 1:
        raise ValueError(f"batch must have exactly one of input_ids, inputs_embeds, got {given or 'neither'}{rs}")
    x = batch[given[0]]
    if x.dim() != (2 if given[0] == "input_ids" else 3):
        raise ValueError(f"{given[0]} must be (batch, seq{'' if given[0] == 'input_ids' else ', hidden'}), got "
                         f"shape {tuple(x.shape)}{rs}")
    B, S = x.shape[:2]
    valid = _padding(batch.get("attention_mask"), B, S, x.device)
    pos = _positions_BS(batch.get("position_ids"), B, S, x.device)
    explicit = _explicit_docs(batch, S)
    bounds = set(explicit or ())
    if pos is not None:
        resets = _position_resets(pos)
        if explicit is not None and not resets <= set(explicit):
            raise ValueError(f"position_ids restart at {sorted(resets)[:8]} but cu_seq_lens_q has boundaries "
                             f"{list(explicit)[:8]}: they must describe the same documents{rs}")
        bounds |= resets
    if valid is not None:
        bounds |= _valid_run(valid)
    cu = tuple(sorted(bounds | {0, S})) if len(bounds - {0, S}) or explicit is not None else None
    if pos is None:
        pos = _doc_positions(explicit, S, x.device).expand(B, S) if explicit is not None else \
            torch.arange(S, device=x.device).expand(B, S)
    targets = _shift_labels(batch, valid, ignore_index)
    out: dict[str, Any] = {}
    items = batch.get("num_items_in_batch")
    if targets is not None and items is None:
        items = (targets != ignore_index).sum()
    requested, layout = layout, batch_layout(method, layout, cu)
    lay_div = _divisor(mesh, method, layout, cu)
    tensors = {given[0]: x, "position_ids": pos, **{k: batch[k] for k in seq_keys if batch.get(k) is not None}}
    if targets is not None:
        tensors["labels"] = targets
    if S % lay_div:
        if not pad:
            need = -(-S // lay_div) * lay_div
            raise ValueError(f"sequence length must be a multiple of {lay_div} for the {layout} layout of method="
                             f"{method!r}, got {S} (pad to {need}, or pass pad=True){rs}")
        tensors, cu = _pad_end(tensors, cu, S, lay_div, pad_token_id, ignore_index, given[0])
        layout = batch_layout(method, requested, cu)   # the padding is a document now; its divisor divides lay_div
    where = {"mesh": mesh, "method": method, "layout": layout, "cu_seqlens": cu}
    for key, t in tensors.items():
        out[key] = shard(t.contiguous(), dim=1, **where)
    if targets is not None:
        out["shift_labels"] = out["labels"]
        out["num_items_in_batch"] = items
    if cu is not None:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        longest = max(b - a for a, b in itertools.pairwise(cu))
        out.update(cu_seq_lens_q=cu_t, cu_seq_lens_k=cu_t, max_length_q=longest, max_length_k=longest)
    return out


def batch_layout(method: str, layout: str | None, cu: tuple[int, ...] | None) -> str | None:
    """The layout of one batch: ``layout`` when given; else ``balanced`` for a batch with documents where
    ``method`` accepts it (packed rows keep equal work per rank), else None (the method's default)."""
    if layout is not None or cu is None or method == "auto":
        return layout
    return "balanced" if "balanced" in methods.get(method).layouts else None


def _divisor(mesh: Any, method: str, layout: str | None, cu: tuple[int, ...] | None) -> int:
    lay, _, _ = placement(mesh, method, layout, cu if layout in DOCUMENT_LAYOUTS else None)
    return lay.divisor


def _padding(mask: Any, B: int, S: int, device: torch.device) -> torch.Tensor | None:
    """A (B, S) bool of valid tokens, or None when there is no mask or no padding."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (B, S):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise NotImplementedError(f"attention_mask must be a (batch, seq) = ({B}, {S}) padding mask; custom masks "
                                  f"(4D or other) cannot be sharded, got {shape}{rank_suffix()}")
    valid = mask.to(device=device, dtype=torch.bool)
    return None if bool(valid.all()) else valid


def _valid_run(valid: torch.Tensor) -> set[int]:
    """Boundaries of the one run of valid tokens every row must share (padding before/after it)."""
    rs = rank_suffix()
    rows = valid.cpu()
    if not bool((rows == rows[0]).all()):
        raise NotImplementedError(
            "attention_mask rows must pad the same positions (seqpar's documents are shared by the batch); "
            f"got rows with different padding: give each sequence-parallel group one row, or pack the rows into "
            f"one with cu_seq_lens_q{rs}")
    row = rows[0]
    idx = row.nonzero().flatten()
    if idx.numel() == 0:
        raise ValueError(f"attention_mask must mark at least one valid token, got all zeros{rs}")
    a, b = int(idx[0]), int(idx[-1]) + 1
    if not bool(row[a:b].all()):
        raise NotImplementedError(
            f"attention_mask must have its valid tokens in one run per row (left or right padding), got padding "
            f"inside the run [{a}, {b}); such a mask cannot be expressed as documents{rs}")
    return {a, b}


def _positions_BS(pos: Any, B: int, S: int, device: torch.device) -> torch.Tensor | None:
    if pos is None:
        return None
    if not isinstance(pos, torch.Tensor) or pos.shape[-1] != S or pos.dim() > 2:
        raise ValueError(f"position_ids must be (batch, seq), (1, seq) or (seq,) with seq={S}, got "
                         f"{tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__}{rank_suffix()}")
    pos = pos.to(device)
    return (pos[None] if pos.dim() == 1 else pos).expand(B, S)


def _position_resets(pos: torch.Tensor) -> set[int]:
    """transformers' packed-sequence rule: t > 0 starts a document when ``pos[t] != pos[t - 1] + 1``."""
    resets = (pos[:, 1:] != pos[:, :-1] + 1).cpu()
    if not bool((resets == resets[0]).all()):
        raise NotImplementedError(f"position_ids must restart at the same positions in every row (seqpar's "
                                  f"documents are shared by the batch), got rows that differ{rank_suffix()}")
    return {int(t) + 1 for t in resets[0].nonzero().flatten()}


def _explicit_docs(batch: Mapping[str, Any], S: int) -> tuple[int, ...] | None:
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is None:
        if cu_k is not None:
            raise ValueError(f"cu_seq_lens_k must come with cu_seq_lens_q, got only cu_seq_lens_k{rank_suffix()}")
        return None
    cu = _as_tuple(cu_q)
    if cu_k is not None and _as_tuple(cu_k) != cu:
        raise NotImplementedError(f"cu_seq_lens_k must equal cu_seq_lens_q (self-attention), got {_as_tuple(cu_k)[:8]}"
                                  f" and {cu[:8]}{rank_suffix()}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != S or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seq_lens_q must rise from 0 to the sequence length {S}, got {list(cu)[:12]}"
                         f"{rank_suffix()}")
    return cu


def _doc_positions(cu: tuple[int, ...], S: int, device: torch.device) -> torch.Tensor:
    """Positions restarting at every document: ``t - start(doc(t))``, ``(S,)``."""
    pos = torch.arange(S, device=device)
    bounds = torch.tensor(cu, dtype=torch.long, device=device)
    starts = bounds[torch.searchsorted(bounds[1:], pos, right=True).clamp_(max=len(cu) - 2)]
    return pos - starts


def _shift_labels(batch: Mapping[str, Any], valid: torch.Tensor | None, ignore: int) -> torch.Tensor | None:
    """Global targets: ``labels[t + 1]`` at t (or ``shift_labels`` as given); padding never a query or target."""
    shifted = batch.get("shift_labels")
    labels = batch.get("labels")
    if shifted is None and labels is None:
        return None
    if shifted is None:
        if valid is not None:
            labels = labels.masked_fill(~valid, ignore)
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore)], 1)
    if valid is not None:
        shifted = shifted.masked_fill(~valid, ignore)
        shifted[:, :-1].masked_fill_(~valid[:, 1:], ignore)
    return shifted


def _pad_end(tensors: dict[str, torch.Tensor], cu: tuple[int, ...] | None, S: int, div: int, pad_id: int,
             ignore: int, token_key: str) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """End-pad to a multiple of ``div``: the padding is one more document, never a target."""
    S_pad = -(-S // div) * div
    extra = S_pad - S
    out = {}
    for key, t in tensors.items():
        shape = list(t.shape)
        shape[1] = extra
        if key == "position_ids":            # global positions: the padding document's RoPE is irrelevant
            tail = torch.arange(S, S_pad, device=t.device, dtype=t.dtype).expand(t.shape[0], extra)
        elif key == "labels":
            tail = t.new_full(shape, ignore)
        elif key == token_key == "input_ids":
            tail = t.new_full(shape, pad_id)
        else:
            tail = t.new_zeros(shape)
        out[key] = torch.cat([t, tail], 1)
    return out, tuple(sorted(set(cu or (0, S)) | {S, S_pad}))


# --------------------------------------------------------------------------------------------------------------
# loss over the sequence-parallel group


@dataclass(frozen=True)
class SPLoss:
    """A loss over the sequence-parallel group (Note [Loss over the sequence-parallel group]).

    Attributes:
        loss: this rank's share, to call ``backward`` on: the local token-loss sum over the group's target
            count (times the group size with ``grad_reduction="mean"``).
        value: the group's mean token loss, detached, equal on every rank: what one process would report.
        tokens: the group's target count (int64).
    """

    loss: torch.Tensor
    value: torch.Tensor
    tokens: torch.Tensor


def token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, *,
                   chunk_size: int | None = None, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross entropies over this rank's tokens, and their count, logits in chunks.

    Note [Tiled loss]: logits for a long shard are ``L x V`` floats (a 256K-token shard with a 128K vocabulary
    is 128 GiB in fp32). Here they exist one chunk of ``chunk_size`` tokens at a time: each chunk's logits
    (``hidden @ weight.T``, upcast to at least fp32 as transformers does) and its cross-entropy sum are computed under
    activation checkpointing, so backward recomputes the chunk's logits instead of keeping them. Peak extra
    memory: one chunk's fp32 logits and their gradient.

    Args:
        hidden: ``(B, L, C)`` final hidden states (after the last norm).
        weight: ``(V, C)`` the LM head weight.
        shift_labels: ``(B, L)`` targets (``shard_batch``'s ``shift_labels``).
        chunk_size: tokens per chunk (default: all of them, in one piece).

    Returns:
        ``(sum, count)``: fp32 (fp64 for fp64 input) scalar sum of token losses and int64 scalar count of targets.
    """
    rs = rank_suffix()
    if hidden.dim() != 3 or shift_labels.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (batch, seq, hidden) and shift_labels (batch, seq), got "
                         f"{tuple(hidden.shape)} and {tuple(shift_labels.shape)}{rs}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}{rs}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1)
    step = h.shape[0] if chunk_size is None else chunk_size
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, h.shape[0], step):
        hc, yc = h[start:start + step], y[start:start + step]
        if torch.is_grad_enabled() and (hc.requires_grad or weight.requires_grad):
            total = total + checkpoint(_chunk_loss, hc, weight, yc, ignore_index, use_reentrant=False)
        else:
            total = total + _chunk_loss(hc, weight, yc, ignore_index)
    return total, (y != ignore_index).sum()


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, ignore_index: int) -> torch.Tensor:
    logits = h @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))       # fp32 at least, as transformers
    return torch.nn.functional.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")


def reduce_loss(loss_sum: torch.Tensor, count: torch.Tensor | int, mesh: Any = None, *,
                num_items: torch.Tensor | int | None = None, grad_reduction: str = "sum") -> SPLoss:
    """This rank's share of the group's mean token loss, and the mean itself.

    Note [Loss over the sequence-parallel group]: one process computes ``sum_t loss_t / N`` over all N
    targets. Rank r holds the terms of its tokens, so its share is ``sum_{t in r} loss_t / N`` with N summed
    over the group (or given as ``num_items``, e.g. ``shard_batch``'s ``num_items_in_batch``): the shares add
    up to the single-process loss, and so do their parameter gradients - sum them over the group
    (``all_reduce_gradients``, ``grad_reduction="sum"``). Data-parallel wrappers that AVERAGE gradients over
    a mesh containing the sequence-parallel ranks (FSDP2 over data x sequence, DDP) divide by the group size
    W: use ``grad_reduction="mean"``, which multiplies the share by W.

    Args:
        loss_sum: this rank's token-loss sum (a scalar with grad).
        count: this rank's target count.
        mesh: the sequence-parallel mesh or group (every dim of a DeviceMesh is reduced over).
        num_items: the group's target count, if known (skips one all-reduce).
        grad_reduction: "sum" or "mean" (see the Note).
    """
    rs = rank_suffix()
    if grad_reduction not in ("sum", "mean"):
        raise ValueError(f"grad_reduction must be 'sum' or 'mean', got {grad_reduction!r}{rs}")
    groups = _reduce_groups(mesh)
    if num_items is None:
        tokens = torch.as_tensor(count, device=loss_sum.device).to(torch.float64).reshape(())
        tokens = tokens.clone()
        for g in groups:
            dist.all_reduce(tokens, group=g)
    else:
        tokens = torch.as_tensor(num_items, device=loss_sum.device).to(torch.float64).reshape(())
    denom = tokens.clamp(min=1).to(loss_sum.dtype)
    share = loss_sum / denom
    if grad_reduction == "mean":
        share = share * _group_size(groups)
    value = loss_sum.detach().clone()
    for g in groups:
        dist.all_reduce(value, group=g)
    return SPLoss(loss=share, value=value / denom, tokens=tokens.to(torch.int64))


def sequence_parallel_loss(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor, mesh: Any = None,
                           *, chunk_size: int | None = None, ignore_index: int = -100,
                           num_items: torch.Tensor | int | None = None, grad_reduction: str = "sum") -> SPLoss:
    """``reduce_loss(*token_loss_sum(hidden, weight, shift_labels, chunk_size=...), mesh, ...)``.

    The causal-LM loss of a sharded batch without forming all logits at once (Note [Tiled loss]).
    """
    loss_sum, count = token_loss_sum(hidden, weight, shift_labels, chunk_size=chunk_size, ignore_index=ignore_index)
    return reduce_loss(loss_sum, count, mesh, num_items=num_items, grad_reduction=grad_reduction)


def all_reduce_gradients(params: Iterable[torch.nn.Parameter], mesh: Any = None, *, op: str = "sum",
                         bucket_bytes: int = 256 << 20) -> None:
    """Sum (or average) parameter gradients over the sequence-parallel group, in flat buckets.

    With ``reduce_loss``'s default ``grad_reduction="sum"``, summing makes every rank's gradient the
    single-process gradient. FSDP/DDP reduce gradients themselves: use ``grad_reduction="mean"`` there and
    do not call this.
    """
    rs = rank_suffix()
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}{rs}")
    grads = [p.grad for p in params if p.grad is not None]
    if any(type(g) is not torch.Tensor for g in grads):
        raise TypeError(f"all_reduce_gradients works on plain tensors, got {type(grads[0]).__name__} gradients: "
                        f"FSDP/DDP reduce gradients themselves (use grad_reduction='mean' in the loss){rs}")
    groups = _reduce_groups(mesh)
    scale = 1.0 / _group_size(groups) if op == "mean" else None
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for g in grads:
        lists = buckets.setdefault((g.dtype, g.device), [[]])
        if sum(t.numel() for t in lists[-1]) * g.element_size() >= bucket_bytes:
            lists.append([])
        lists[-1].append(g)
    for lists in buckets.values():
        for bucket in lists:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            for group in groups:
                dist.all_reduce(flat, group=group)
            if scale is not None:
                flat.mul_(scale)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _reduce_groups(mesh: Any) -> list[Any]:
    """The process groups whose product is the sequence-parallel group (every dim of a DeviceMesh)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first")
    if mesh is None:
        return [dist.group.WORLD]
    if isinstance(mesh, dist.ProcessGroup):
        return [mesh]
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):
        return [mesh.get_group(i) for i in range(mesh.ndim)]
    raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}{rank_suffix()}")


def _group_size(groups: list[Any]) -> int:
    return math.prod(dist.get_world_size(g) for g in groups)


from .hf_generate import SeqparCache, generate, prefill, serving  # noqa: E402  (long-context inference over a sharded KV cache)
