"""The public entry points: ``attention``, ``verify``, ``shard``, ``unshard``, ``positions``, ``shard_info``.

Every call is validated once here (``_validate_inputs``), before any collective, with errors of the form
"X must Y, got Z (rank r of W)"; then the ranks agree on the call (one tiny collective, Note [Agreement
protocol] in ``seqpar.agreement``: a rank that differs or rejected the call is named on every rank, nobody
waits for it); then the method module runs. Inputs are the rank's local shards
``(batch, seq_local, heads, head_dim)`` in the method's token layout (``shard`` puts them there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import agreement, methods, planner, verification
from .config import AttentionConfig
from .errors import rank_suffix
from .groups import SeqParallelGroups
from .kernels import available_kernels
from .layouts import LAYOUTS
from .layouts.varlen import ShardInfo
from .layouts.varlen import shard_info as _shard_info
from .types import AttnOutput

__all__ = ["ShardInfo", "attention", "positions", "shard", "shard_info", "unshard", "verify"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Any = None, method: str = "ring",
              layout: str | None = None, causal: bool = True, softmax_scale: float | None = None,
              kernel: str = "auto", return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
              cu_seqlens: torch.Tensor | Sequence[int] | None = None, seq_len: int | None = None,
              deterministic: bool = False, grad_dtype: torch.dtype = torch.float32, dropout_p: float = 0.0,
              alibi_slopes: torch.Tensor | None = None, softcap: float = 0.0, check_ranks: bool = True,
              verify: bool = False, **options: Any) -> torch.Tensor | AttnOutput:
    """Sequence-parallel softmax attention over the ranks of ``mesh``.

    Args:
        q: local queries ``(B, L, H, D)``, this rank's tokens in the method's layout.
        k, v: local keys and values ``(B, L, Hkv, D)``; ``H % Hkv == 0`` (GQA/MQA, never replicated).
        mesh: a DeviceMesh (2D with dims "ulysses", "ring" for ``usp``), a ProcessGroup, or None for the
            default group.
        method: one of ``seqpar.methods.available()``, or "auto": the planner's choice among the available
            methods that accept ``layout`` and the mesh (``seqpar.planner.choose``, the same on every rank,
            logged on "seqpar.planner"); with "auto" the only option is ``profile=`` (a
            ``seqpar.planner.Profile``, built-in name or JSON path; default: the device's built-in one).
        layout: "contiguous", "zigzag" or "stripe" (each method accepts a subset); None means zigzag where
            the method has it (ring, usp, ...), else the method's only layout (ulysses: contiguous).
        causal: causal masking in global token positions.
        softmax_scale: default ``D ** -0.5``.
        kernel: "auto" or a name from ``seqpar.kernels.available_kernels()``; a named kernel that cannot
            serve the input raises with the reasons.
        return_lse: also return the fp32 natural-log lse ``(B, H, L)`` (differentiable).
        window_size: sliding window ``(left, right)`` in global positions, -1 = unbounded.
        cu_seqlens: global document boundaries (int32, 0 first, total last): packed documents never
            attend across boundaries. A CUDA tensor costs one host read per call; pass a CPU tensor or a list.
        seq_len: the valid global length when the shards carry end padding (``shard(..., pad=True)``).
        deterministic: bitwise-reproducible results (deterministic kernels, fixed reduction orders).
        grad_dtype: dtype of gradient partials on the wire (fp32 default; bf16 halves the bytes).
        dropout_p, alibi_slopes, softcap: not supported yet; non-default values raise.
        check_ranks: run the agreement round (Note [Agreement protocol] in ``seqpar.agreement``): one tiny
            collective per call, so that ranks making different calls (or a rank rejecting its input) raise
            a clear error on every rank instead of hanging. ``False`` skips it - only on EVERY rank at once
            (e.g. ``check_ranks=(step % N == 0)`` where the round's cost matters, Note [Cost of the round]).
        verify: after the call, recompute a sample of heads and rows densely and raise
            ``VerificationError`` if the error exceeds the tolerance (Note [Verify mode] in
            ``seqpar.verification``; a collective; use ``verify=(step % N == 0)`` on every rank).
        **options: method-specific options (``seqpar.methods.get(method).OPTIONS``).

    Returns:
        ``out (B, L, H, D)`` in q's dtype, or ``AttnOutput(out, lse)`` with ``return_lse``.
    """
    args = dict(layout=layout, causal=causal, softmax_scale=softmax_scale, kernel=kernel, window_size=window_size,
                cu_seqlens=cu_seqlens, seq_len=seq_len, deterministic=deterministic, grad_dtype=grad_dtype,
                dropout_p=dropout_p, alibi_slopes=alibi_slopes, softcap=softcap)
    module, cfg, groups = _agreed(q, k, v, mesh, method, args, options, check_ranks,
                                  return_lse=bool(return_lse), verify=verify)
    res = module.attention(q, k, v, cfg, groups)
    if verify:
        with torch.no_grad():
            verification.check_sample(q, k, v, res.out, res.lse, cfg, groups, module, mesh)
    return res if return_lse else res.out


def verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None = None, *,
           mesh: Any = None, method: str = "ring", layout: str = "zigzag", causal: bool = True,
           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
           cu_seqlens: torch.Tensor | Sequence[int] | None = None, seq_len: int | None = None, heads: int = 2,
           rows: int = 256, seed: int = 0, tolerance: float | None = None, raise_on_error: bool = True,
           **options: Any) -> verification.VerifyReport:
    """Check a distributed attention result against a dense recomputation of a sample (Note [Verify mode]).

    Call it on every rank with the local shards and the arguments of the ``attention`` call that produced
    ``out`` (and ``lse``, if returned). ``heads`` query heads and ``rows`` global query rows are sampled
    from ``seed`` (identical on every rank), gathered, and recomputed in fp64; the tolerance is the test
    suite's rule (``seqpar.testing.tolerances``) unless ``tolerance`` fixes one.

    Returns:
        A ``VerifyReport``; raises ``VerificationError`` on every rank when any field exceeds its limit
        (unless ``raise_on_error=False``).
    """
    def sample_args() -> None:
        for name, value, lo in (("heads", heads, 1), ("rows", rows, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}{rank_suffix()}")
        if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance > 0):
            raise ValueError(f"tolerance must be a positive float or None, got {tolerance!r}{rank_suffix()}")
        if method == "auto":
            raise ValueError(f"method must be the method that produced out (not 'auto'), got 'auto'"
                             f"{rank_suffix()}")

    args = dict(layout=layout, causal=causal, softmax_scale=softmax_scale, kernel="auto", window_size=window_size,
                cu_seqlens=cu_seqlens, seq_len=seq_len, deterministic=False, grad_dtype=torch.float32,
                dropout_p=0.0, alibi_slopes=None, softcap=0.0)
    module, cfg, groups = _agreed(q, k, v, mesh, method, args, options, True, extra=sample_args,
                                  verify_out=_shape(out), verify_lse=_shape(lse), sample=(heads, rows, seed, tolerance))
    _check_result(q, k, out, lse)
    with torch.no_grad():
        return verification.check_sample(q, k, v, out, lse, cfg, groups, module, mesh, heads=heads, rows=rows,
                                         seed=seed, tolerance=tolerance, raise_on_error=raise_on_error)


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _check_result(q: torch.Tensor, k: torch.Tensor, out: Any, lse: Any) -> None:
    """``out`` / ``lse`` of ``verify`` (after agreement: the shapes agree across ranks, so this is uniform)."""
    B, L, H, _ = q.shape
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        raise ValueError(f"out must be a tensor of q's shape {tuple(q.shape)}, got {_shape(out) or type(out).__name__}"
                         f"{rank_suffix()}")
    if lse is not None and (not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, H, L)):
        raise ValueError(f"lse must be a tensor of shape {(B, H, L)} or None, got "
                         f"{_shape(lse) or type(lse).__name__}{rank_suffix()}")


def _agreed(q, k, v, mesh, method: str, args: dict[str, Any], options: dict[str, Any], check_ranks: Any,
            extra: Callable[[], None] | None = None, **flags: Any):
    """Local validation, then the agreement round: ``(module, cfg, groups)`` or an error on every rank.

    A rank whose validation fails still joins the round (``agreement.share_error``) so the others raise
    too, naming it, instead of waiting in the method's first collective (Note [Agreement protocol]).
    """
    try:
        if extra is not None:
            extra()
        if not isinstance(check_ranks, bool):
            raise TypeError(f"check_ranks must be a bool, got {check_ranks!r}{rank_suffix()}")
        if not isinstance(flags.get("verify", False), bool):
            raise TypeError(f"verify must be a bool, got {flags['verify']!r}{rank_suffix()}")
        if method == "auto":
            args["layout"] = args["layout"] or "zigzag"
            method, options = _auto(q, k, v, mesh, args["layout"], args["causal"], args["window_size"],
                                    args["cu_seqlens"], args["seq_len"], args["kernel"], args["grad_dtype"], options)
        module = methods.get(method)
        args["layout"] = args["layout"] or default_layout(module)
        cfg = _config(module, **args, options=options)
        groups = SeqParallelGroups.resolve(mesh, module.MESH_DIMS)
        _validate_inputs(q, k, v, cfg, groups, module)
    except Exception as err:    # every rank must hear of it; re-raised unchanged below
        if check_ranks is not False:
            agreement.share_error(err, mesh)
        raise
    if check_ranks:
        agreement.check(agreement.attention_signature(q, k, v, cfg, groups, **flags), mesh, q.device)
    return module, cfg, groups


def _auto(q, k, v, mesh, layout, causal, window_size, cu_seqlens, seq_len, kernel, grad_dtype, options):
    """``method="auto"``: (method, options) from the planner (Note [Auto is deterministic] in planner.search)."""
    extra = sorted(set(options) - {"profile"})
    if extra:
        raise TypeError(f"method='auto' takes only the option 'profile' (it picks the method's options), got "
                        f"{extra}{rank_suffix()}")
    _check_tensors(q, k, v)
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    AttentionConfig(window_size=window)                        # validates the window before planning with it
    dims = 2 if getattr(mesh, "ndim", 1) == 2 else 1
    groups = SeqParallelGroups.resolve(mesh, dims)
    used = {"window": window != (-1, -1), "varlen": cu_seqlens is not None, "padding": seq_len is not None}
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    name, chosen, _ = planner.choose(
        tuple(q.shape), k.shape[2], bool(causal), window, groups.world, dims, layout, options.get("profile"),
        ulysses=groups.ulysses_size if dims == 2 else None, dtype=q.dtype, device=q.device.type,
        mode="fwd+bwd" if grad else "fwd", features=[f for f, on in used.items() if on], kernel=kernel,
        grad_dtype=grad_dtype)
    return name, chosen


def _config(module, *, layout, causal, softmax_scale, kernel, window_size, cu_seqlens, seq_len, deterministic,
            grad_dtype, dropout_p, alibi_slopes, softcap, options) -> AttentionConfig:
    name = module.NAME
    unsupported = {"dropout_p": (dropout_p, dropout_p != 0.0), "alibi_slopes": (alibi_slopes, alibi_slopes is not None),
                   "softcap": (softcap, softcap != 0.0)}
    for arg, (value, given) in unsupported.items():
        if given:
            raise NotImplementedError(f"{arg} is not supported yet (it needs position-keyed handling in every "
                                      f"schedule); got {arg}={value!r}{rank_suffix()}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}{rank_suffix()}")
    if layout not in module.LAYOUTS:
        raise ValueError(f"layout must be one of {list(module.LAYOUTS)} for method={name!r}, got {layout!r}"
                         f"{rank_suffix()}")
    if kernel not in available_kernels():
        raise ValueError(f"kernel must be one of {available_kernels()}, got {kernel!r}{rank_suffix()}")
    unknown = sorted(set(options) - set(module.OPTIONS))
    if unknown:
        raise TypeError(f"method={name!r} takes options {sorted(module.OPTIONS) or 'none'}, got {unknown}"
                        f"{rank_suffix()}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}{rank_suffix()}")
    causal_ok = methods.causal_layouts(module)
    if causal and layout not in causal_ok:
        need = f"layout={causal_ok[0]!r}" if len(causal_ok) == 1 else f"a layout in {list(causal_ok)}"
        raise ValueError(f"method={name!r} with causal=True needs {need}, got layout={layout!r}{rank_suffix()}")
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    need = {"window": window != (-1, -1), "varlen": cu_seqlens is not None, "padding": seq_len is not None}
    for feature, used in need.items():
        if used and feature not in module.FEATURES:
            raise NotImplementedError(f"method={name!r} does not support {feature} yet{rank_suffix()}")
    return AttentionConfig(method=name, layout=layout, causal=causal, window_size=window,
                           softmax_scale=softmax_scale, kernel=kernel, cu_seqlens=_host_cu(cu_seqlens),
                           seq_len=seq_len, deterministic=deterministic, grad_dtype=grad_dtype,
                           options=AttentionConfig.pack_options(options))


def _host_cu(cu: torch.Tensor | Sequence[int] | None) -> tuple[int, ...] | None:
    if cu is None:
        return None
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be a 1D int32 tensor, got {cu.dtype} of shape {tuple(cu.shape)}"
                            f"{rank_suffix()}")
        return tuple(int(x) for x in cu.tolist())
    return tuple(int(x) for x in cu)


def _validate_inputs(q, k, v, cfg: AttentionConfig, groups: SeqParallelGroups, module) -> None:
    """Every check that needs only local facts; raises the same error on every rank given the same input."""
    rs = rank_suffix()
    _check_tensors(q, k, v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}{rs}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}{rs}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}{rs}")
    (B, L, H, D), (Bk, Lk, Hkv, Dk) = q.shape, k.shape
    if B != Bk:
        raise ValueError(f"q and k must have the same batch size, got {B} and {Bk}{rs}")
    if D != Dk:
        raise ValueError(f"q and k must have the same head_dim, got {D} and {Dk}{rs}")
    if L != Lk:
        raise ValueError(f"q and k must have the same local sequence length (self-attention), got {L} and {Lk}"
                         f"{rs}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"heads ({H}) must be a multiple of kv heads ({Hkv}) for GQA/MQA, got H={H}, Hkv={Hkv}{rs}")
    if L == 0 or B == 0:
        raise ValueError(f"q must have at least one token and one batch row, got shape {tuple(q.shape)}{rs}")
    layout, _ = module.placement(cfg.layout, groups)
    total = L * groups.world
    if total % layout.divisor:
        per = layout.divisor // groups.world if layout.divisor % groups.world == 0 else None
        hint = f"a multiple of {per}" if per else f"such that {groups.world} * seq_local is a multiple of " \
                                                  f"{layout.divisor}"
        raise ValueError(f"local sequence length must be {hint} for the {cfg.layout} layout of method="
                         f"{cfg.method!r} over {groups.world} ranks, got {L}{rs}")
    valid = cfg.valid_len
    if valid is not None and not 0 < valid <= total:
        raise ValueError(f"seq_len / cu_seqlens[-1] must be in [1, {total}] (the global length), got {valid}{rs}")
    if cfg.cu_seqlens is not None and cfg.seq_len is None and cfg.cu_seqlens[-1] != total:
        raise ValueError(f"cu_seqlens must end at the global length {total} (or pass seq_len for padded shards), "
                         f"got {cfg.cu_seqlens[-1]}{rs}")


def _check_tensors(q, k, v) -> None:
    rs = rank_suffix()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}{rs}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4D (batch, seq_local, heads, head_dim), got shape "
                             f"{tuple(t.shape)}{rs}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}{rs}")


def default_layout(module) -> str:
    """``layout=None``: zigzag (causally balanced) where the method has it, else its first layout."""
    return "zigzag" if "zigzag" in module.LAYOUTS else module.LAYOUTS[0]


def _placement(mesh: Any, method: str, layout: str | None):
    if method == "auto":            # auto keeps the layout: every 1D method places tokens as the ring does
        method = "usp" if getattr(mesh, "ndim", 1) == 2 else "ring"
    module = methods.get(method)
    layout = layout or default_layout(module)
    groups = SeqParallelGroups.resolve(mesh, module.MESH_DIMS)
    if layout not in module.LAYOUTS:
        raise ValueError(f"layout must be one of {list(module.LAYOUTS)} for method={method!r}, got {layout!r}"
                         f"{rank_suffix()}")
    lay, index = module.placement(layout, groups)
    return lay, index, groups


def placement_divisor(mesh: Any, method: str, layout: str | None = None) -> int:
    """The multiple the global length must be for ``method``/``layout`` on ``mesh`` (pad to it otherwise)."""
    return _placement(mesh, method, layout)[0].divisor


def shard(x: torch.Tensor, *, mesh: Any = None, method: str = "ring", layout: str | None = None, dim: int = 1,
          pad: bool = False) -> torch.Tensor:
    """This rank's tokens of the global tensor ``x`` (a copy), in the method's layout.

    A length the layout cannot split raises, saying the length needed; with ``pad=True`` the end is
    zero-padded to it instead, and ``attention`` must then get ``seq_len=<the true length>``.
    """
    lay, index, _ = _placement(mesh, method, layout)
    n = x.shape[dim]
    if n % lay.divisor:
        if not pad:
            try:
                lay.check_len(n)
            except ValueError as e:
                raise ValueError(f"{e}{rank_suffix()}") from None
        extra = -n % lay.divisor
        shape = list(x.shape)
        shape[dim] = extra
        x = torch.cat([x, x.new_zeros(shape)], dim)
    return lay.shard(x, index, dim)


def unshard(x: torch.Tensor, *, mesh: Any = None, method: str = "ring", layout: str | None = None,
            dim: int = 1, seq_len: int | None = None) -> torch.Tensor:
    """The global tensor from every rank's shard (a collective: call it on every rank).

    ``seq_len`` drops end padding added by ``shard(..., pad=True)``.
    """
    lay, _, groups = _placement(mesh, method, layout)
    full = lay.unshard(groups.all_gather(x), dim)
    return full if seq_len is None else full.narrow(dim, 0, seq_len)


def positions(seq_len: int, *, mesh: Any = None, method: str = "ring", layout: str | None = None,
              device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions of this rank's tokens, int64 ``(L,)``, in local order (for RoPE)."""
    lay, index, _ = _placement(mesh, method, layout)
    lay.check_len(seq_len)
    return lay.positions(index, seq_len, device)


def shard_info(seq_len: int, *, mesh: Any = None, method: str = "ring", layout: str = "zigzag",
               cu_seqlens: torch.Tensor | Sequence[int] | None = None,
               device: torch.device | str | None = None) -> ShardInfo:
    """This rank's global positions, positions inside documents (RoPE), local segments and pad mask.

    A separate function rather than ``shard(..., return_info=True)``: the facts depend on the batch's
    structure (length, documents, placement), not on any one tensor, so they are computed once per batch
    and can be had before the tensors exist (position ids feed the embedding); ``shard`` stays a
    tensor-in, tensor-out function called once per tensor.

    Args:
        seq_len: the valid global length; when the layout cannot split it, the shards are padded at the end
            to ``info.padded_len`` (``shard(x, pad=True)``) and ``attention`` needs ``seq_len=seq_len``.
        mesh, method, layout: as for ``shard``.
        cu_seqlens: global document boundaries (0 first, ``seq_len`` last); None = one document.
        device: where the returned tensors live.

    Returns:
        ``ShardInfo`` (``seqpar.layouts.varlen``): ``positions``, ``positions_in_document``, ``documents``,
        ``pad_mask`` (each ``(L,)`` in local row order), the local ``cu_seqlens`` (int32) and the lengths.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}{rank_suffix()}")
    lay, index, _ = _placement(mesh, method, layout)
    cu = _host_cu(cu_seqlens)
    try:
        return _shard_info(lay, index, seq_len, cu, device)
    except ValueError as e:
        raise ValueError(f"{e}{rank_suffix()}") from None

