"""Verify mode: recompute a sample of heads and rows densely and compare (``seqpar.verify``,
``seqpar.attention(..., verify=True)``).

Note [Verify mode]
    A cheap, always-available check of a distributed result against a dense recomputation of part of it::

        1. sample  ``heads`` query heads and ``rows`` valid global query positions from a generator seeded
                   with ``seed`` - identical on every rank, no communication
        2. gather  for those heads only: q and out, and k and v of their KV heads, packed in ONE all-gather
                   ``(B, L, 2 h + 2 h_kv, D)``; lse ``(B, h, L)`` in a second; the method's layout puts the
                   rows back in global order
        3. compute on every rank, per sampled head: the sampled rows against all keys in fp64 with a mask
                   built from global positions (causal, window, documents, padding) - written independently
                   of the block planner, like the test oracle - and, for bf16/fp16, the same rows in that
                   dtype (the single-device baseline of the tolerance rule)
        4. judge   with ``seqpar.tolerances.judge``: fp32 1e-5, fp64 1e-10, bf16/fp16 twice the
                   baseline's error plus 1e-6 (or a fixed ``tolerance``); -inf lse rows must match exactly
        5. agree   the worst error/limit ratio is MAX-reduced over the group, so every rank raises
                   ``VerificationError`` (with every measured error) or none does

    Cost per call, for B batch rows, S global tokens, D head dim, h sampled heads, R sampled rows:
    gathered bytes ``(2 h + 2 h_kv) B S D e + 4 B h S`` (e bytes per element); compute ``~4 h B R S D``
    flops in fp64 (plus the same in the input dtype for bf16/fp16); peak memory one head's fp64 scores,
    ``8 B R S`` bytes (R = 256, S = 128K: 256 MiB). Gradients are not verified here (the test suite covers
    them); the forward result ``out`` and ``lse`` are. Run it every N steps: ``verify=(step % N == 0)``,
    the same on every rank (it is part of the agreed call signature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import agreement
from .config import AttentionConfig
from .errors import VerificationError, rank_suffix
from .groups import SeqParallelGroups

if TYPE_CHECKING:
    from .tolerances import Verdict

__all__ = ["VerifyReport", "check_sample", "row_mask"]


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of one verification: the sampled heads and rows, and a verdict per field."""

    heads: tuple[int, ...]
    rows: int
    verdicts: dict[str, Verdict]
    worst: float
    """The largest error/limit ratio over the group (> 1 means failed)."""

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0

    def __str__(self) -> str:
        fields = ", ".join(f"{name}: {v}" for name, v in self.verdicts.items())
        return f"heads {list(self.heads)} x {self.rows} rows: {fields}"


