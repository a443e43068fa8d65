"""Training memory for long sequences in transformers models: a blockwise (tiled) MLP and activation offload.

    from seqpar.integrations import hf_memory

    tiling = hf_memory.tile_mlp(model, chunk_tokens=8192)   # every decoder layer's MLP over 8K-token chunks
    hf_memory.tile_norms(model, chunk_tokens=8192)           # and every hidden-size RMSNorm
    offload = hf_memory.ActivationOffload()                  # saved activations to pinned host memory
    with offload:
        loss = model(**batch).loss                           # (or seqpar's tiled loss on the hidden states)
    loss.backward()

Once attention is sharded over W ranks, what a rank holds per local token of a Llama-3-8B shape is the logits
(the tiled loss in ``huggingface.sequence_parallel_loss`` fixes those), one ``(L, hidden)`` checkpointed input
per decoder layer (32 x 8 KiB: ``ActivationOffload``), one layer's MLP intermediates, ``(L, intermediate)``
three times over (``tile_mlp``), and its RMSNorms' fp32 copies of the hidden states (``tile_norms``). None
changes a value: ``tile_mlp`` and ``tile_norms`` give the same forward bitwise and the same gradients up to the
order of one sum (Note [Tiled MLP], Note [Tiled norms]); offload returns the tensors it was given (Note [Activation
offload]). ``tests/test_hf_memory.py`` checks them at W = 1, 2 and 4.

The other way round, memory for time: ``keep_attention(handle)`` (``seqpar.integrations.hf_selective``, re-exported
here) keeps each checkpointed layer's attention output and lse on the GPU so that the recompute in backward runs
everything but attention (Note [Keeping attention's output]): at 1M tokens over 8 ranks the recompute of attention
is about a quarter of an 8B step, and the outputs cost 1 GiB + 16 MiB per layer per 128K local tokens.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import rank_suffix
from .hf_selective import KeepAttention, KeepStats, keep_attention

__all__ = ["ActivationOffload", "KeepAttention", "KeepStats", "OffloadStats", "Tiling", "keep_attention", "tile_mlp",
           "tile_norms"]

GATED_MLP = ("gate_proj", "up_proj", "down_proj", "act_fn")
"""The attributes of the MLPs ``tile_mlp`` serves: Llama, Qwen2/3, Mistral, Gemma/Gemma2/Gemma3 (``down(act(gate(x))
* up(x))``, each token on its own)."""


# --------------------------------------------------------------------------------------------------------------
# tiled MLP

# Note [Tiled MLP]
#     A gated MLP maps each token on its own: out[t] = down(act(gate(x[t])) * up(x[t])). Over L tokens it holds
#     three (L, intermediate) tensors (gate, up, their product; 3.5 GiB each for 8B at 128K tokens in bf16),
#     saved for backward. _TiledRows runs the module's own forward over chunks of rows instead:
#       forward   no graph; each chunk's output is written into the (L, hidden) result; only x is saved;
#       backward  per chunk: recompute the chunk with a graph, autograd.grad for (x chunk, parameters), write
#                 dx rows, add the parameter gradients into an fp32 sum (the parameter's dtype when wider).
#     So one chunk's intermediates exist at a time, forward and backward, at the cost of one more forward of
#     the MLP (a checkpointed layer already recomputes it once).
#     Exactness: the forward and dx are row-chunked matmuls, row-independent, so they equal the plain MLP's
#     bitwise where the matmul's reduction order does not depend on the row count (it does not on CPU, tested
#     in fp32 and fp64). Parameter gradients are the plain sum over all rows split into one partial per chunk:
#     equal up to summation order (fp64 ~1e-15, fp32 ~1e-6 relative), and in bf16 one extra rounding per chunk
#     sum, accumulated in fp32.
#     The module is recomputed from its attributes at backward time (not from tensors saved in forward), so
#     FSDP2, which unshards the layer's parameters again before its backward, sees the parameters it expects.


# Note [Tiled norms]
#     transformers' RMSNorm (Llama, Qwen, Mistral; Gemma's differs only in the weight's ``1 +``) upcasts its input
#     to fp32 and autograd saves that upcast (16 KiB per token at hidden 4096) plus the bf16 normalised rows for the
#     weight's gradient (8 KiB); its backward then makes about five more fp32 (L, hidden) tensors at once. Measured
#     on rank 0 of 8 (Llama-3-8B shape, 128K local tokens, tiled MLP, offload; benchmarks/gpu/probe_train_memory.py,
#     benchmarks/results/2026-11-26-h100-train-memory/): the step's peak fell inside post_attention_layernorm's
#     backward, with both norms' saved upcasts (4 GiB) and five 2 GiB fp32 temporaries live - 112 of the 161 KiB
#     per local token the step's peak grows by. A norm maps each row on its own, so it tiles as the MLP does
#     (_TiledRows): it saves only its input (the layer's input or residual, bf16) and recomputes one chunk's fp32
#     work at a time in backward. The forward is the module's own on row chunks; dx is per row; the weight's
#     gradient is summed as one fp32 partial per chunk (the plain backward sums all rows in one reduction: equal
#     up to that order). The final norm sits outside the checkpointed layers, so what it saves goes through the
#     offload to the host: tiled, that is 8 KiB per token instead of 24.

@dataclass
class Tiling:
    """What ``tile_mlp`` or ``tile_norms`` changed: ``remove()`` restores every tiled module's own forward."""

    chunk_tokens: int
    modules: dict[str, nn.Module] = field(default_factory=dict)
    """Qualified name -> the tiled module (an MLP or an RMSNorm)."""

    def remove(self) -> None:
        for m in self.modules.values():
            if isinstance(m.__dict__.get("forward"), _TiledForward):
                del m.forward
        self.modules.clear()


