"""The oracle: dense attention on the whole (gathered) sequence in one process, with an explicit mask.

``dense_attention`` builds the full ``(S, S)`` visibility from global positions (causal, window, documents,
padding, and a ``mask_mod`` evaluated on the full grid) - deliberately independent of the block planner - and
differentiates with autograd. It runs in
any dtype: fp64 is the truth; the input dtype gives the "single-device computation" whose error sets the
tolerance for low-precision runs (``seqpar.tolerances``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["dense_attention", "dense_mask"]


def dense_mask(seq_len: int, *, causal: bool, window: tuple[int, int] = (-1, -1),
               cu_seqlens: Sequence[int] | None = None, valid_len: int | None = None,
               device: torch.device | str = "cpu", mask_mod=None) -> torch.Tensor:
    """Boolean ``(S, S)``: query p sees key t (``mask_mod(b, h, q_idx, kv_idx)``, if given, on every cell)."""
    p = torch.arange(seq_len, device=device)
    d = p[None, :] - p[:, None]                      # key - query
    vis = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        vis &= d <= 0
    elif right >= 0:
        vis &= d <= right
    if left >= 0:
        vis &= d >= -left
    end = valid_len if valid_len is not None else (cu_seqlens[-1] if cu_seqlens is not None else seq_len)
    doc = torch.full((seq_len,), -1, dtype=torch.long, device=device)
    bounds = list(cu_seqlens) if cu_seqlens is not None else [0, end]
    for i in range(len(bounds) - 1):
        doc[bounds[i]:bounds[i + 1]] = i
    doc[end:] = -1
    vis &= (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    if mask_mod is not None:
        zero = torch.zeros((), dtype=torch.long, device=device)
        b, h = zero.clone(), zero.clone()
        for i in range(seq_len):         # one row at a time: the function sees scalar query positions too
            vis[i] &= mask_mod(b, h, p[i], p).to(device)
    return vis


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor | None = None, *,
                    causal: bool, window: tuple[int, int] = (-1, -1), cu_seqlens: Sequence[int] | None = None,
                    valid_len: int | None = None, scale: float | None = None, dtype: torch.dtype = torch.float64,
                    upcast_softmax: bool = True, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    dlse: torch.Tensor | None = None, mask_mod=None) -> dict[str, torch.Tensor]:
    """Dense attention on global ``q (B, S, H, D)``, ``k (B, S, Hkv, D)``, ``v (B, S, Hkv, Dv)``, in ``dtype``.

    Returns ``out``, ``lse`` (``(B, H, S)``, -inf for rows that see nothing) and, with ``do``, ``dq``, ``dk``,
    ``dv`` (by autograd of ``sum(out * do) + sum(lse * dlse)`` over finite lse), plus ``dsinks`` with
    ``sinks`` and ``dsinks_terms``, the sum of its terms' magnitudes per head (``sum_i P_sink,i (sum_d |O_id dO_id|
    + |dlse_i|)``, the magnitudes of what ``Delta_i = O_i . dO_i - dlse_i`` sums: the scale its error is judged
    against, ``seqpar.tolerances``; a term whose parts cancel keeps the rounding of its parts). ``softcap > 0`` caps
    the scores (``softcap * tanh(s / softcap)``); ``sinks (H,)`` join every row's denominator (lse includes them).
    ``mask_mod`` further masks every cell. ``upcast_softmax=False`` keeps the softmax in ``dtype`` too (the naive
    single-device low-precision computation).
    """
    _, S, H, D = q.shape
    G = H // k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    grad = do is not None
    qd, kd, vd = (t.detach().to(dtype).requires_grad_(grad) for t in (q, k, v))
    sd = None if sinks is None else sinks.detach().to(dtype).requires_grad_(grad)
    kr, vr = kd.repeat_interleave(G, dim=2), vd.repeat_interleave(G, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kr) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = dense_mask(S, causal=causal, window=window, cu_seqlens=cu_seqlens, valid_len=valid_len, device=q.device,
                     mask_mod=mask_mod)
    s = s.masked_fill(~vis, float("-inf"))
    sm = s.float() if upcast_softmax and dtype in (torch.float16, torch.bfloat16) else s
    lse = torch.logsumexp(sm, dim=-1)
    if sd is not None:
        lse = torch.logaddexp(lse, sd.to(lse.dtype).view(1, -1, 1))
    p = torch.exp(sm - lse.unsqueeze(-1)).nan_to_num(0.0).to(dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    res = {"out": out.detach(), "lse": lse.detach().float() if dtype != torch.float64 else lse.detach()}
    if grad:
        loss = (out * do.to(dtype)).sum()
        if dlse is not None:
            loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.to(lse.dtype)).sum()
        leaves = (qd, kd, vd) if sd is None else (qd, kd, vd, sd)
        grads = torch.autograd.grad(loss, leaves)
        res.update(dq=grads[0], dk=grads[1], dv=grads[2])
        if sd is not None:
            res["dsinks"] = grads[3]
            # the magnitude of the sum dsinks is: sum_i exp(sink - L_i) |parts of Delta_i| per head (its terms'
            # scale): Delta_i = O_i . dO_i - dlse_i rounds like its parts, however much they cancel
            parts = (out * do.to(dtype)).abs().sum(-1).transpose(1, 2)
            if dlse is not None:
                parts = parts + torch.where(torch.isfinite(lse), dlse.to(parts.dtype), 0.0).abs()
            p_sink = torch.exp(sd.view(1, -1, 1).to(lse.dtype) - lse).nan_to_num(0.0)
            res["dsinks_terms"] = (p_sink * parts.to(p_sink.dtype)).sum((0, 2)).detach()
    return res
