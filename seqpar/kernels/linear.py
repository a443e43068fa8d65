"""Local linear attention on ONE rank: the recurrence (the reference), its chunked form, and fla-core.

Shapes (suffixes as elsewhere; K = Dk key dim, V = Dv value dim)::

    q, k     (B, L, H, K)          v, o   (B, L, H, V)          state   (B, H, K, V)  fp32 (fp64 for fp64)
    g        log forget gate, <= 0: None (plain linear attention)
                                    (H,)          constant per head (lightning, retention)
                                    (B, L, H)     per token and head (simple GLA, Mamba-2 style)
                                    (B, L, H, K)  per token and key dim (GLA, HGRN2, RWKV-6)

Both forms take an initial state and return ``(o, final_state)``; ``o`` has q's dtype, the state is kept in
fp32 (fp64 for fp64 inputs). ``scale`` multiplies q (default ``K ** -0.5``, fla's convention) and an
optional ``feature_map`` ("elu1", "relu", "identity" or a callable) is applied to q and k first.

Note [Inclusive decay]
    ALGORITHMS.md §10.1, the one recurrence every path is tested against::

        S_t = Diag(e^{g_t}) S_{t-1} + k_t v_t^T          o_t = S_t^T q_t
            = sum_{j<=t} (q_t * e^{G_t - G_j})^T k_j v_j  +  (q_t * e^{G_t})^T S_0,     G_t = sum_{l<=t} g_l

    The gate of step t decays the OLD state before token t's own outer product is added, so token t sees
    itself undecayed and token j < t decayed by g_{j+1} .. g_t (G is an inclusive cumulative sum; the
    difference G_t - G_j excludes g_j). ``tests/test_linear_kernels.py`` pins this on a hand example.

Note [Chunked form]
    Cut the sequence into chunks of C tokens (the last may be shorter; it is zero-padded inside with
    k = v = 0 and g = 0, which leaves outputs and the state unchanged). With G chunk-local and S_[t] the
    state entering chunk t::

        O       = [(Q K^T) * D] V + (Q * e^{G}) S_[t]          D_ij = e^{G_i - G_j} for i >= j, else 0
        S_[t+1] = Diag(e^{G_C}) S_[t] + (K * e^{G_C - G})^T V

    A per-dim gate cannot be one mask D: the intra-chunk scores are ``sum_c q_ic k_jc e^{G_ic - G_jc}``
    (a (C, C, K) weight per chunk, fine for the reference; fla-core tiles it on GPU).

Note [Linear attention numerics]
    Only non-positive log-decay differences are exponentiated: ``where(i >= j, G_i - G_j, -inf)`` is masked
    BEFORE the exp, ``e^{G_C - G_j}`` and ``e^{G_i}`` have non-positive exponents because g <= 0, and
    ``K * e^{-G}`` (which overflows over long spans) is never formed. States, cumulative gates and chunk
    scans run in fp32 (fp64 for fp64 inputs) whatever the input dtype; outputs are cast back at the end.
"""

from __future__ import annotations

import functools
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import UnsupportedInputError
from ..numerics import acc_dtype

__all__ = ["FEATURE_MAPS", "LINEAR_KERNELS", "LinearCall", "LinearKernel", "apply_feature_map",
           "available_linear_kernels", "cumulative_gate", "gate_kind", "linear_attention_chunked",
           "linear_attention_recurrent", "select_linear"]

log = logging.getLogger("seqpar.kernels")

FeatureMap = str | Callable[[torch.Tensor], torch.Tensor] | None

#: named feature maps for q and k (a callable is accepted as well)
FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "elu1": lambda x: F.elu(x) + 1.0,
    "relu": F.relu,
}


def apply_feature_map(x: torch.Tensor, feature_map: FeatureMap) -> torch.Tensor:
    """``feature_map(x)`` for a name in ``FEATURE_MAPS``, a callable, or None (identity)."""
    if feature_map is None:
        return x
    if callable(feature_map):
        return feature_map(x)
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}, a callable or None, "
                         f"got {feature_map!r}")
    return FEATURE_MAPS[feature_map](x)