def tile_mlp(model: nn.Module, chunk_tokens: int = 8192, *, layers: Iterable[nn.Module] | None = None) -> Tiling:
    """Run each decoder layer's MLP over chunks of ``chunk_tokens`` tokens with recompute (Note [Tiled MLP]).

    Enables it for every module with an ``mlp`` child (or the given ``layers``): that child must be a gated MLP
    (``gate_proj``, ``up_proj``, ``down_proj`` linear layers and ``act_fn``: Llama, Qwen2/3, Mistral, Gemma 1-3);
    anything else (experts, GPT-2's ``c_fc``, a vision tower's MLP) is refused, every such layer named. Works
    under activation checkpointing, FSDP2 and torch.autocast; values are unchanged.

    Args:
        model: a transformers model (or any module tree); only its MLPs' ``forward`` are replaced, per instance.
        chunk_tokens: rows (batch x sequence tokens) per chunk: one chunk's ``(chunk_tokens, intermediate)``
            activations exist at a time.
        layers: the decoder layers whose ``mlp`` to tile (default: every module of ``model`` with an ``mlp``),
            e.g. ``model.model.language_model.layers`` for a multimodal model.

    Returns:
        A ``Tiling``; ``tiling.remove()`` puts the plain MLPs back.
    """
    _check_chunk(chunk_tokens)
    names = {id(m): n for n, m in model.named_modules()}
    owners = list(layers) if layers is not None else [m for m in model.modules()
                                                      if isinstance(getattr(m, "mlp", None), nn.Module)]
    if not owners:
        raise ValueError(f"tile_mlp found no module with an 'mlp' child in {type(model).__name__}{rank_suffix()}")
    refused = []
    for layer in owners:
        mlp = getattr(layer, "mlp", None)
        missing = [a for a in GATED_MLP if not hasattr(mlp, a)]
        if not missing and not all(isinstance(getattr(mlp, a), nn.Linear) for a in GATED_MLP[:3]):
            missing = [a for a in GATED_MLP[:3] if not isinstance(getattr(mlp, a), nn.Linear)]
        if missing:
            refused.append(f"{names.get(id(layer), '?')}.mlp ({type(mlp).__name__}: no {', '.join(missing)})")
    if refused:
        raise ValueError("tile_mlp serves gated MLPs (gate_proj, up_proj, down_proj linear layers and act_fn: "
                         "Llama, Qwen2/3, Mistral, Gemma), got " + "; ".join(refused)
                         + " - pass layers= to tile some layers only" + rank_suffix())
    tiling = Tiling(chunk_tokens)
    for layer in owners:
        mlp = layer.mlp
        mlp.forward = _TiledForward(mlp, chunk_tokens)        # an instance attribute: the class is untouched
        tiling.modules[f"{names.get(id(layer), '?')}.mlp"] = mlp
    return tiling


