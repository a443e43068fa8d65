"""ring-flash-attn's HuggingFace adapter names on seqpar: ``substitute_hf_flash_attn`` and
``update_ring_flash_attn_params``, with ring-flash-attn's semantics.

ring-flash-attn's training flow, unchanged but for the import (and the name ``substitute_hf_flash_attn``
returns, where flash-attn is not installed)::

    name = seqpar.substitute_hf_flash_attn(group, heads_k_stride=1)    # once
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    for batch in loader:                          # packed documents: input_ids (1, S), per-document position_ids
        seqpar.update_ring_flash_attn_params(cu_seqlens, group)         # GLOBAL boundaries, every step
        ids = batch["input_ids"].chunk(world, dim=1)[rank]              # torch.chunk sharding: contiguous
        pos = batch["position_ids"].chunk(world, dim=1)[rank]
        loss = loss_fn(model(input_ids=ids, position_ids=pos).logits, ...)

Note [Which method serves ring-flash-attn's HF flow]
    The flow fixes the layout (``torch.chunk``: contiguous) and the documents (global ``cu_seqlens``, shared by
    the batch rows). ring-flash-attn runs its llama3 all-gather there, and so does this adapter:
    ``seqpar.attention(method="allgather", layout="contiguous", cu_seqlens=<global>, heads_k_stride=...)``.
    ``heads_k_stride`` keeps its meaning (KV heads gathered per round: the memory bound), the traffic is what
    ring-flash-attn's users measured, and each local document piece is one bottom-right kernel call against
    one gathered key span. The pass-KV ring on the same layout would move the same bytes in W-1 dependent
    steps with per-step merges, and would leave ``heads_k_stride`` without a meaning. Causal imbalance comes
    from the contiguous layout and is the same for both; ``seqpar.integrations.huggingface`` (zigzag, USP,
    any method) is the way out of it.

Note [What the substituted attention honours]
    Unlike ring-flash-attn's adapter: causal and non-causal modules, ``scaling``, sliding windows (in global
    positions: HF's ``sliding_window=w`` is flash-attn's ``(w - 1, 0)``), GQA and any batch size (the rows
    share the documents) are honoured; an attention mask with padding, dropout, softcapping, attention sinks
    and a KV cache with past tokens raise; ``position_ids`` must be this rank's global positions or positions
    within the documents given to ``update_ring_flash_attn_params`` (checked once per forward, so a step
    that forgot to update the documents raises instead of computing the previous batch's masks).

Note [Registry, not patch]
    ``substitute_hf_flash_attn`` uses transformers' public ``AttentionInterface.register`` (and
    ``AttentionMaskInterface.register``); no private transformers function is replaced, so transformers
    releases do not break it (ring-flash-attn's adapter patches ``_flash_attention_forward`` and broke on
    4.47 and 4.53). Where the flash-attn package is installed, the entry ``"flash_attention_2"`` is itself
    re-registered, so models loaded with ``attn_implementation="flash_attention_2"`` run seqpar as they run
    ring-flash-attn; that replaces transformers' FA2 function in this process (``name=`` picks another entry).
    Elsewhere (CPU, or GPUs without flash-attn, where transformers refuses "flash_attention_2") the adapter
    registers ``"seqpar_ring_attn"`` and returns that name (transformers takes any name containing "flash" for a
    flash-attention kernel to load).

State: ring-flash-attn's API is stateful (the boundaries are set per step, outside the model); the boundaries
are kept per process group in this module, read on the host once per update. The attention function is
excluded from torch.compile tracing (one graph break per attention call), as in ``integrations.huggingface``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..api import attention
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from .huggingface import _BENIGN, _REFUSED, _UNSET, _eager, _short, _window

__all__ = ["substitute_hf_flash_attn", "update_ring_flash_attn_params"]

FALLBACK_NAME = "seqpar_ring_attn"        # transformers treats any name containing "flash" as a flash kernel
_DOCUMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # group -> this step's global boundaries (weak)
_UNDERSTOOD = _BENIGN | {"is_causal"}       # cu_seq_lens_q/_k are checked against the current boundaries


def _group_key(process_group: Any) -> Any:
    return dist.group.WORLD if process_group is None else process_group


def _host(cu: Any) -> tuple[int, ...]:
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.is_floating_point():
            raise TypeError(f"cu_seqlens must be a 1D integer tensor, got {cu.dtype} of shape {tuple(cu.shape)}"
                            f"{rank_suffix()}")
        return tuple(int(x) for x in cu.tolist())
    if not isinstance(cu, Sequence):
        raise TypeError(f"cu_seqlens must be a 1D integer tensor or a sequence of ints, got {type(cu).__name__}"
                        f"{rank_suffix()}")
    return tuple(int(x) for x in cu)


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor | Sequence[int], process_group: Any = None) -> None:
    """Set the documents of the next forward(s) on ``process_group``: ring-flash-attn's per-step call.

    Args:
        cu_seqlens: GLOBAL document boundaries of the packed batch (int32, 0 first, the global length last),
            the same on every rank; the ranks hold its ``torch.chunk`` pieces. Read on the host once here.
        process_group: the group given to ``substitute_hf_flash_attn`` (None: the default group).
    """
    cu = _host(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] < 1:
        raise ValueError(f"cu_seqlens must rise from 0 to the global length, got {list(cu[:12])}"
                         f"{' ...' if len(cu) > 12 else ''}{rank_suffix()}")
    SeqParallelGroups.resolve(process_group)            # a clear error for a bad group, before any forward
    _DOCUMENTS[_group_key(process_group)] = cu


def substitute_hf_flash_attn(process_group: Any = None, heads_k_stride: int | None = 1, *, name: str | None = None,
                             check_positions: bool = True) -> str:
    """Route transformers attention to seqpar's all-gather method on ``process_group`` (ring-flash-attn's call).

    Args:
        process_group: the sequence-parallel group (None: the default group); ranks hold ``torch.chunk`` pieces
            of the packed batch, rank order = chunk order.
        heads_k_stride: KV heads gathered per round (must divide the model's KV heads; None = all at once).
        name: the ``attn_implementation`` entry to register (default: ``"flash_attention_2"`` where the
            flash-attn package is installed, else ``"seqpar_ring_attn"``; Note [Registry, not patch]).
        check_positions: check once per forward that ``position_ids`` are this rank's global positions or
            positions within the current documents (Note [What the substituted attention honours]).

    Returns:
        The ``attn_implementation`` name to load models with.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.utils import is_flash_attn_2_available
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError(f"substitute_hf_flash_attn needs transformers >= 4.53 (AttentionInterface): {e}") from e
    if heads_k_stride is not None and (isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int)
                                       or heads_k_stride < 1):
        raise ValueError(f"heads_k_stride must be a positive int or None, got {heads_k_stride!r}{rank_suffix()}")
    if name is None:
        name = "flash_attention_2" if is_flash_attn_2_available() else FALLBACK_NAME
    if not isinstance(name, str) or not name or name in ("eager", "sdpa"):
        raise ValueError(f"name must be an attn_implementation entry other than 'eager' and 'sdpa', got {name!r}"
                         f"{rank_suffix()}")
    SeqParallelGroups.resolve(process_group)
    adapter = _Adapter(process_group, heads_k_stride, name, check_positions)
    AttentionInterface.register(name, _eager(adapter.attention))
    if not name.startswith("flash_attention"):          # transformers' FA2 mask function already drops the mask
        AttentionMaskInterface.register(name, adapter.mask)
    return name


