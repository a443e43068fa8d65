"""Pass-KV or pass-Q? The bytes-per-step rule of ALGORITHMS.md §7.1, for users and the planner.

    >>> seqpar.choose_pass(batch=1, q_len=4096, heads=32, kv_heads=8, head_dim=128)
    PassChoice(choice='kv', kv_bytes=..., q_bytes=...)

Per rank and per step, with L_q query rows and L_kv key rows per rank, e bytes per activation element
and e_g per gradient element on the wire:

    =========  ===================================  =====================================================
    pass       forward                              backward
    =========  ===================================  =====================================================
    pass-KV    2 B L_kv Hkv D e        (K, V)       2 B L_kv Hkv D (e + e_g)          (K, V, dK, dV)
    pass-Q     B L_q H (2 D e + 4)     (Q, O, lse)  B L_q H (2 D e + 8) + B L_q H D e_g
                                                    (Q, dO, lse, Delta; dQ returned)
    =========  ===================================  =====================================================

Without a kernel that takes Delta, pass-Q backward sends O instead: ``B L_q H (3 D e + 4)`` plus dQ.
For self-attention (L_q = L_kv) pass-Q costs about g (1 + 2 / (D e)) times pass-KV in forward (g = H / Hkv),
so it is never cheaper under GQA and breaks even for MHA; it wins when queries are few against a long KV
(persistent-KV prefill, decode). Ties go to pass-KV (the simpler schedule). TokenRing's causal zigzag
variant sends only the back half of Q after the wrap (3/4 of the rows over a pass); this per-step rule
does not count that saving.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import rank_suffix

__all__ = ["PassChoice", "choose_pass"]


class PassChoice(NamedTuple):
    """``choice`` is "kv" or "q"; the byte counts are per rank per step (forward, plus backward if asked)."""

    choice: str
    kv_bytes: int
    q_bytes: int


def _elem_bytes(dtype: torch.dtype, what: str) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{what} must be a floating torch.dtype, got {dtype!r}{rank_suffix()}")
    return torch.finfo(dtype).bits // 8


def choose_pass(*, batch: int, q_len: int, heads: int, head_dim: int, kv_len: int | None = None,
                kv_heads: int | None = None, dtype: torch.dtype = torch.bfloat16,
                grad_dtype: torch.dtype = torch.float32, backward: bool = True,
                send_delta: bool = True) -> PassChoice:
    """Pick pass-KV ("kv": ring) or pass-Q ("q": TokenRing) by bytes moved per rank per step.

    Args:
        batch: B.
        q_len: query rows per rank (L_q).
        heads: query heads H.
        head_dim: D.
        kv_len: key rows per rank (L_kv); default ``q_len`` (self-attention).
        kv_heads: KV heads Hkv; default ``heads`` (MHA).
        dtype: activation dtype on the wire (e).
        grad_dtype: gradient dtype on the wire (e_g; fp32 by default, as ``seqpar.attention``).
        backward: count forward + backward bytes (training); False counts forward only (inference).
        send_delta: pass-Q backward sends Delta = rowsum(dO * O) (fp32) instead of O, as it does with
            kernels that accept a precomputed Delta.

    Returns:
        ``PassChoice(choice, kv_bytes, q_bytes)``.
    """
    kv_len = q_len if kv_len is None else kv_len
    kv_heads = heads if kv_heads is None else kv_heads
    for name, val in (("batch", batch), ("q_len", q_len), ("kv_len", kv_len), ("heads", heads),
                      ("kv_heads", kv_heads), ("head_dim", head_dim)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}{rank_suffix()}")
    if heads % kv_heads:
        raise ValueError(f"heads must be a multiple of kv_heads, got heads={heads}, kv_heads={kv_heads}"
                         f"{rank_suffix()}")
    e, eg = _elem_bytes(dtype, "dtype"), _elem_bytes(grad_dtype, "grad_dtype")
    D = head_dim
    kv = 2 * batch * kv_len * kv_heads * D * e
    q = batch * q_len * heads * (2 * D * e + 4)
    if backward:
        kv += 2 * batch * kv_len * kv_heads * D * eg
        stats = (2 * D * e + 8) if send_delta else (3 * D * e + 4)
        q += batch * q_len * heads * stats + batch * q_len * heads * D * eg
    return PassChoice("q" if q < kv else "kv", kv, q)