def tile_norms(model: nn.Module, chunk_tokens: int = 8192, *, modules: Iterable[nn.Module] | None = None) -> Tiling:
    """Run each hidden-size RMSNorm over chunks of ``chunk_tokens`` rows with recompute (Note [Tiled norms]).

    Enables it for every module whose class name ends in ``RMSNorm`` and whose weight has the model's hidden size
    (``model.config.hidden_size``, or its ``text_config``'s; every RMSNorm when there is none): the decoder layers'
    norms and the final one of Llama, Qwen2/3, Mistral and Gemma 1-3, not Qwen3's or Gemma 3's per-head q/k norms.
    Values are unchanged: the forward is the module's own, chunk by chunk; the input gradient is per row; the
    weight's gradient is one fp32 partial per chunk. Works under activation checkpointing, FSDP2 and
    torch.autocast.

    Args:
        model: a transformers model (or any module tree); only the norms' ``forward`` are replaced, per instance.
        chunk_tokens: rows (batch x sequence tokens) per chunk: one chunk's fp32 intermediates exist at a time.
        modules: the norms to tile (default: as above); each must be an RMSNorm (a row-wise map of the last dim).

    Returns:
        A ``Tiling``; ``tiling.remove()`` puts the plain norms back.
    """
    _check_chunk(chunk_tokens)
    names = {id(m): n for n, m in model.named_modules()}
    if modules is None:
        cfg = getattr(model, "config", None)
        hidden = getattr(cfg, "hidden_size", None) or getattr(getattr(cfg, "text_config", None), "hidden_size", None)
        norms = [m for m in model.modules() if _is_rms_norm(m)
                 and (hidden is None or tuple(m.weight.shape[-1:]) == (hidden,))]
        if not norms:
            raise ValueError(f"tile_norms found no RMSNorm of the hidden size in {type(model).__name__}"
                             f"{rank_suffix()}")
    else:
        norms = list(modules)
        refused = [f"{names.get(id(m), '?')} ({type(m).__name__})" for m in norms if not _is_rms_norm(m)]
        if refused or not norms:
            raise ValueError("tile_norms serves RMSNorm modules (a row-wise map of the last dimension with a weight),"
                             f" got {'; '.join(refused) or 'none'}{rank_suffix()}")
    tiling = Tiling(chunk_tokens)
    for m in norms:
        m.forward = _TiledForward(m, chunk_tokens)
        tiling.modules[names.get(id(m), "?")] = m
    return tiling


def _is_rms_norm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)


def _check_chunk(chunk_tokens: Any) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}{rank_suffix()}")


class _TiledForward:
    """The instance ``forward`` of a tiled module (a strong reference: ``copy.deepcopy`` of the model then tiles
    the copy, not the original)."""

    def __init__(self, module: nn.Module, chunk_tokens: int):
        self.module = module
        self.chunk_tokens = chunk_tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        named = list(module.named_parameters())
        params = tuple(p for _, p in named)
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _TiledRows.apply(module, self.chunk_tokens, tuple(n for n, _ in named), x, *params)
        return _chunked(type(module).forward, module, x, self.chunk_tokens)