class _Adapter:
    """What one ``substitute_hf_flash_attn`` call registered: the group, the stride, the position check."""

    def __init__(self, group: Any, heads_k_stride: int | None, name: str, check_positions: bool):
        self.group, self.heads_k_stride, self.name, self.check = group, heads_k_stride, name, check_positions
        self._seen: tuple[Any, Any] = (None, None)          # (position_ids object, boundaries) already checked

    def mask(self, *args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
        """No dense mask: an all-ones padding mask is dropped (as transformers' FA2 path does), padding raises."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                f"attention_mask must have no padding with attn_implementation={self.name!r}, got a mask of shape "
                f"{tuple(attention_mask.shape)} with padding: pack the documents and give their boundaries to "
                f"update_ring_flash_attn_params instead{rank_suffix()}")
        return None

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  sliding_window: Any = _UNSET, softcap: float | None = None, **kwargs: Any
                  ) -> tuple[torch.Tensor, None]:
        """transformers' attention signature -> ``seqpar.attention(method="allgather")``.

        Args:
            query: ``(B, H, L, D)`` this rank's ``torch.chunk`` piece (RoPE applied); key, value ``(B, Hkv, L, D)``.
            attention_mask: None, or a 2D mask without padding (dropped); a 4D mask raises.

        Returns:
            ``(out (B, L, H, D), None)``.
        """
        where = f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})"
        self._refuse(where, attention_mask, dropout, softcap, kwargs)
        if key.shape[2] != query.shape[2]:
            raise NotImplementedError(f"decoding with a KV cache is not supported by attn_implementation="
                                      f"{self.name!r} (query length {query.shape[2]}, key length {key.shape[2]} in "
                                      f"{where}): call the model with use_cache=False{rank_suffix()}")
        cu = self._documents(query.shape[2], kwargs)
        causal = bool(getattr(module, "is_causal", True) if kwargs.get("is_causal") is None else kwargs["is_causal"])
        if sliding_window is _UNSET:
            sliding_window = getattr(module, "sliding_window", None)
        self._check_positions(kwargs.get("position_ids"), cu, query.shape[2])
        out_BSHD = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mesh=self.group,
                             method="allgather", layout="contiguous", causal=causal, softmax_scale=scaling,
                             window_size=_window(sliding_window, causal, where), cu_seqlens=cu,
                             heads_k_stride=self.heads_k_stride)
        return out_BSHD, None

    def _refuse(self, where: str, attention_mask: Any, dropout: float, softcap: Any, kwargs: dict[str, Any]) -> None:
        rs = rank_suffix()
        if attention_mask is not None:
            shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be None with attn_implementation={self.name!r}, got {shape} in "
                             f"{where}: pack the documents and pass their boundaries to update_ring_flash_attn_params"
                             f"{rs}")
        if dropout:
            raise NotImplementedError(f"attention dropout is not supported, got dropout={dropout} in {where}: set "
                                      f"config.attention_dropout=0.0 or call model.eval(){rs}")
        if softcap:
            raise NotImplementedError(f"logit softcapping is not supported, got softcap={softcap} in {where}{rs}")
        for key, value in kwargs.items():
            if value is None or value is False or key in ("cu_seq_lens_q", "cu_seq_lens_k"):
                continue
            if key in _REFUSED:
                raise NotImplementedError(f"{_REFUSED[key]} is not supported by attn_implementation={self.name!r}, "
                                          f"got {key}={_short(value)} in {where}{rs}")
            if key not in _UNDERSTOOD:
                raise NotImplementedError(f"keyword argument {key!r} passed to attention is not understood by "
                                          f"attn_implementation={self.name!r}, got {_short(value)} in {where}{rs}")

    def _documents(self, local_len: int, kwargs: dict[str, Any]) -> tuple[int, ...]:
        """The current step's global boundaries; ``cu_seq_lens_q/_k``, when a model passes them, must agree."""
        cu = _DOCUMENTS.get(_group_key(self.group))
        if cu is None:
            raise RuntimeError(f"update_ring_flash_attn_params(cu_seqlens, process_group) must be called before the "
                               f"forward (with the group given to substitute_hf_flash_attn), got no boundaries for "
                               f"this group{rank_suffix()}")
        world = SeqParallelGroups.resolve(self.group).world
        if cu[-1] != world * local_len:
            raise ValueError(f"the cu_seqlens given to update_ring_flash_attn_params must end at the global length "
                             f"{world * local_len} ({world} ranks x {local_len} tokens fed to the model), got "
                             f"{cu[-1]}: call it with this batch's boundaries{rank_suffix()}")
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            given = kwargs.get(key)
            if given is not None and _host(given) != cu:
                raise ValueError(f"{key} passed to the model must equal the global boundaries given to "
                                 f"update_ring_flash_attn_params, got {list(_host(given)[:8])} and {list(cu[:8])}"
                                 f"{rank_suffix()}")
        return cu

    def _check_positions(self, pos: Any, cu: tuple[int, ...], local_len: int) -> None:
        if not self.check or not isinstance(pos, torch.Tensor):
            return
        pos_BL = pos[None] if pos.dim() == 1 else pos
        if pos_BL.dim() != 2 or pos_BL.shape[-1] != local_len:
            return                                             # other position schemes (e.g. M-RoPE): not ours
        if self._seen[0] is pos and self._seen[1] == cu:
            return
        rank = SeqParallelGroups.resolve(self.group).index
        glob = torch.arange(rank * local_len, (rank + 1) * local_len, device=pos.device)
        bounds = torch.tensor(cu, dtype=torch.long, device=pos.device)
        in_doc = glob - bounds[torch.searchsorted(bounds[1:], glob, right=True).clamp_(max=len(cu) - 2)]
        if not bool(((pos_BL == glob) | (pos_BL == in_doc)).all()):
            raise ValueError(
                f"position_ids must be this rank's positions within the documents given to "
                f"update_ring_flash_attn_params (or its global positions), got {pos_BL[0, :6].tolist()}... where "
                f"rank {rank}'s torch.chunk piece holds document positions {in_doc[:6].tolist()}...: call "
                f"update_ring_flash_attn_params with this batch's cu_seqlens, or pass check_positions=False to "
                f"substitute_hf_flash_attn for another position scheme{rank_suffix()}")
        self._seen = (pos, cu)