def gate_kind(g: torch.Tensor | None) -> str:
    """"none", "scalar" (one log gate per token and head, ``(B, L, H)``) or "dim" (``(B, L, H, K)``)."""
    if g is None:
        return "none"
    return "dim" if g.dim() == 4 else "scalar"


def _expand_gate(g: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """``(H,)`` constant decay -> a ``(B, L, H)`` view; other forms unchanged."""
    if g is not None and g.dim() == 1:
        B, L, H, _ = q.shape
        return g.view(1, 1, H).expand(B, L, H)
    return g


def cumulative_gate(g: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Inclusive cumulative log gate along dim 1 in ``dtype``, shaped to broadcast over K: ``(B, n, H, 1|K)``."""
    if g is None:
        return None
    G = g.to(dtype).cumsum(1)
    return G.unsqueeze(-1) if G.dim() == 3 else G


def _prepare(q, k, g, scale, feature_map):
    q, k = apply_feature_map(q, feature_map), apply_feature_map(k, feature_map)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, _expand_gate(g, q)


# ------------------------------------------------------------------------------------------------ reference


def _recurrent_core(q, k, v, g, h0):
    """The recurrence token by token, in the accumulation dtype; q already scaled. ``-> (o, S)``."""
    acc = acc_dtype(q.dtype)
    B, L, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=acc) if h0 is None else h0.to(acc)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    alpha = None if g is None else torch.exp(g.to(acc))
    if alpha is not None and alpha.dim() == 3:
        alpha = alpha.unsqueeze(-1)                                    # (B, L, H, 1): one gate for all K
    outs = []
    for t in range(L):
        if alpha is not None:
            S = alpha[:, t].unsqueeze(-1) * S                          # decay the old state first ...
        S = S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)          # ... then add k_t v_t^T, undecayed
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


def linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                               *, scale: float | None = None, feature_map: FeatureMap = None,
                               initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the recurrence of Note [Inclusive decay], one token at a time (differentiable).

    Args:
        q, k: ``(B, L, H, K)``; v: ``(B, L, H, V)``.
        g: log forget gate (<= 0), None | ``(H,)`` | ``(B, L, H)`` | ``(B, L, H, K)``.
        scale: multiplies q after the feature map; default ``K ** -0.5``.
        feature_map: applied to q and k ("elu1", "relu", "identity", a callable or None).
        initial_state: ``(B, H, K, V)`` state before the first token (zeros when None).

    Returns:
        ``o (B, L, H, V)`` in q's dtype and the final state ``(B, H, K, V)`` in fp32 (fp64 for fp64).
    """
    qs, ks, gs = _prepare(q, k, g, scale, feature_map)
    o, S = _recurrent_core(qs, ks, v, gs, initial_state)
    return o.to(q.dtype), S


# ------------------------------------------------------------------------------------------------ chunked


def _chunk_view(x: torch.Tensor, C: int, n: int) -> torch.Tensor:
    """``(B, L, H, ...)`` -> ``(B, H, N, C, ...)``, zero-padding L up to ``n = N * C``."""
    L = x.shape[1]
    if n > L:
        x = torch.cat([x, x.new_zeros(x.shape[0], n - L, *x.shape[2:])], 1)
    x = x.reshape(x.shape[0], n // C, C, *x.shape[2:])                  # (B, N, C, H, ...)
    return x.movedim(3, 1)                                               # (B, H, N, C, ...)


def _chunked_core(q, k, v, g, h0, C: int):
    """Note [Chunked form] in the accumulation dtype; q already scaled. ``-> (o (B, L, H, V), S)``."""
    acc = acc_dtype(q.dtype)
    B, L, H, K = q.shape
    n = -(-L // C) * C
    q_c, k_c, v_c = (_chunk_view(t.to(acc), C, n) for t in (q, k, v))      # (B, H, N, C, K|V)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if g is None:
        scores = (q_c @ k_c.transpose(-1, -2)).masked_fill(~causal, 0.0)
        q_in, k_out, decay_C = q_c, k_c, None
    else:
        G = _chunk_view(g.to(acc), C, n).cumsum(3)                       # (B, H, N, C[, K]) chunk-local, inclusive
        if G.dim() == 4:
            G = G.unsqueeze(-1)                                          # scalar gate: (B, H, N, C, 1)
        GC = G[:, :, :, -1:]                                             # (B, H, N, 1, 1|K)
        diff = G.unsqueeze(4) - G.unsqueeze(3)                           # (B, H, N, C_i, C_j, 1|K): G_i - G_j
        D = torch.exp(diff.masked_fill(~causal[..., None], float("-inf")))   # masked before the exp
        if G.shape[-1] == 1:
            scores = (q_c @ k_c.transpose(-1, -2)) * D[..., 0]
        else:
            scores = torch.einsum("bhnic,bhnjc,bhnijc->bhnij", q_c, k_c, D)
        q_in, k_out, decay_C = q_c * torch.exp(G), k_c * torch.exp(GC - G), torch.exp(GC[:, :, :, 0])
    o_c = scores @ v_c                                                   # intra-chunk part
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=acc) if h0 is None else h0.to(acc)
    M = k_out.transpose(-1, -2) @ v_c                                    # (B, H, N, K, V) chunk summaries
    inter = []
    for t in range(n // C):                                              # the state entering each chunk
        inter.append(q_in[:, :, t] @ S)
        S = (S if decay_C is None else decay_C[:, :, t].unsqueeze(-1) * S) + M[:, :, t]
    o_c = o_c + torch.stack(inter, 2)
    o = o_c.movedim(1, 3).reshape(B, n, H, -1)[:, :L]
    return o, S


def linear_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                             *, scale: float | None = None, feature_map: FeatureMap = None,
                             initial_state: torch.Tensor | None = None, chunk_size: int = 64
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked linear attention (Note [Chunked form]) with torch ops; differentiable through autograd.

    Same arguments and results as ``linear_attention_recurrent``, plus ``chunk_size`` (any length works:
    the tail chunk is padded internally, never dropped).
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    qs, ks, gs = _prepare(q, k, g, scale, feature_map)
    o, S = _chunked_core(qs, ks, v, gs, initial_state, chunk_size)
    return o.to(q.dtype), S


# ------------------------------------------------------------------------------------------------ dispatch


@dataclass(frozen=True)
class LinearCall:
    """What a local linear kernel must serve (hashable: selection is cached on it)."""

    device: str
    dtype: torch.dtype
    gate: str          # "none" | "scalar" | "dim"

    @staticmethod
    def of(q: torch.Tensor, g: torch.Tensor | None) -> LinearCall:
        return LinearCall(q.device.type, q.dtype, gate_kind(_expand_gate(g, q)))


class LinearKernel(ABC):
    """One local implementation: ``run(q, k, v, g, h0, chunk_size) -> (o, final_state)``.

    ``q`` is already feature-mapped and scaled; ``g`` is None, ``(B, L, H)`` or ``(B, L, H, K)``; ``o`` may
    come back in fp32 or the input dtype (callers accumulate in fp32); the state is fp32 (fp64 for fp64).
    Differentiable in q, k, v, g and h0 through autograd.
    """

    name: ClassVar[str]
    #: preference for ``kernel="auto"`` per device type (higher first); absent = never chosen by auto
    auto_rank: ClassVar[dict[str, int]] = {}

    @abstractmethod
    def not_supported_reasons(self, call: LinearCall) -> list[str]:
        """Why this kernel cannot serve ``call`` (empty when it can)."""

    @abstractmethod
    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
            h0: torch.Tensor | None, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o (B, L, H, V), final_state (B, H, K, V))``."""


class ChunkedKernel(LinearKernel):
    """Note [Chunked form] in torch ops: any device and dtype, the CPU path."""

    name = "chunked"
    auto_rank = {"cpu": 10, "cuda": 10}

    def not_supported_reasons(self, call: LinearCall) -> list[str]:
        return []

    def run(self, q, k, v, g, h0, chunk_size):
        return _chunked_core(q, k, v, g, h0, chunk_size)


class RecurrentKernel(LinearKernel):
    """The token-by-token recurrence: the oracle, never chosen by "auto" (one step per token)."""

    name = "recurrent"

    def not_supported_reasons(self, call: LinearCall) -> list[str]:
        return []

    def run(self, q, k, v, g, h0, chunk_size):
        return _recurrent_core(q, k, v, g, h0)


_FLA_MIN = (0, 3)     # fla-core releases take [B, T, H, K] inputs only (no head_first argument)


def _version(dist_name: str) -> tuple[int, ...] | None:
    from importlib import metadata

    try:
        text = metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in text.split(".")[:2])


@functools.lru_cache(maxsize=1)
def _fla():
    """``((chunk_simple_gla, chunk_gla), None)`` or ``(None, reason)``; imported on first use only."""
    found = _version("fla-core") or _version("flash-linear-attention")
    if found is None:
        return None, "fla-core is not installed (pip install fla-core)"
    if found < _FLA_MIN:
        return None, (f"fla-core {'.'.join(map(str, found))} is older than {'.'.join(map(str, _FLA_MIN))} "
                      f"(the [B, T, H, K] layout)")
    try:
        simple = importlib.import_module("fla.ops.simple_gla").chunk_simple_gla
        gla = importlib.import_module("fla.ops.gla").chunk_gla
    except Exception as e:      # ImportError, or Triton failing at import on a machine without a GPU
        return None, f"fla-core is not importable ({type(e).__name__}: {e})"
    return (simple, gla), None


class FlaKernel(LinearKernel):
    """fla-core's chunked Triton kernels (``chunk_simple_gla`` / ``chunk_gla``), lazily imported.

    Same inclusive-gate convention as Note [Inclusive decay]; called with ``scale=1`` (q arrives scaled),
    ``initial_state`` and ``output_final_state=True``; the final-state gradient (``dht``) flows through
    fla's own autograd Function.
    """

    name = "fla"
    auto_rank = {"cuda": 100}

    def not_supported_reasons(self, call: LinearCall) -> list[str]:
        r = []
        if call.device != "cuda":
            r.append(f"runs on CUDA only (Triton kernels), got device {call.device!r}")
        if call.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            r.append(f"dtype must be fp16, bf16 or fp32, got {call.dtype}")
        if not r:
            _, why = _fla()
            if why:
                r.append(why)
        return r

    def run(self, q, k, v, g, h0, chunk_size):
        (simple, gla), _ = _fla()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        h0 = None if h0 is None else h0.float().contiguous()
        if g is not None and g.dim() == 4:
            o, S = gla(q, k, v, g.contiguous(), scale=1.0, initial_state=h0, output_final_state=True)
        else:
            o, S = simple(q, k, v, None if g is None else g.contiguous(), scale=1.0, initial_state=h0,
                          output_final_state=True)
        return o, S


LINEAR_KERNELS: dict[str, LinearKernel] = {k.name: k for k in (ChunkedKernel(), RecurrentKernel(), FlaKernel())}


def available_linear_kernels() -> list[str]:
    """Every name ``linear_attention(kernel=...)`` accepts."""
    return ["auto", *sorted(LINEAR_KERNELS)]


@functools.lru_cache(maxsize=64)
def select_linear(name: str, call: LinearCall) -> LinearKernel:
    """The named kernel, or for "auto" the best-ranked one that serves ``call``; raises with every reason."""
    if name == "auto":
        cands = sorted((k for k in LINEAR_KERNELS.values() if call.device in k.auto_rank),
                       key=lambda k: -k.auto_rank[call.device])
    elif name in LINEAR_KERNELS:
        cands = [LINEAR_KERNELS[name]]
    else:
        raise ValueError(f"kernel must be one of {available_linear_kernels()}, got {name!r}")
    reasons: dict[str, list[str]] = {}
    for kern in cands:
        why = kern.not_supported_reasons(call)
        if not why:
            log.info("linear kernel=%s -> %s for %s", name, kern.name, call)
            return kern
        reasons[kern.name] = why
    if not reasons:
        reasons[name] = [f"no linear kernel is ranked for device {call.device!r}"]
    raise UnsupportedInputError(f"kernel={name!r} cannot serve linear attention {call}:", reasons)
