"""Selective recompute for transformers models on seqpar: checkpointed layers keep their attention's output.

    from seqpar.integrations import hf_selective

    keep = hf_selective.keep_attention(handle)            # handle: what huggingface.enable(...) returned
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=keep.checkpoint_kwargs())
    loss = model(**batch).loss                             # each layer's attention runs once ...
    loss.backward()                                        # ... and its recompute runs everything else
    keep.stats                                             # calls kept, bytes kept, calls replayed

Activation checkpointing recomputes each decoder layer in backward, seqpar's attention forward (and its
communication) included. At long sequences attention is nearly all of a layer's FLOPs (Llama-3-8B, 1M tokens over
8 ranks: ~95% of the forward), so the recompute costs about one more forward. ``keep_attention`` keeps what the
attention's backward needs from the forward (its output and lse) and recomputes only the cheap rest of the layer
(norms, projections, RoPE, the MLP): Megatron-LM's selective recompute, with seqpar's attention as the core that
is not recomputed (Note [Keeping attention's output]). The gradients are those of plain checkpointing, bitwise
where the forward is deterministic (``tests/test_hf_memory.py``: W = 1, 2 and 4, every method, FSDP2 through
``examples/train_long_context.py --keep-attention``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import rank_suffix
from .hf.attention import Handle

__all__ = ["KeepAttention", "KeepStats", "keep_attention"]

# Note [Keeping attention's output]
#     torch.utils.checkpoint (use_reentrant=False) drops what a layer's ops save in forward and runs the layer
#     again when backward first needs one of those tensors; the recomputed tensors are matched to the forward's
#     by the order in which they were saved. ``checkpoint(context_fn=...)`` runs the forward under one context
#     and the recompute under another: ``KeepAttention.context_fn`` gives each checkpointed call a frame and
#     the attention function registered for the handle's name (wrapped by ``KeepAttention``) sees which of the
#     two is running.
#       forward     the call runs seqpar's attention under saved-tensor hooks of its own. They are the innermost
#                   hooks, so every tensor the attention's autograd nodes save reaches them and not the
#                   checkpoint: a view of the storage of the call's query, key or value is recorded as its
#                   geometry (storage offset, sizes, strides), to be rebuilt on the recomputed inputs; anything
#                   else (out and lse; a direct kernel's own outputs; Ulysses' and USP's head-layout tensors) is
#                   kept on the device.
#       recompute   the call does not run attention: it records the recomputed query, key and value and returns
#                   the kept output, as a leaf that requires grad, so the rest of the layer builds the same graph
#                   and saves the same tensors, in the same order, as the checkpoint expects.
#       backward    the attention node built in the forward, never recomputed, unpacks through the same hooks:
#                   kept tensors as they are, input views rebuilt on the recomputed inputs. Its backward (seqpar's,
#                   communication included) runs on the same values as after a plain recompute, with the
#                   forward's out and lse in place of the recompute's: bitwise the same gradients when the
#                   forward is deterministic, and o_proj's weight gradient reads the same out.
#     Collectives: a kept call runs its forward once and nothing in the recompute; a call past the budget runs as
#     under plain checkpointing (its recompute repeats the forward). Which calls are kept depends only on their
#     order and shapes, so every rank keeps the same ones and the ranks' collectives stay matched.
#     Memory: a kept call holds its out (B x L x H x Dv in the compute dtype) and lse (B x H x L, fp32) from its
#     forward to its backward, for Llama-3-8B at 128K tokens per rank 1 GiB + 16 MiB per layer (32.5 GiB for 32
#     layers); Ulysses and USP keep their engine's head-layout q, k, v, out and lse as well (~3.5x that).
#     Where it lives: on the GPU, within ``keep_bytes`` (not through ActivationOffload). The outputs are read in
#     backward in the middle of each layer's recompute, they are as large as the layer inputs the offloader
#     already moves, and pinning them would double the host memory and the first step's pinning time; keeping
#     them on the GPU costs no copy. A budget bounds them instead: a call is kept when the bytes kept so far in
#     this forward plus its out and lse fit. A forward begins when an attention module is called again (the
#     previous forward's first layer, or a warm-up's) or after a backward began; a model that calls one
#     attention module twice in a forward (shared layers) therefore counts per repetition. Each of these
#     facts is the same on every rank (pass the same ``keep_bytes`` everywhere), never the memory free now.
#     With ActivationOffload: its hooks sit outside the checkpoint and see the layer inputs as before; kept
#     tensors never reach them. An offloader given ``reserve_bytes`` computes its GPU budget when the forward
#     starts: count the kept outputs in that reserve.
#     Refused by name: reentrant checkpointing (no context_fn), torch.compile around the layer, a recompute that
#     calls attention with other shapes or more often than the forward, a recompute stopped before the
#     attention call (the checkpoint's early stop, when nothing after attention saves a tensor: a decoder
#     layer's MLP always does).


@dataclass
class KeepStats:
    """What ``KeepAttention`` did since the current (or last) forward began."""

    kept_calls: int = 0
    """Attention calls in checkpointed layers whose output and lse were kept (no recompute of their forward)."""
    kept_bytes: int = 0
    """Device bytes they hold (each storage once; parameters not counted)."""
    not_kept_calls: int = 0
    """Calls in checkpointed layers not kept: past ``keep_bytes``, or without a gradient to compute."""
    replayed_calls: int = 0
    """Recomputes that returned a kept output instead of running attention."""
    recomputed_calls: int = 0
    """Recomputes that ran attention again (the calls not kept)."""
    rebuilt_tensors: int = 0
    """Saved tensors rebuilt on the recomputed query, key and value (views of them: nothing kept)."""
    unframed_calls: int = 0
    """Calls with a gradient outside any checkpointed layer (nothing to keep; a model checkpointed without
    ``checkpoint_kwargs()`` shows up here)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def keep_attention(handle: Handle, *, keep_bytes: int | None = None) -> KeepAttention:
    """Keep the attention output of checkpointed layers instead of recomputing it (Note [Keeping attention's
    output]). Checkpoint the layers with ``checkpoint_kwargs()``; ``remove()`` undoes it.

    Args:
        handle: the active handle of ``seqpar.integrations.huggingface.enable``; its registered attention
            function is wrapped (transformers looks it up by name at every call).
        keep_bytes: device bytes of kept outputs per forward (out and lse of each call); calls past it are
            recomputed as under plain checkpointing. None: no limit. The same on every rank.
    """
    return KeepAttention(handle, keep_bytes=keep_bytes)


