"""yunchang's attention layers on seqpar: ``LongContextAttention`` (USP), its QKV-packed and async forms, and
``UlyssesAttention``.

Same constructor and forward arguments as yunchang 0.6.4; inputs are this rank's tokens ``(b, s_local, h, d)``
(``EXTRACT_FUNC_DICT[ring_impl_type]`` gives them), outputs the attention output of the same tokens
``(b, s_local, h, d)`` - only the output, whatever ``return_attn_probs`` says, as in yunchang. Each forward is one
``seqpar.attention`` call: ``method="usp"`` on the mesh of ``set_seq_parallel_pg`` (captured when the layer is
built, as yunchang captures its groups) or ``method="ulysses"`` on ``sequence_process_group``.

Note [How yunchang's arguments map]
    ring_impl_type  "basic" -> layout "contiguous", "zigzag" -> "zigzag", "strip" -> "stripe", "basic_pytorch" ->
                    "contiguous" on PyTorch's kernels; "basic_flashinfer", "basic_npu" raise (no such kernels)
    attn_type       ``kernels.seqpar_kernel`` (FA -> "auto", TORCH_MATH -> "reference", ...; the rest raise)
    scatter_idx, gather_idx  the head and sequence dims of the inputs: (2, 1) for (b, s, h, d), (3, 1) for the
                    packed (b, s, 3, h, d); other values raise (yunchang's all-to-all has no other meaning)
    use_pack_qkv    accepted either way: seqpar always moves q, k, v in one all-to-all (yunchang's True path
                    crashes on a typo, PEERS.md §2 defect 9)
    use_sync=True   raises: seqpar never synchronizes the device; bound memory with head chunks instead
    window_size, dropout_p, softcap, alibi_slopes, deterministic  passed to seqpar.attention: windows in global
                    positions; softcap on the kernels that serve it (others raise with reasons); dropout
                    and ALiBi raise until seqpar has them
    extra positional forward arguments  raise (yunchang accepts and ignores them)

Unlike yunchang: GQA works for any KV head count (KV heads are replicated on the wire only when fewer than the
Ulysses degree), the ring degree 1 never runs the ring engine, backward works for every ``attn_type`` served,
and the async layer is differentiable.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import rank_suffix
from .._eager import attention
from .globals import PROCESS_GROUP
from .kernels import AttnType, seqpar_kernel

__all__ = ["AsyncLongContextAttention", "LongContextAttention", "LongContextAttentionQKVPacked", "UlyssesAttention"]

_LAYOUTS = {"basic": "contiguous", "zigzag": "zigzag", "strip": "stripe", "basic_pytorch": "contiguous"}
_NO_KERNEL = {"basic_flashinfer": "FlashInfer", "basic_npu": "Ascend's NPU fused attention"}


def _layout(ring_impl_type: Any) -> str:
    if ring_impl_type in _NO_KERNEL:
        raise NotImplementedError(f"ring_impl_type={ring_impl_type!r} runs {_NO_KERNEL[ring_impl_type]}, which seqpar "
                                  f"does not have: use 'basic' (same layout) with an AttnType seqpar serves"
                                  f"{rank_suffix()}")
    if ring_impl_type not in _LAYOUTS:
        raise ValueError(f"ring_impl_type must be one of {sorted(_LAYOUTS)}, got {ring_impl_type!r}{rank_suffix()}")
    return _LAYOUTS[ring_impl_type]


def _kernel(ring_impl_type: str, attn_type: Any, attn_processor: Any = None) -> str:
    kernel = seqpar_kernel(attn_type, attn_processor)
    return "flash" if ring_impl_type == "basic_pytorch" and kernel == "auto" else kernel


def _dims(scatter_idx: Any, gather_idx: Any, want: tuple[int, int], shape: str) -> None:
    if (scatter_idx, gather_idx) != want:
        raise NotImplementedError(f"scatter_idx and gather_idx must be {want} (the head and sequence dims of {shape}),"
                                  f" got ({scatter_idx!r}, {gather_idx!r}){rank_suffix()}")


def _no_sync(use_sync: Any) -> None:
    if use_sync is not False:
        raise NotImplementedError(f"use_sync must be False: seqpar never synchronizes the device inside attention "
                                  f"(bound the all-to-all buffers with head chunks: seqpar.attention(method='usp', "
                                  f"head_chunks=...)), got use_sync={use_sync!r}{rank_suffix()}")


def _no_extra(args: tuple) -> None:
    if args:
        raise TypeError(f"forward takes no arguments after return_attn_probs (yunchang ignores them; seqpar does "
                        f"not accept arguments it would ignore), got {len(args)} more{rank_suffix()}")


def _mesh() -> Any:
    if not PROCESS_GROUP.is_set:
        raise RuntimeError(f"call set_seq_parallel_pg(...) before building the layer (it creates the Ulysses and "
                           f"ring groups){rank_suffix()}")
    return PROCESS_GROUP.mesh


class LongContextAttention(torch.nn.Module):
    """USP: Ulysses over ``PROCESS_GROUP.ULYSSES_PG`` inside, the ring over ``PROCESS_GROUP.RING_PG`` across.

    Args:
        scatter_idx, gather_idx: 2 and 1 (the head and sequence dims of ``(b, s, h, d)``).
        ring_impl_type: "basic", "zigzag", "strip" or "basic_pytorch" (the token layout over the ring).
        use_pack_qkv: accepted either way (seqpar always packs q, k, v into one all-to-all).
        use_sync: must be False.
        attn_type: an ``AttnType`` seqpar serves (``kernels``).
        attn_processor: must be None.
    """

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_pack_qkv: bool = False, use_sync: bool = False, attn_type: AttnType = AttnType.FA,
                 attn_processor: Any = None) -> None:
        super().__init__()
        _dims(scatter_idx, gather_idx, (2, 1), "(b, s, h, d)")
        _no_sync(use_sync)
        if not isinstance(use_pack_qkv, bool):
            raise TypeError(f"use_pack_qkv must be a bool, got {use_pack_qkv!r}{rank_suffix()}")
        self.layout = _layout(ring_impl_type)
        self.kernel = _kernel(ring_impl_type, attn_type, attn_processor)
        self.mesh = _mesh()
        self.ulysses_pg, self.ring_pg = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
        self.scatter_idx, self.gather_idx, self.ring_impl_type = scatter_idx, gather_idx, ring_impl_type
        self.use_pack_qkv, self.use_sync, self.attn_type = use_pack_qkv, use_sync, attn_type
        self.options: dict[str, Any] = {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                return_attn_probs: bool = False, *args: Any) -> torch.Tensor:
        """``query (b, s_local, h, d)``, ``key, value (b, s_local, h_kv, d)`` -> ``(b, s_local, h, d)``."""
        _no_extra(args)
        return attention(query, key, value, mesh=self.mesh, method="usp", layout=self.layout, causal=causal,
                         softmax_scale=softmax_scale, kernel=self.kernel, window_size=tuple(window_size),
                         softcap=softcap, dropout_p=dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic,
                         **self.options)


class AsyncLongContextAttention(LongContextAttention):
    """yunchang's async USP layer: head groups pipelined through the all-to-alls (``head_chunks="auto"``).

    yunchang's overlaps each head's all-to-all with the previous head's attention but is forward-only (its
    gradients never reach q, k, v); this one is seqpar's pipelined USP, differentiable.
    """

    def __init__(self, scatter_idx: int = 2, gather_idx: int = 1, ring_impl_type: str = "basic") -> None:
        super().__init__(scatter_idx, gather_idx, ring_impl_type)
        self.options = {"head_chunks": "auto"}


class LongContextAttentionQKVPacked(torch.nn.Module):
    """USP on packed ``qkv (b, s_local, 3, h, d)`` (q, k, v share the head count), output ``(b, s_local, h, d)``.

    Args: as ``LongContextAttention``, with ``scatter_idx=3`` (the head dim of the packed input).
    """

    def __init__(self, scatter_idx: int = 3, gather_idx: int = 1, ring_impl_type: str = "basic",
                 use_sync: bool = False, attn_type: AttnType = AttnType.FA) -> None:
        super().__init__()
        _dims(scatter_idx, gather_idx, (3, 1), "(b, s, 3, h, d)")
        _no_sync(use_sync)
        self.layout = _layout(ring_impl_type)
        self.kernel = _kernel(ring_impl_type, attn_type)
        self.mesh = _mesh()
        self.ulysses_pg, self.ring_pg = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
        self.scatter_idx, self.gather_idx, self.ring_impl_type = scatter_idx, gather_idx, ring_impl_type
        self.use_sync, self.attn_type = use_sync, attn_type

    def forward(self, qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                deterministic: bool = False, return_attn_probs: bool = False, *args: Any) -> torch.Tensor:
        """``qkv (b, s_local, 3, h, d)`` -> ``(b, s_local, h, d)``."""
        _no_extra(args)
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (b, s_local, 3, h, d), got shape {tuple(qkv.shape)}{rank_suffix()}")
        return attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mesh=self.mesh, method="usp", layout=self.layout,
                         causal=causal, softmax_scale=softmax_scale, kernel=self.kernel,
                         window_size=tuple(window_size), softcap=softcap, dropout_p=dropout_p,
                         alibi_slopes=alibi_slopes, deterministic=deterministic)


class UlyssesAttention(torch.nn.Module):
    """Ulysses (DeepSpeed's all-to-all) over ``sequence_process_group`` (None: the default group).

    Args:
        sequence_process_group: the group whose ranks hold contiguous pieces ``chunk(W)[rank]`` of the sequence.
        scatter_idx, gather_idx: 2 and 1.
        use_sync: must be False.
        attn_type: an ``AttnType`` seqpar serves.
    """

    def __init__(self, sequence_process_group: Any = None, scatter_idx: int = 2, gather_idx: int = 1,
                 use_sync: bool = False, attn_type: AttnType = AttnType.FA) -> None:
        super().__init__()
        _dims(scatter_idx, gather_idx, (2, 1), "(b, s, h, d)")
        _no_sync(use_sync)
        self.kernel = seqpar_kernel(attn_type)
        self.spg, self.scatter_idx, self.gather_idx = sequence_process_group, scatter_idx, gather_idx
        self.use_sync, self.attn_type = use_sync, attn_type

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                return_attn_probs: bool = False, *args: Any) -> torch.Tensor:
        """``query (b, s_local, h, d)``, ``key, value (b, s_local, h_kv, d)`` -> ``(b, s_local, h, d)``."""
        _no_extra(args)
        return attention(query, key, value, mesh=self.spg, method="ulysses", layout="contiguous", causal=causal,
                         softmax_scale=softmax_scale, kernel=self.kernel, window_size=tuple(window_size),
                         softcap=softcap, dropout_p=dropout_p, alibi_slopes=alibi_slopes, deterministic=deterministic)