def _sample(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``min(k, n)`` distinct sorted indices of ``range(n)``."""
    return torch.randperm(n, generator=gen)[: min(k, n)].sort().values


def row_mask(rows: torch.Tensor, seq_len: int, cfg: AttentionConfig) -> torch.Tensor:
    """Boolean ``(R, S)`` on ``rows.device``: global query position ``rows[i]`` sees key position t.

    Built from the rules directly (independent of the block planner, like the test oracle).
    """
    t = torch.arange(seq_len, device=rows.device)
    d = t[None, :] - rows[:, None]                                # key - query
    vis = torch.ones(len(rows), seq_len, dtype=torch.bool, device=rows.device)
    left, right = cfg.window_size
    if cfg.causal:
        vis &= d <= 0
    elif right >= 0:
        vis &= d <= right
    if left >= 0:
        vis &= d >= -left
    end = cfg.valid_len if cfg.valid_len is not None else seq_len
    bounds = torch.tensor(cfg.cu_seqlens if cfg.cu_seqlens is not None else (0, end), device=rows.device)
    doc = torch.searchsorted(bounds, t, right=True) - 1           # document of each position
    doc[t >= end] = -1                                            # padding sees nothing and is seen by nothing
    vis &= (doc[rows][:, None] == doc[None, :]) & (doc[rows][:, None] >= 0)
    if cfg.mask is not None:                                      # the mask_mod, evaluated on every cell
        fn = getattr(cfg.mask, "fn", cfg.mask)
        zero = torch.zeros((), dtype=torch.long, device=rows.device)
        vis &= fn(zero, zero, rows[:, None], t[None, :]).expand_as(vis)
    return vis


def _dense(q_BRD: torch.Tensor, k_BSD: torch.Tensor, v_BSD: torch.Tensor, vis: torch.Tensor, scale: float,
           dtype: torch.dtype, softcap: float = 0.0, sink: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, R, Dv), lse (B, R))`` of the rows against all keys, every op in ``dtype`` (score capping and a
    sink logit as ``seqpar.attention`` applies them)."""
    s = torch.einsum("brd,bsd->brs", q_BRD.to(dtype), k_BSD.to(dtype)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis, float("-inf"))
    if sink is not None:                                          # a virtual key with value 0
        s = torch.cat([s, s.new_full((*s.shape[:-1], 1), sink)], -1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :-1]
    return torch.einsum("brs,bsd->brd", p, v_BSD.to(dtype)), lse


def check_sample(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                 cfg: AttentionConfig, groups: SeqParallelGroups, module: Any, mesh: Any, *, heads: int = 2,
                 rows: int = 256, seed: int = 0, tolerance: float | None = None, raise_on_error: bool = True,
                 sinks: torch.Tensor | None = None) -> VerifyReport:
    """Note [Verify mode] on validated local shards; a collective on every rank of ``mesh``.

    Args:
        q, k, v: the local inputs ``(B, L, H, D)`` / ``(B, L, Hkv, D)`` / ``(B, L, Hkv, Dv)`` of the call.
        out, lse: its local result ``(B, L, H, Dv)`` and ``(B, H, L)`` (lse optional).
        cfg, groups, module: the call's validated config, groups and method declaration.
        mesh: the ``mesh`` argument of the call (the MAX-reduction runs over it).
        heads, rows, seed: the sample (Note [Verify mode]).
        tolerance: a fixed limit on the normalised max error instead of the dtype rule.
        raise_on_error: raise ``VerificationError`` on failure (else return the report).
    """
    from .tolerances import Verdict, judge  # the test suite's rule; imported on use (not at import)

    _, _, H, D = q.shape
    G = H // k.shape[2]
    layout, _ = module.placement(cfg.layout, groups, cfg.cu_seqlens, cfg.balance_rule)
    S = q.shape[1] * groups.world
    gen = torch.Generator().manual_seed(seed)
    hs = _sample(H, heads, gen).tolist()
    kvs = sorted({h // G for h in hs})
    rws = _sample(cfg.valid_len if cfg.valid_len is not None else S, rows, gen).to(q.device)
    nh = len(hs)
    idx_q = torch.tensor(hs, device=q.device)
    idx_k = torch.tensor(kvs, device=q.device)
    qk = torch.cat([q.detach().index_select(2, idx_q), k.detach().index_select(2, idx_k)], dim=2)
    ov = torch.cat([out.detach().to(q.dtype).index_select(2, idx_q), v.detach().index_select(2, idx_k)], dim=2)
    full_qk = layout.unshard(groups.all_gather(qk), 1)            # (B, S, nh + nk, D), on q's device
    full_ov = layout.unshard(groups.all_gather(ov), 1)            # (B, S, nh + nk, Dv)
    got_lse = None
    if lse is not None:
        got_lse = layout.unshard(groups.all_gather(lse.detach().index_select(1, idx_q)), 2)
    vis = row_mask(rws, S, cfg)
    scale = cfg.scale(D)
    truth_o, truth_l, base_o, base_l = [], [], [], []
    low = q.dtype in (torch.bfloat16, torch.float16)
    for i, h in enumerate(hs):
        j = kvs.index(h // G)
        qh, kh, vh = full_qk[:, rws, i], full_qk[:, :, nh + j], full_ov[:, :, nh + j]
        sink = None if sinks is None else float(sinks[h])
        o64, l64 = _dense(qh, kh, vh, vis, scale, torch.float64, cfg.softcap, sink)
        truth_o.append(o64)
        truth_l.append(l64)
        if low:
            ob, lb = _dense(qh, kh, vh, vis, scale, q.dtype, cfg.softcap, sink)
            base_o.append(ob)
            base_l.append(lb.float())
    dtype_name = str(q.dtype).removeprefix("torch.")
    verdicts = {"out": judge("out", full_ov[:, rws, :nh], torch.stack(truth_o, 2),
                             torch.stack(base_o, 2) if low else None, dtype_name)}
    if got_lse is not None:
        verdicts["lse"] = judge("lse", got_lse[:, :, rws], torch.stack(truth_l, 1),
                                torch.stack(base_l, 1) if low else None, dtype_name)
    if tolerance is not None:
        verdicts = {f: Verdict(v.error, float(tolerance), v.baseline, v.note) for f, v in verdicts.items()}
    local = max(float("inf") if v.note else v.error / max(v.limit, 1e-300) for v in verdicts.values())
    (worst,) = agreement.max_over([min(local, 1e300)], mesh, q.device)
    report = VerifyReport(tuple(hs), len(rws), verdicts, worst)
    if raise_on_error and not report.ok:
        raise VerificationError(f"verify: method={cfg.method!r} layout={cfg.layout!r} differs from a dense fp64 "
                                f"recomputation (worst error/limit {worst:.3g} over the group); here {report}"
                                f"{rank_suffix()}")
    return report
