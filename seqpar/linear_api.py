"""``linear_attention``: sequence-parallel linear attention (LASP-2, and LASP-1 as the ring baseline).

The same contract as ``seqpar.attention``: inputs are this rank's shards ``(B, L, H, D)`` in the method's
token layout (``seqpar.shard(x, layout=...)`` puts them there: linear methods place tokens exactly like
the softmax methods, so one layout serves a hybrid model), every call is validated here once, before any
collective, with "X must Y, got Z (rank r of W)" errors, and then the method module runs.

The math is ALGORITHMS.md §10.1 (Note [Inclusive decay] in ``seqpar.kernels.linear``); the methods are
``seqpar/methods/lasp2.py`` (Note [LASP-2 schedule]) and ``seqpar/methods/lasp1.py``. Linear methods are not
in the softmax registry (``seqpar.methods.available()``); ``linear_methods()`` lists them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from . import agreement
from .errors import rank_suffix
from .groups import SeqParallelGroups
from .kernels.linear import FEATURE_MAPS, LinearCall, apply_feature_map, available_linear_kernels, select_linear
from .layouts import LAYOUTS
from .methods._linear import LinearConfig
from .runtime.call import host_cu_seqlens

__all__ = ["get_linear_method", "linear_attention", "linear_methods"]

_METHODS = {"lasp2": "seqpar.methods.lasp2", "lasp1": "seqpar.methods.lasp1"}


def linear_methods() -> list[str]:
    """Names ``linear_attention(method=...)`` accepts."""
    return list(_METHODS)


def get_linear_method(name: str) -> ModuleType:
    """The module implementing linear method ``name``; ValueError listing the valid names otherwise."""
    if name not in _METHODS:
        raise ValueError(f"method must be one of {linear_methods()}, got {name!r}{rank_suffix()}")
    return importlib.import_module(_METHODS[name])


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Any = None, method: str = "lasp2",
                     layout: str = "contiguous", decay: torch.Tensor | None = None, gates: torch.Tensor | None = None,
                     causal: bool = True, scale: float | None = None,
                     feature_map: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     cu_seqlens: torch.Tensor | Sequence[int] | None = None, seq_len: int | None = None,
                     chunk_size: int = 64, kernel: str = "auto", grad_dtype: torch.dtype = torch.float32,
                     deterministic: bool = False, check_ranks: bool = True
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sequence-parallel linear attention over the ranks of ``mesh`` (ALGORITHMS.md §10).

    ``S_t = Diag(e^{g_t}) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t`` over the global sequence (documents reset
    the state), with q multiplied by ``scale`` after ``feature_map``.

    Args:
        q, k: local queries and keys ``(B, L, H, K)``; v: local values ``(B, L, H, V)`` (GQA is not served).
        mesh: a 1D DeviceMesh, a ProcessGroup, or None for the default group.
        method: "lasp2" (one all-gather of state summaries, overlapped) or "lasp1" (a dependent ring of
            states, the baseline; causal, contiguous, no final state).
        layout: "contiguous" or "zigzag" (lasp2), the layout of ``seqpar.shard(..., layout=...)``.
        decay: log decay (<= 0): ``(H,)`` constant per head (lightning / retention) or ``(B, L, H)`` per token
            (simple GLA / Mamba-2 style). Values are not checked (that would synchronise the device).
        gates: per-dim log gates ``(B, L, H, K)`` (<= 0, GLA style). At most one of ``decay`` and ``gates``.
        causal: the recurrence; False lets every token see its whole document (no decay or gates, no states).
        scale: multiplies q (after the feature map); default ``K ** -0.5``.
        feature_map: applied to q and k: "elu1", "relu", "identity", a callable, or None.
        initial_state: ``(B, H, K, V)`` state before global position 0. Pass it on every rank; the rank holding
            position 0 reads it and gets its whole gradient (the others get zeros), so summing gradients over
            the group - as for any replicated parameter - gives the total. Not with ``cu_seqlens``.
        output_final_state: also return the state after the last valid token, fp32 ``(B, H, K, V)``,
            the same on every rank; gradients reaching it on different ranks add up.
        cu_seqlens: global document boundaries (0 first, total last): the state resets at each boundary,
            documents may span ranks. A CUDA tensor costs one host read per call; pass a list.
        seq_len: the valid global length when the shards carry end padding (``shard(..., pad=True)``);
            padded rows give zeros and get zero gradients.
        chunk_size: chunk length of the local chunked form (any local length works; tails are padded inside).
        kernel: local kernel "auto", "chunked", "recurrent" or "fla" (fla-core on CUDA); a named kernel that
            cannot serve the input raises with the reasons.
        grad_dtype: dtype of the exchanged state gradients (fp32 default).
        deterministic: bitwise-reproducible results: reductions over ranks in a fixed order (the non-causal
            all-reduce becomes an all-gather summed in rank order) and torch kernels only ("auto" picks
            "chunked"; "fla" raises: its kernels are not checked for run-to-run determinism).
        check_ranks: run the agreement round (Note [Agreement protocol] in ``seqpar.agreement``); ``False``
            skips it - only on EVERY rank at once (e.g. ``check_ranks=(step % N == 0)``).

    Returns:
        ``o (B, L, H, V)`` in q's dtype, or ``(o, final_state)`` with ``output_final_state``.
    """
    g = decay if gates is None else gates
    try:                        # local validation; a rank that fails it still joins the agreement round
        module = get_linear_method(method)
        groups = SeqParallelGroups.resolve(mesh, module.MESH_DIMS)
        for name, flag in (("deterministic", deterministic), ("check_ranks", check_ranks)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}{rank_suffix()}")
        if decay is not None and gates is not None:
            raise ValueError(f"decay and gates must not both be given, got decay {tuple(decay.shape)} and gates "
                             f"{tuple(gates.shape)}{rank_suffix()}")
        if deterministic and kernel == "fla":
            raise NotImplementedError(f"kernel='fla' must not be used with deterministic=True (fla-core's kernels "
                                      f"are not checked for run-to-run determinism; use 'chunked'), got "
                                      f"kernel='fla'{rank_suffix()}")
        cfg = _config(module, layout=layout, causal=causal, chunk_size=chunk_size,
                      kernel="chunked" if deterministic and kernel == "auto" else kernel, cu_seqlens=cu_seqlens,
                      seq_len=seq_len, grad_dtype=grad_dtype, output_final_state=output_final_state,
                      initial_state=initial_state, g=g, deterministic=deterministic)
        _validate_inputs(q, k, v, g, gates is not None, initial_state, cfg, groups, module, scale, feature_map)
        if causal:
            select_linear(cfg.kernel, LinearCall.of(q, g))    # a kernel that cannot serve raises before any collective
    except Exception as err:    # every rank must hear of it; re-raised unchanged below
        if check_ranks is not False:
            agreement.share_error(err, mesh)
        raise
    if check_ranks:
        agreement.check(agreement.linear_signature(q, k, v, g, initial_state, cfg, groups, feature_map=feature_map,
                                                   scale=scale, gates=gates is not None,
                                                   deterministic=deterministic), mesh, q.device)
    qs = apply_feature_map(q, feature_map) * (q.shape[-1] ** -0.5 if scale is None else scale)
    ks = apply_feature_map(k, feature_map)
    if g is not None and g.dim() == 1:                         # constant decay: a (B, L, H) view, grads sum back
        g = g.view(1, 1, -1).expand(q.shape[0], q.shape[1], -1)
    o, final = module.attention(qs, ks, v, g, initial_state, cfg, groups)
    return (o, final) if output_final_state else o