class KeepAttention:
    """The wrapped attention function and the checkpoint contexts of ``keep_attention``."""

    def __init__(self, handle: Handle, *, keep_bytes: int | None = None):
        if not isinstance(handle, Handle):
            raise TypeError(f"handle must be the Handle returned by seqpar.integrations.huggingface.enable, got "
                            f"{type(handle).__name__}{rank_suffix()}")
        if keep_bytes is not None and (isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int)
                                       or keep_bytes < 0):
            raise ValueError(f"keep_bytes must be a non-negative int or None, got {keep_bytes!r}{rank_suffix()}")
        from transformers import AttentionInterface

        current = AttentionInterface().get(handle.name)
        if not handle.active or current is not handle.attention_fn:
            raise ValueError(f"handle {handle.name!r} must be active with its own attention function registered "
                             f"(active={handle.active}, registered {getattr(current, '__qualname__', current)!r})"
                             f"{rank_suffix()}")
        self.handle, self.keep_bytes = handle, keep_bytes
        self.stats = KeepStats()
        self._inner = handle.attention_fn
        self._interface = AttentionInterface
        self._local = threading.local()
        self._kept = 0                     # bytes kept by this forward's calls (the budget's count)
        self._fresh = True                 # the next framed forward call starts a new count
        self._seen: set[int] = set()       # attention modules called in this forward
        self.attention_fn = self._attention          # one bound method: what is registered, compared by identity
        AttentionInterface.register(handle.name, self.attention_fn)

    def __repr__(self) -> str:
        return f"KeepAttention(name={self.handle.name!r}, keep_bytes={self.keep_bytes!r}, stats={self.stats})"

    def remove(self) -> None:
        """Register the handle's own attention function again (when the handle is still active)."""
        if self.handle.active and self._interface().get(self.handle.name) is self.attention_fn:
            self._interface.register(self.handle.name, self._inner)

    # -- checkpointing -------------------------------------------------------------------------------------

    def checkpoint_kwargs(self) -> dict[str, Any]:
        """``torch.utils.checkpoint.checkpoint`` keyword arguments (transformers' ``activation_checkpointing_kwargs``
        / ``gradient_checkpointing_kwargs``): non-reentrant, with this object's ``context_fn``."""
        return {"use_reentrant": False, "context_fn": self.context_fn}

    def context_fn(self) -> tuple[_Context, _Context]:
        """One checkpointed call's (forward, recompute) contexts, sharing one frame."""
        frame = _Frame()
        return _Context(self, frame, replay=False), _Context(self, frame, replay=True)

    def _frames(self) -> list[tuple[_Frame, bool]]:
        if not hasattr(self._local, "frames"):
            self._local.frames = []
        return self._local.frames

    # -- the attention function ----------------------------------------------------------------------------

    def _attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        frames = self._frames()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if not frames:
            self.stats.unframed_calls += int(grad)
            return self._inner(module, query, key, value, *args, **kwargs)
        if torch.compiler.is_compiling():
            raise NotImplementedError(f"keep_attention does not run under torch.compile (its recompute is decided "
                                      f"in Python per call), in {_where(module)}: compile without it{rank_suffix()}")
        frame, replay = frames[-1]
        if replay:
            return self._replay(frame, module, query, key, value, args, kwargs)
        return self._record(frame, grad, module, query, key, value, args, kwargs)

    def _record(self, frame: _Frame, grad: bool, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
        """The checkpointed forward's call: run it, keeping what its backward needs (Note [Keeping ...])."""
        if self._fresh or id(module) in self._seen:     # a new forward (Note [Keeping attention's output])
            self._fresh, self._kept, self._seen, self.stats = False, 0, set(), KeepStats()
        self._seen.add(id(module))
        inputs = (query, key, value)
        B, H, L, _ = query.shape                     # out (B, L, H, Dv) in q's dtype, lse (B, H, L) in fp32/fp64
        lse_bytes = 8 if query.dtype == torch.float64 else 4
        estimate = B * L * H * (value.shape[-1] * query.element_size() + lse_bytes)
        keep = grad and (self.keep_bytes is None or self._kept + estimate <= self.keep_bytes)
        slot = _Slot(module, inputs, keep)
        frame.slots.append(slot)
        if not keep:
            self.stats.not_kept_calls += 1
            return self._inner(module, query, key, value, *args, **kwargs)
        with torch.autograd.graph.saved_tensors_hooks(slot.pack, slot.unpack):
            out, weights = self._inner(module, query, key, value, *args, **kwargs)
        slot.finish(out, weights)
        self._kept += slot.bytes
        self.stats.kept_calls += 1
        self.stats.kept_bytes += slot.bytes
        return out, weights

    def _replay(self, frame: _Frame, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any]:
        """The recompute's call: the kept output, no attention (or attention again for a call not kept)."""
        self._fresh = True
        if frame.cursor >= len(frame.slots):
            raise RuntimeError(f"the recompute of a checkpointed layer called attention {frame.cursor + 1} times "
                               f"where its forward called it {len(frame.slots)} times, in {_where(module)}"
                               f"{rank_suffix()}")
        slot = frame.slots[frame.cursor]
        frame.cursor += 1
        inputs = (query, key, value)
        slot.check_same_call(module, inputs)
        if not slot.keep:
            self.stats.recomputed_calls += 1
            return self._inner(module, query, key, value, *args, **kwargs)
        self.stats.replayed_calls += 1
        self.stats.rebuilt_tensors += slot.views
        return slot.replay(inputs), slot.weights


class _Frame:
    """One checkpointed call: the attention calls of its forward, in order, and the recompute's position."""

    def __init__(self):
        self.slots: list[_Slot] = []
        self.cursor = 0


class _Context:
    """Enters a frame on this thread's stack (the recompute runs on autograd's thread, the forward on the
    caller's); the recompute context starts the frame's calls from the first."""

    def __init__(self, keep: KeepAttention, frame: _Frame, replay: bool):
        self.keep, self.frame, self.replay = keep, frame, replay

    def __enter__(self) -> _Context:
        if self.replay:
            self.frame.cursor = 0
        self.keep._frames().append((self.frame, self.replay))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.keep._frames().pop()


@dataclass(frozen=True)
class _FromInput:
    """A saved tensor that is a view of input ``index``'s storage: rebuilt on the recomputed input."""

    slot: _Slot
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Slot:
    """One kept call: what its nodes saved (kept tensors, input views), its output, the recomputed inputs."""

    def __init__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], keep: bool):
        self.module = weakref.ref(module)
        self.keep = keep
        self.meta = [_geometry(t) for t in inputs]
        self._inputs = {_storage(t): i for i, t in reversed(list(enumerate(inputs))) if _storage(t) is not None}
        self._kept: dict[int, weakref.ref | torch.Tensor] = {}       # storage -> a kept tensor on it
        self.bytes = 0
        self.views = 0
        self.out: tuple[Any, tuple, bool] | None = None               # (kept base, geometry, requires_grad)
        self.weights: Any = None
        self.recomputed: tuple[torch.Tensor, ...] | None = None
        self.pending = 0

    def pack(self, t: torch.Tensor) -> Any:
        ptr = _storage(t)
        index = self._inputs.get(ptr) if ptr is not None else None
        if index is not None and t.dtype == self.meta[index][0]:
            self.views += 1
            return _FromInput(self, index, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if isinstance(t, nn.Parameter) or ptr is None:
            return t
        kept = t.detach()                     # no grad_fn: a saved output would otherwise hold its own node
        if ptr not in self._kept:
            self.bytes += t.untyped_storage().nbytes()
        self._kept[ptr] = weakref.ref(kept)
        return kept

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _FromInput):
            return packed
        if self.recomputed is None:
            raise RuntimeError(
                f"the attention call of {_where(self.module())} was not recomputed before its backward: the "
                f"checkpoint's recompute stopped early (nothing after attention in the layer saves a tensor) or ran "
                f"on another thread; disable the early stop (torch.utils.checkpoint.set_checkpoint_early_stop(False))"
                f"{rank_suffix()}")
        t = self.recomputed[packed.index].as_strided(packed.size, packed.stride, packed.offset)
        self.pending -= 1
        if self.pending <= 0:
            self.recomputed = None             # every view rebuilt: the inputs go with the recompute's tensors
        return t

    def finish(self, out: torch.Tensor, weights: Any) -> None:
        """After the forward call: where its output lives (a kept storage, or kept here), and the weights."""
        self._inputs = {}
        self.weights = weights
        ptr = _storage(out)
        base = self._kept.get(ptr) if ptr is not None else None
        if base is None:                       # no node saved the output itself: keep it here
            base = out.detach()
            self.bytes += out.untyped_storage().nbytes()
        self.out = (base, (tuple(out.shape), tuple(out.stride()), out.storage_offset()), out.requires_grad)
        self._kept = {}

    def check_same_call(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        got = [_geometry(t) for t in inputs]
        if module is not self.module() or got != self.meta:
            raise RuntimeError(f"the recompute called attention with other inputs than the forward in "
                               f"{_where(module)}: {_describe(got)} where the forward had {_describe(self.meta)}"
                               f"{rank_suffix()}")

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.recomputed = tuple(t.detach() for t in inputs) if self.views else None
        self.pending = self.views
        assert self.out is not None
        base, (size, stride, offset), requires_grad = self.out
        kept = base() if isinstance(base, weakref.ref) else base
        if kept is None:
            raise RuntimeError(f"the kept output of {_where(self.module())} was freed before the recompute: its "
                               f"backward already ran (backward twice needs retain_graph=True){rank_suffix()}")
        return kept.as_strided(size, stride, offset).detach().requires_grad_(requires_grad)


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage, None where there is none to compare (empty, or no plain storage)."""
    try:
        if not t.numel():
            return None
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device)


def _describe(meta: list[tuple[Any, ...]]) -> str:
    return ", ".join(f"{str(m[0]).replace('torch.', '')}{list(m[1])}" for m in meta)


def _where(module: nn.Module | None) -> str:
    return f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"