def _chunked(fn: Any, module: nn.Module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``fn(module, rows)`` over chunks of rows of ``x (..., C)`` written into one ``(..., C_out)`` result."""
    rows = x.reshape(-1, x.shape[-1])
    out = None
    for s in range(0, rows.shape[0], chunk):
        y = fn(module, rows[s:s + chunk])
        if out is None:
            out = y.new_empty((rows.shape[0], y.shape[-1]))
        out[s:s + chunk] = y
    if out is None:                                   # zero rows: let the module say what it returns
        return fn(module, x)
    return out.view(*x.shape[:-1], out.shape[-1])


class _TiledRows(torch.autograd.Function):
    """Note [Tiled MLP], Note [Tiled norms]: inputs ``(module, chunk, parameter names, x, *parameters)``; the
    module maps each row of ``x`` on its own."""

    @staticmethod
    def forward(ctx: Any, module: nn.Module, chunk: int, names: tuple[str, ...], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        ctx.module, ctx.chunk, ctx.names = module, chunk, names
        ctx.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)) \
            if torch.amp.is_autocast_available(device_type) else None
        ctx.save_for_backward(x)
        return _chunked(type(module).forward, module, x, chunk)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        module, chunk = ctx.module, ctx.chunk
        current = dict(module.named_parameters())
        params = [current[n] for n in ctx.names]
        want = [i for i, p in enumerate(params) if ctx.needs_input_grad[4 + i] and p.requires_grad]
        rows, drows = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
        dx = torch.empty_like(rows) if ctx.needs_input_grad[3] else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        autocast = (torch.autocast(x.device.type, enabled=ctx.autocast[0], dtype=ctx.autocast[1])
                    if ctx.autocast is not None else contextlib.nullcontext())
        for s in range(0, rows.shape[0], chunk):
            xc = rows[s:s + chunk].detach().requires_grad_(dx is not None)
            with torch.enable_grad(), autocast:
                yc = type(module).forward(module, xc)
            inputs = ([xc] if dx is not None else []) + [params[i] for i in want]
            if not inputs:
                break
            grads = torch.autograd.grad(yc, inputs, drows[s:s + chunk])
            if dx is not None:
                dx[s:s + chunk] = grads[0]
                grads = grads[1:]
            for i, g in zip(want, grads):
                if sums[i] is None:                   # a fresh tensor: summed into in place
                    sums[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                else:
                    sums[i].add_(g)
            del yc, grads
        pgrads = [None if g is None else g.to(p.dtype) for g, p in zip(sums, params)]
        return (None, None, None, None if dx is None else dx.view_as(x), *pgrads)


# --------------------------------------------------------------------------------------------------------------
# activation offload

# Note [Activation offload]
#     With activation checkpointing each decoder layer keeps only its input until backward (8 KiB per token
#     per layer for an 8B model: 32 GiB at 128K tokens). torch.utils.checkpoint (use_reentrant=False) saves
#     that input through the saved-tensor hooks in force OUTSIDE the checkpoint (the ones inside are its own),
#     so a ``saved_tensors_hooks`` context around the forward sees exactly the layer inputs plus what the
#     un-checkpointed parts save (the final norm, the tiled loss's chunk inputs). torch's ``save_on_cpu``
#     does this, but copies on the compute stream (the GPU stops while PCIe moves gigabytes), offloads every
#     tensor, and its pinned buffers come from the caching host allocator, which rounds each up to a power of
#     two. ActivationOffload keeps the mechanism and changes those three:
#       - copies run on two side streams: device->host after the tensor is produced, host->device when
#         backward unpacks the NEXT tensor in backward order (prefetch: ready when the layer's recompute
#         starts); the order of every copy against the compute stream is Note [Offload stream order];
#       - a budget: ``keep_bytes`` of saved tensors stay on the GPU (the first ones saved), from the GPU's
#         free memory at entry minus ``reserve_bytes`` (what the rest of the step needs) when not given;
#         parameters and tensors under ``min_bytes`` always stay; host memory has its own budget
#         (``host_bytes``, default: MemAvailable at first use minus 4 GiB), past which tensors stay too and
#         ``stats.host_refused_bytes`` says so;
#       - pinned buffers of the size asked, in whole pages (cudaHostRegister on plain host memory), kept for
#         the next step;
#       - a tensor saved twice in one forward (RMSNorm saves its fp32 input for two ops) is copied once.
#     CPU tensors pass through untouched, so on CPU the context changes nothing (and the tests check that
#     values are equal bitwise with and without it).

# Note [Offload stream order]
#     Three streams meet: C, the stream current when a tensor is saved or used (queried at each call, never
#     cached: backward runs on autograd's device thread, under each node's forward stream), and the side
#     streams d2h and h2d. The caching allocator only orders a block's reuse on the stream it was allocated
#     on; every other stream that touches it must be ordered by hand. The rules, each for one hazard:
#       pack (t made on C)    d2h.wait_stream(C)         the copy reads t after its producer wrote it
#                             d2h.wait_event(buf.last)   the pinned buffer's previous copy (the H2D of an
#                                                        earlier step that read it) is done before it is
#                                                        overwritten
#                             copy host <- t on d2h; saved, buf.last = an event after it
#                             t.record_stream(d2h)       t's block is not reused before the copy read it
#       fetch (A current)     gpu = empty on A
#                             h2d.wait_stream(A)         the block was free on A, so kernels A queued before
#                                                        may still read or write it: the copy waits for them
#                                                        (without this wait the copy races them: garbage)
#                             h2d.wait_event(saved)      the host copy is complete
#                             copy gpu <- host on h2d; ready, buf.last = an event after it
#                             gpu.record_stream(h2d)     gpu's block is not reused before the copy wrote it
#       take (B current)      B.wait_event(ready)        every unpack, prefetched or not, waits for its copy
#                             gpu.record_stream(B)       B may differ from A (a prefetch at the end of the
#                                                        forward, on the main thread); a no-op when equal
#       release of a buffer   buf.last.synchronize()     no copy reads or writes host memory unregistered
#     The pinned buffer goes back to the pool only when its item is garbage (its last unpack is done and
#     autograd dropped it); the next write into it waits for buf.last, the last copy of either direction.
#     ``verify=True`` (a debug mode; it doubles the saved tensors' GPU memory) keeps a device copy of each
#     offloaded tensor and compares each restored tensor with it, bitwise, on B after the wait: ``verify()``
#     then says how many came back different - the CUDA path's own check (benchmarks/gpu/train_8b.py).


@dataclass
class OffloadStats:
    """What one ``with offload:`` forward did (reset at each entry)."""

    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    kept_bytes: int = 0
    """Saved tensors of at least ``min_bytes`` left on their device (budget, or a CPU tensor)."""
    host_refused_bytes: int = 0
    """Tensors that would have been offloaded but the host budget was spent (left on the GPU)."""
    keep_budget_bytes: int = 0
    fetches: int = 0
    """Host->device copies posted (prefetched or not)."""
    waited_fetches: int = 0
    """Backward unpacks whose copy had not been prefetched (posted at the unpack itself). Every unpack, this one
    or a prefetched one, makes the current stream wait for its copy (Note [Offload stream order])."""
    pin_s: float = 0.0
    """Seconds spent pinning new host buffers (first steps only; buffers are reused)."""
    host_pinned_bytes: int = 0
    """Pinned host bytes held by this offloader (in use or cached for the next step)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ActivationOffload:
    """Saved activations in pinned host memory, copies overlapped with compute (Note [Activation offload]).

    Use it as a context around the forward; backward needs nothing::

        offload = ActivationOffload()                 # or keep_bytes=..., or reserve_bytes=...
        with offload:
            loss = model(**batch).loss
        loss.backward()
        offload.stats                                 # what was moved

    Args:
        keep_bytes: bytes of saved tensors that may stay on the GPU (the first saved stay). Default: from the
            GPU's free memory at entry (driver-free plus the caching allocator's unused blocks) minus
            ``reserve_bytes``; with neither given, 0 (offload everything eligible).
        reserve_bytes: GPU memory the rest of the step needs beyond the kept tensors (the backward's working
            set, gradients, the optimizer step); used when ``keep_bytes`` is None.
        host_bytes: pinned host memory this offloader may hold. Default: MemAvailable at first use - 4 GiB.
        min_bytes: smaller tensors stay where they are (not worth a copy).
        prefetch: saved tensors brought back ahead of use in backward (1: the next one).
        verify: debug mode: keep a device copy of every offloaded tensor and compare what comes back with it
            (``verify()``); doubles the saved tensors' device memory.
    """

    def __init__(self, *, keep_bytes: int | None = None, reserve_bytes: int | None = None,
                 host_bytes: int | None = None, min_bytes: int = 1 << 20, prefetch: int = 1,
                 verify: bool = False):
        for name, v in (("keep_bytes", keep_bytes), ("reserve_bytes", reserve_bytes), ("host_bytes", host_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {v!r}{rank_suffix()}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative int, got {prefetch!r}{rank_suffix()}")
        self.keep_bytes, self.reserve_bytes, self.host_bytes = keep_bytes, reserve_bytes, host_bytes
        self.min_bytes, self.prefetch, self.verify_copies = int(min_bytes), prefetch, bool(verify)
        self.stats = OffloadStats()
        self._ops: Any = _CudaOps()
        self._pool = _PinnedPool()
        self._hooks: Any = None
        self._items: list[weakref.ref] = []
        self._seen: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self._streams: dict[torch.device, tuple[Any, Any]] = {}
        self._checks: list[tuple[int, tuple[int, ...], torch.dtype, torch.Tensor]] = []
        self._kept = 0
        self._budget = 0
        self._lock = threading.RLock()

    # -- the context ---------------------------------------------------------------------------------------

    def __enter__(self) -> ActivationOffload:
        if self._hooks is not None:
            raise RuntimeError(f"ActivationOffload is already active (one forward at a time){rank_suffix()}")
        if self._pool.budget is None:
            self._pool.budget = self.host_bytes if self.host_bytes is not None else _host_available() - (4 << 30)
        self.stats = OffloadStats(host_pinned_bytes=self._pool.held)
        self._items, self._seen, self._checks = [], {}, []
        self._kept = 0
        self._budget = self._keep_budget()
        self.stats.keep_budget_bytes = self._budget
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)
        self._seen = {}
        if exc[0] is None:
            with self._lock:
                self._prefetch_before(len(self._items))   # the first tensors backward asks for
        self.stats.host_pinned_bytes = self._pool.held

    def close(self) -> None:
        """Release the pinned host buffers kept for later steps (those still in use go when they are freed)."""
        self._pool.close()

    def verify(self) -> dict[str, Any]:
        """With ``verify=True``, after backward: the restored tensors compared bitwise with the saved ones
        (``checked`` unpacks, ``mismatched`` of them, the first few as ``(position, shape, dtype, bytes that
        differ)``). Synchronizes."""
        with self._lock:
            checks = list(self._checks)
        bad = []
        for pos, shape, dtype, diff in checks:
            n = int(diff)
            if n:
                bad.append((pos, list(shape), str(dtype).replace("torch.", ""), n))
        return {"checked": len(checks), "mismatched": len(bad), "first_mismatches": bad[:8]}

    def _keep_budget(self) -> int:
        if self.keep_bytes is not None:
            return self.keep_bytes
        if self.reserve_bytes is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return 0
        free, _ = torch.cuda.mem_get_info()
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        return max(0, free - self.reserve_bytes)

    # -- hooks ---------------------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes == 0 or nbytes < self.min_bytes or isinstance(t, nn.Parameter) or t.layout != torch.strided:
            return _kept(t)
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version and seen[2]() is not None:
            item = seen[2]()                           # the same tensor saved again (RMSNorm's fp32 input): one copy
            with self._lock:
                item.pending += 1
            return self._ref(item)
        if not self._ops.offloadable(t) or not t.is_contiguous() or self._kept + nbytes <= self._budget:
            self._kept += nbytes
            self.stats.kept_bytes += nbytes
            return _kept(t)
        t0 = time.perf_counter()
        buf = self._pool.take(nbytes)
        self.stats.pin_s += time.perf_counter() - t0
        if buf is None:                                # host budget spent: it stays on the GPU
            self.stats.host_refused_bytes += nbytes
            return _kept(t)
        item = _Offloaded(self._ops, t, buf, self._stream_pair(t.device)[0], self.verify_copies)
        weakref.finalize(item, self._pool.give, buf)
        self._seen[id(t)] = (weakref.ref(t), t._version, weakref.ref(item))
        self.stats.offloaded_bytes += nbytes
        self.stats.offloaded_tensors += 1
        return self._ref(item)

    def _ref(self, item: _Offloaded) -> _Ref:
        self._items.append(weakref.ref(item))
        return _Ref(item, len(self._items) - 1)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Ref):
            return packed
        item = packed.item
        with self._lock:
            if item.gpu is None:
                self.stats.waited_fetches += 1
                self._fetch(item)
            gpu = item.take()                          # the current stream waits for the copy
            if item.check is not None:
                diff = self._ops.differ(gpu, item.check, self._ops.current_stream(item.device))
                self._checks.append((packed.position, tuple(item.shape), item.dtype, diff))
            self._prefetch_before(packed.position)
        return gpu

    def _fetch(self, item: _Offloaded) -> None:
        item.fetch(self._stream_pair(item.device)[1])
        self.stats.fetches += 1

    def _prefetch_before(self, position: int) -> None:
        """Start the host->device copies of the ``prefetch`` saved tensors packed before ``position`` (backward
        unpacks in about the reverse order of packing) that are still to be unpacked and not on the GPU."""
        started = 0
        for j in range(position - 1, -1, -1):
            if started >= self.prefetch:
                break
            item = self._items[j]()
            if item is None or item.pending == 0 or item.gpu is not None:
                continue
            self._fetch(item)
            started += 1

    def _stream_pair(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (self._ops.new_stream(device), self._ops.new_stream(device))
        return self._streams[device]


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor left where it is, packed without its autograd history (Note [Packed without history])."""
    return t if t.grad_fn is None else t.detach()


# Note [Packed without history]
#     An op that saves its own output (rsqrt in RMSNorm, exp, tanh) hands the pack hook a tensor whose grad_fn
#     is the node saving it. Packed as is, the node holds the tensor and the tensor its node: a cycle through
#     C++ that Python's collector cannot see, broken only when backward releases the saved tensors. A forward
#     that gets no backward (the recipe's warm-up, an evaluation with grad on) then keeps its whole graph alive,
#     with every pinned buffer and GPU tensor it saved: the 8B recipe's step re-pinned 36 GiB (host peak 72
#     GiB) because the warm-up's graph still held its buffers. ``detach()`` shares the storage and drops the
#     history, so the cycle never forms (autograd runs no version check on hooked saves either way: measured,
#     an in-place change of a saved output goes unflagged whether the hook returns the tensor or its detach).


class _CudaOps:
    """The CUDA calls of the offload path, in one place (the CPU tests put a stream-order checker here)."""

    @staticmethod
    def offloadable(t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    @staticmethod
    def current_stream(device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    @staticmethod
    def new_stream(device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    @staticmethod
    def new_event() -> Any:
        return torch.cuda.Event()

    @staticmethod
    def empty(shape: torch.Size, dtype: torch.dtype, device: torch.device, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(shape, dtype=dtype, device=device)

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    @staticmethod
    def clone(t: torch.Tensor, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return t.detach().clone()

    @staticmethod
    def differ(a: torch.Tensor, b: torch.Tensor, stream: Any) -> torch.Tensor:
        """Bytes where ``a`` and ``b`` differ (a device scalar, computed on ``stream``)."""
        b.record_stream(stream)
        with torch.cuda.stream(stream):
            return _byte_diff(a, b)

    @staticmethod
    def record_stream(t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)


def _byte_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum()


@dataclass(frozen=True)
class _Ref:
    """What one pack returns: the offloaded tensor and the position of this save in packing order."""

    item: _Offloaded
    position: int


class _Offloaded:
    """One saved tensor in pinned host memory; ``gpu`` holds it again between fetch and take (Note [Offload
    stream order])."""

    def __init__(self, ops: Any, t: torch.Tensor, buf: _Pinned, d2h: Any, verify: bool):
        self.ops = ops
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.buf = buf
        self.host = buf.tensor[:t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        self.gpu: torch.Tensor | None = None
        self.ready: Any = None
        self.pending = 1
        """Saves of it not yet unpacked."""
        compute = ops.current_stream(t.device)
        self.check = ops.clone(t, compute) if verify else None
        d2h.wait_stream(compute)                       # t is written
        if buf.last is not None:
            d2h.wait_event(buf.last)                   # the buffer's previous copy is done
        ops.copy(self.host, t, d2h)
        self.saved = ops.new_event()
        self.saved.record(d2h)
        buf.last = self.saved
        ops.record_stream(t, d2h)                      # t's block is not reused before the copy has read it

    def fetch(self, h2d: Any) -> None:
        """Post the host->device copy on ``h2d`` into a tensor of the current stream."""
        alloc = self.ops.current_stream(self.device)
        gpu = self.ops.empty(self.shape, self.dtype, self.device, alloc)
        h2d.wait_stream(alloc)                         # the block's earlier users on ``alloc`` are done
        h2d.wait_event(self.saved)                     # the host copy is complete
        self.ops.copy(gpu, self.host, h2d)
        self.ready = self.ops.new_event()
        self.ready.record(h2d)
        self.buf.last = self.ready
        self.ops.record_stream(gpu, h2d)               # gpu's block is not reused before the copy wrote it
        self.gpu = gpu

    def take(self) -> torch.Tensor:
        """The restored tensor, the current stream ordered after its copy."""
        gpu, self.gpu = self.gpu, None
        assert gpu is not None and self.ready is not None
        current = self.ops.current_stream(self.device)
        current.wait_event(self.ready)
        self.ops.record_stream(gpu, current)           # used here, allocated where the fetch ran
        self.pending = max(0, self.pending - 1)
        return gpu


@dataclass
class _Pinned:
    tensor: torch.Tensor
    """uint8, pinned, page-aligned, ``size`` bytes."""
    size: int
    registered: bool
    last: Any = None
    """An event after the last copy (either direction) that used it."""

    @property
    def footprint(self) -> int:
        """Host bytes it holds: ``size`` registered; the next power of two from the caching host allocator."""
        return self.size if self.registered else 1 << max(0, self.size - 1).bit_length()


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _PinnedPool:
    """Pinned host buffers (sizes rounded up to whole pages), reused across steps, within a byte budget.
    ``give`` runs from a finalizer, possibly on autograd's device thread: a lock orders it with ``take``."""

    def __init__(self):
        self.free: dict[int, list[_Pinned]] = {}
        self.held = 0
        self.budget: int | None = None
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> _Pinned | None:
        size = -(-nbytes // PAGE) * PAGE
        with self._lock:
            if self.free.get(size):
                return self.free[size].pop()
            while self.held + size > (self.budget or 0) and self._evict_one():
                pass
            if self.held + size > (self.budget or 0):
                return None
            buf = _pin(size)
            if buf is not None and self.held + buf.footprint > (self.budget or 0):
                return None                               # the fallback's power of two does not fit: dropped
            if buf is not None:
                self.held += buf.footprint
            return buf

    def give(self, buf: _Pinned) -> None:
        with self._lock:
            self.free.setdefault(buf.size, []).append(buf)

    def _evict_one(self) -> bool:
        for bufs in self.free.values():
            if bufs:
                self._release(bufs.pop())
                return True
        return False

    def _release(self, buf: _Pinned) -> None:
        if buf.last is not None:
            buf.last.synchronize()                 # no copy of either direction still uses it
        if buf.registered:
            torch.cuda.cudart().cudaHostUnregister(buf.tensor.data_ptr())
        self.held -= buf.footprint

    def close(self) -> None:
        with self._lock:
            for bufs in self.free.values():
                for buf in bufs:
                    self._release(buf)
            self.free.clear()


def _pin(size: int) -> _Pinned | None:
    """``size`` (a whole number of pages) bytes of pinned host memory; None when the host has none to give.

    Plain host memory registered with CUDA (what torch.distributed.checkpoint's stager does), page-aligned
    inside its own allocation so no two registrations share a page; the caching host allocator (which rounds
    to a power of two) only where registering fails.

    Note [Registered is pinned]: cudaHostRegister's success is the test. Up to 2026-11-26 this also asked
    ``t.is_pinned()``, which is False for registered memory on torch 2.11 (measured on the H100 machine: rc 0,
    is_pinned False at every size), so every buffer came from the caching host allocator: a 2.25 GiB layer input
    (Llama-3-8B, 295K local tokens) took 4 GiB of host memory, and the recipe's 2.36M-token try was killed by the
    host's OOM killer with 82 GiB asked of a 126 GiB host."""
    try:
        raw = torch.empty(size + PAGE, dtype=torch.uint8)
    except RuntimeError:
        return None
    skip = -raw.data_ptr() % PAGE
    t = raw[skip:skip + size]
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(t.data_ptr(), size, 1)) == 0:      # 1: cudaHostRegisterPortable
        return _Pinned(t, size, True)
    _clear_cuda_error()
    del raw, t
    try:
        return _Pinned(torch.empty(size, dtype=torch.uint8, pin_memory=True), size, False)
    except RuntimeError:                        # torch's check has cleared the CUDA error
        return None


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed cudaHostRegister (torch's binding leaves it set, and
    the next kernel launch check would raise it): cudaGetLastError from the loaded libcudart, best effort."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            path = next(line.split()[-1] for line in f if "libcudart" in line.split()[-1])
        ctypes.CDLL(path).cudaGetLastError()
    except (OSError, StopIteration, AttributeError, IndexError):
        pass


def _host_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (total physical memory where that file is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