def _config(module: ModuleType, *, layout, causal, chunk_size, kernel, cu_seqlens, seq_len, grad_dtype,
            output_final_state, initial_state, g, deterministic=False) -> LinearConfig:
    name, rs = module.NAME, rank_suffix()
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}{rs}")
    if layout not in module.LAYOUTS:
        raise ValueError(f"layout must be one of {list(module.LAYOUTS)} for method={name!r}, got {layout!r}{rs}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}{rs}")
    if kernel not in available_linear_kernels():
        raise ValueError(f"kernel must be one of {available_linear_kernels()}, got {kernel!r}{rs}")
    need = {"noncausal": not causal, "varlen": cu_seqlens is not None, "padding": seq_len is not None,
            "initial_state": initial_state is not None, "final_state": bool(output_final_state)}
    for feature, used in need.items():
        if used and feature not in module.FEATURES:
            raise NotImplementedError(f"{feature} must be used with method='lasp2' ({name} does not support it), "
                                      f"got method={name!r}{rs}")
    if not causal:
        for what, given in (("decay/gates", g is not None), ("initial_state", initial_state is not None),
                            ("output_final_state", bool(output_final_state))):
            if given:
                raise NotImplementedError(f"{what} must be used with causal=True (a decayed or stateful non-causal "
                                          f"linear attention is not defined), got causal=False{rs}")
    if initial_state is not None and cu_seqlens is not None:
        raise NotImplementedError(f"initial_state must be None with cu_seqlens (one state per document is not "
                                  f"supported), got both{rs}")
    return LinearConfig(method=name, layout=layout, causal=causal, chunk_size=chunk_size, kernel=kernel,
                        cu_seqlens=host_cu_seqlens(cu_seqlens), seq_len=seq_len, grad_dtype=grad_dtype,
                        output_final_state=bool(output_final_state), has_initial_state=initial_state is not None,
                        deterministic=deterministic)


def _check_tensor(name: str, t: Any, shape: tuple[int, ...], like: torch.Tensor, rs: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}{rs}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {t.dtype}{rs}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}{rs}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on q's device {like.device}, got {t.device}{rs}")


def _validate_inputs(q, k, v, g, per_dim: bool, h0, cfg: LinearConfig, groups: SeqParallelGroups, module,
                     scale, feature_map) -> None:
    """Every check that needs only local facts; the same error on every rank given the same input."""
    rs = rank_suffix()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}{rs}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4D (batch, seq_local, heads, head_dim), got shape {tuple(t.shape)}{rs}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}{rs}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}{rs}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}{rs}")
    (B, L, H, K), V = q.shape, v.shape[-1]
    if k.shape[:2] != (B, L) or v.shape[:2] != (B, L):
        raise ValueError(f"q, k, v must share (batch, seq_local), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}{rs}")
    if k.shape[-1] != K:
        raise ValueError(f"q and k must have the same head_dim, got {K} and {k.shape[-1]}{rs}")
    if k.shape[2] != H or v.shape[2] != H:
        raise NotImplementedError(f"q, k, v must have the same number of heads (GQA is not supported for linear "
                                  f"attention), got {H}, {k.shape[2]}, {v.shape[2]}{rs}")
    if L == 0 or B == 0:
        raise ValueError(f"q must have at least one token and one batch row, got shape {tuple(q.shape)}{rs}")
    if g is not None:
        if per_dim:
            _check_tensor("gates", g, (B, L, H, K), q, rs)
        elif not isinstance(g, torch.Tensor) or g.dim() not in (1, 3):
            got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"decay must be a tensor of shape ({H},) or ({B}, {L}, {H}), got {got}{rs}")
        else:
            _check_tensor("decay", g, (H,) if g.dim() == 1 else (B, L, H), q, rs)
    if h0 is not None:
        _check_tensor("initial_state", h0, (B, H, K, V), q, rs)
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
        raise ValueError(f"scale must be a positive float or None, got {scale!r}{rs}")
    if not (feature_map is None or callable(feature_map) or feature_map in FEATURE_MAPS):
        raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)}, a callable or None, got "
                         f"{feature_map!r}{rs}")
    layout, _ = module.placement(cfg.layout, groups)
    total = L * groups.world
    if total % layout.divisor:
        raise ValueError(f"local sequence length must be such that {groups.world} * seq_local is a multiple of "
                         f"{layout.divisor} for the {cfg.layout} layout over {groups.world} ranks, got {L}{rs}")
    valid = cfg.valid_len
    if valid is not None and not 0 < valid <= total:
        raise ValueError(f"seq_len / cu_seqlens[-1] must be in [1, {total}] (the global length), got {valid}{rs}")
    if cfg.seq_len is not None and cfg.cu_seqlens is not None and cfg.cu_seqlens[-1] != cfg.seq_len:
        raise ValueError(f"cu_seqlens must end at seq_len={cfg.seq_len}, got {cfg.cu_seqlens[-1]}{rs}")
    if cfg.cu_seqlens is not None and cfg.seq_len is None and cfg.cu_seqlens[-1] != total:
        raise ValueError(f"cu_seqlens must end at the global length {total} (or pass seq_len for padded shards), "
                         f"got {cfg.cu_seqlens[-1]}{rs}")
