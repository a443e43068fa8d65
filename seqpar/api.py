"""The public entry points: ``attention``, ``verify``, ``shard``, ``unshard``, ``positions``, ``shard_info``.

Every call is validated once here (``_validate_inputs``), before any collective, with errors of the form
"X must Y, got Z (rank r of W)"; then the ranks agree on the call (one tiny collective, Note [Agreement
protocol] in ``seqpar.agreement``: a rank that differs or rejected the call is named on every rank, nobody
waits for it); then the method module runs. Inputs are the rank's local shards
``(batch, seq_local, heads, head_dim)`` in the method's token layout (``shard`` puts them there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import methods
from .config import AttentionConfig, balance_rule
from .errors import rank_suffix
from .groups import SeqParallelGroups
from .layouts import Layout
from .layouts.varlen import ShardInfo
from .layouts.varlen import shard_info as _shard_info
from .runtime import call as _call
from .runtime import op as _op
from .types import AttnOutput

__all__ = ["ShardInfo", "attention", "attention_config", "placement", "positions", "shard", "shard_info", "unshard",
           "verify"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh: Any = None, method: str = "ring",
              layout: str | None = None, causal: bool = True, softmax_scale: float | None = None,
              kernel: str = "auto", return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
              cu_seqlens: torch.Tensor | Sequence[int] | None = None, seq_len: int | None = None,
              deterministic: bool = False, grad_dtype: torch.dtype = torch.float32, dropout_p: float = 0.0,
              alibi_slopes: torch.Tensor | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
              check_ranks: bool | int = True, verify: bool = False, graphs: bool | None = None,
              mask_mod: Any = None, balance: str | None = None, **options: Any) -> torch.Tensor | AttnOutput:
    """Sequence-parallel softmax attention over the ranks of ``mesh``.

    Args:
        q: local queries ``(B, L, H, D)``, this rank's tokens in the method's layout.
        k: local keys ``(B, L, Hkv, D)``; ``H % Hkv == 0`` (GQA/MQA, never replicated).
        v: local values ``(B, L, Hkv, Dv)``; the value head dim may differ from the key head dim (MLA).
        mesh: a DeviceMesh (2D with dims "ulysses", "ring" for ``usp``), a ProcessGroup, or None for the
            default group.
        method: one of ``seqpar.methods.available()``, or "auto": the planner's choice among the available
            methods that accept ``layout`` and the mesh (``seqpar.planner.choose``, the same on every rank,
            logged on "seqpar.planner"); with "auto" the options are ``profile=`` (a
            ``seqpar.planner.Profile``, built-in name or JSON path; default: the device's built-in one) and
            ``transport="copy_engine"``, which lets auto rank the ring on copy engines too (Note [Copy-engine
            ring] in ``seqpar.comm.symmetric``; planned where the profile measured them, within one host).
        layout: a plain layout ("contiguous", "zigzag", "stripe") or a per-batch document layout ("balanced",
            "balanced_whole", "doc_contiguous", "doc_zigzag": tokens placed from ``cu_seqlens``); each method
            accepts a subset.
            None means the method's default (zigzag where it has it), the same rule in every function.
        causal: causal masking in global token positions.
        softmax_scale: default ``D ** -0.5``.
        kernel: "auto" or a name from ``seqpar.kernels.available_kernels()``; a named kernel that cannot
            serve the input raises with the reasons; "auto" never picks the reference kernel on a GPU and warns
            once when it settles for a slower kernel than the fastest one for the device and dtype.
        return_lse: also return the fp32 natural-log lse ``(B, H, L)`` (differentiable at kernel speed).
        window_size: sliding window ``(left, right)`` in global positions, -1 = unbounded.
        cu_seqlens: global document boundaries (int32, 0 first, total last): packed documents never
            attend across boundaries. A CUDA tensor costs one host read per call; pass a CPU tensor or a list.
        seq_len: the valid global length when the shards carry end padding (``shard(..., pad=True)``).
        deterministic: bitwise-reproducible results (deterministic kernels, fixed reduction orders).
        grad_dtype: dtype of gradient partials on the wire (fp32 default; bf16 halves the bytes; running sums
            stay fp32).
        dropout_p, alibi_slopes: not supported yet; non-default values raise.
        softcap: Gemma-2 score capping ``softcap * tanh(s / softcap)`` (> 0), on kernels that serve it (flex,
            flash_attn, flash_attn3, reference); others refuse with their reasons.
        sinks: ``(H,)`` attention-sink logits (gpt-oss): one learned logit per query head joining every row's
            softmax denominator once (Note [Attention sinks] in ``seqpar.numerics``); differentiable. Its
            gradient is this rank's share: reduce it over the sequence-parallel group like any parameter's.
        check_ranks: the agreement round (Note [When the round is read] in ``seqpar.agreement``): a tiny
            collective that makes ranks making different calls raise the same clear error instead of hanging.
            It runs on a group's first call and then by a per-group call counter (the same on every rank):
            ``True`` every 64 calls, an int N every N calls (``1``: every call, read before any method
            collective); on NCCL it is read lazily, so a disagreement raises on every rank within N calls and
            steady state adds no host stall. ``False`` skips it - only on EVERY rank at once (required inside a
            CUDA graph capture). The value must be the same on every rank.
        verify: after the call, recompute a sample of heads and rows densely and raise
            ``VerificationError`` if the error exceeds the tolerance (Note [Verify mode] in
            ``seqpar.verification``; a collective; use ``verify=(step % N == 0)`` on every rank).
        graphs: run the planned call's forward and backward as CUDA graphs (Note [Graphed calls] in
            ``seqpar.runtime.graphs``): the host cost of a call becomes one replay. None (auto): on CUDA with
            several ranks and at most ``GRAPH_ROWS`` (8192) local rows - the short chunks where a call is
            host-bound; a packed batch's graphs go when the next batch's plan is made (Note [Graphed batches]);
            True: always (CUDA only); False: never. A capture that fails raises (pass False). Graphed calls ran on
            NCCL over four H200s (the real W = 4 bench, 2026-11-26); their values are checked against eager calls
            at W = 1 on NCCL (``tests/test_gpu_runtime.py``).
            Not inside another capture (``torch.compile(mode="reduce-overhead")``): there the call is captured
            with the caller's graph; auto is off for every call from a compiled model (Note [Graphs under
            compile]).
        mask_mod: a named mask from ``seqpar.masks`` (``chunked``, ``spans``, ``prefix_lm``, ``block_causal``,
            ``shared_prefix``, ``tree``, ``sink_window``: block structure declared, every block on a dense
            kernel) or a flex-style ``fn(b, h, q_idx, kv_idx) -> bool`` on GLOBAL positions (evaluated once per
            planned call, partly visible blocks on flex / the reference kernel; it must not read ``b`` or ``h``).
            ANDed with ``causal``, ``window_size``, ``cu_seqlens`` and padding. A plan is cached per function
            object and version of the tensors it captures (refilling one in place plans again); pass the same
            function on every rank, with its tables in its closure (a global tensor is not seen).
        balance: with ``layout="balanced"`` and a named mask, None balances the keys each query sees under the
            mask (``seqpar.shard`` must get the same ``mask_mod``); "causal" balances causal work whatever the mask,
            so layers with different masks share one placement (``seqpar.shard`` without ``mask_mod``).
        **options: method-specific options (``seqpar.methods.get(method).options``).

    Returns:
        ``out (B, L, H, Dv)`` in q's dtype, or ``AttnOutput(out, lse)`` with ``return_lse``.
    """
    if torch.compiler.is_compiling():
        return _traced(q, k, v, mesh, method, layout, causal, softmax_scale, kernel, return_lse, window_size,
                       cu_seqlens, seq_len, deterministic, grad_dtype, dropout_p, alibi_slopes, softcap, sinks,
                       check_ranks, verify, options, graphs, mask_mod, balance)
    plan = _call.planned(q, k, v, sinks, mesh=mesh, method=method, layout=layout, causal=causal,
                         softmax_scale=softmax_scale, kernel=kernel, return_lse=return_lse, window_size=window_size,
                         cu_seqlens=cu_seqlens, seq_len=seq_len, deterministic=deterministic, grad_dtype=grad_dtype,
                         dropout_p=dropout_p, alibi_slopes=alibi_slopes, softcap=softcap, check_ranks=check_ranks,
                         verify=verify, options=options, graphs=graphs, mask_mod=mask_mod, balance=balance)
    out, lse = _op.run(plan, q, k, v, sinks)
    if verify:
        from . import verification

        with torch.no_grad():
            verification.check_sample(q, k, v, out, lse, plan.cfg, plan.groups, plan.method, mesh, sinks=sinks)
    return AttnOutput(out, lse) if return_lse else out


def _traced(q, k, v, mesh, method, layout, causal, softmax_scale, kernel, return_lse, window_size, cu_seqlens,
            seq_len, deterministic, grad_dtype, dropout_p, alibi_slopes, softcap, sinks, check_ranks, verify, options,
            graphs, mask_mod, balance):
    """``attention`` under ``torch.compile``: one custom op (Note [Tracing seqpar.attention] in runtime.op)."""
    if dropout_p or alibi_slopes is not None or verify:
        raise NotImplementedError(f"dropout_p, alibi_slopes and verify=True are not supported under torch.compile"
                                  f"{rank_suffix()}")
    from .masks import PieceMask

    if mask_mod is not None and not isinstance(mask_mod, PieceMask):
        raise NotImplementedError(f"mask_mod under torch.compile must be a named mask from seqpar.masks (a function "
                                  f"cannot be keyed across processes), got {mask_mod!r}{rank_suffix()}")
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.tensor(list(cu_seqlens), dtype=torch.int32)
    key = _call.traced_key(mesh, method, layout, causal, softmax_scale, kernel, tuple(window_size), seq_len,
                           deterministic, grad_dtype, float(softcap), check_ranks, tuple(sorted(options.items())),
                           graphs, None if mask_mod is None else mask_mod.spec(), balance)
    out, lse, _ = _op.attention_op(q, k, v, sinks, cu_seqlens, key)
    return AttnOutput(out, lse) if return_lse else out


def attention_config(method: str = "ring", *, layout: str | None = None, causal: bool = True,
                     softmax_scale: float | None = None, kernel: str = "auto",
                     window_size: tuple[int, int] = (-1, -1), cu_seqlens: Sequence[int] | None = None,
                     seq_len: int | None = None, deterministic: bool = False, grad_dtype: torch.dtype = torch.float32,
                     softcap: float = 0.0, mask_mod: Any = None, balance: str | None = None,
                     **options: Any) -> AttentionConfig:
    """The validated ``AttentionConfig`` of a ``seqpar.attention`` call to ``method`` (no tensors needed):
    what ``SequenceParallelAttention`` and the integrations check at construction time."""
    m = methods.get(method)
    return _call.config(m, layout=layout or m.default_layout(), causal=causal, softmax_scale=softmax_scale,
                        kernel=kernel, window_size=window_size, cu_seqlens=cu_seqlens, seq_len=seq_len,
                        deterministic=deterministic, grad_dtype=grad_dtype, softcap=softcap, options=options,
                        mask_mod=mask_mod, balance=balance)


def verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None = None, *,
           mesh: Any = None, method: str = "ring", layout: str | None = None, causal: bool = True,
           softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
           cu_seqlens: torch.Tensor | Sequence[int] | None = None, seq_len: int | None = None,
           softcap: float = 0.0, sinks: torch.Tensor | None = None, heads: int = 2, rows: int = 256, seed: int = 0,
           tolerance: float | None = None, raise_on_error: bool = True, mask_mod: Any = None,
           balance: str | None = None, **options: Any):
    """Check a distributed attention result against a dense recomputation of a sample (Note [Verify mode]).

    Call it on every rank with the local shards and the arguments of the ``attention`` call that produced
    ``out`` (and ``lse``, if returned). ``heads`` query heads and ``rows`` global query rows are sampled
    from ``seed`` (identical on every rank), gathered, and recomputed in fp64; the tolerance is the test
    suite's rule (``seqpar.tolerances``) unless ``tolerance`` fixes one.

    Returns:
        A ``VerifyReport``; raises ``VerificationError`` on every rank when any field exceeds its limit
        (unless ``raise_on_error=False``).
    """
    from . import verification

    def sample_args() -> None:
        for name, value, lo in (("heads", heads, 1), ("rows", rows, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}{rank_suffix()}")
        if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance > 0):
            raise ValueError(f"tolerance must be a positive float or None, got {tolerance!r}{rank_suffix()}")
        if method == "auto":
            raise ValueError(f"method must be the method that produced out (not 'auto'), got 'auto'"
                             f"{rank_suffix()}")
        _check_result(q, k, v, out, lse)

    m, cfg, groups, _, _ = _call.validated(
        q, k, v, sinks, mesh=mesh, method=method, layout=layout, causal=causal, softmax_scale=softmax_scale,
        kernel="auto", window_size=window_size, cu_seqlens=cu_seqlens, seq_len=seq_len, deterministic=False,
        grad_dtype=torch.float32, dropout_p=0.0, alibi_slopes=None, softcap=softcap, options=options, grad=False,
        mask_mod=mask_mod, balance=balance,
        extra=sample_args, flags={"verify_out": _shape(out), "verify_lse": _shape(lse),
                                  "sample": (heads, rows, seed, tolerance)})
    with torch.no_grad():
        return verification.check_sample(q, k, v, out, lse, cfg, groups, m, mesh, heads=heads, rows=rows,
                                         seed=seed, tolerance=tolerance, raise_on_error=raise_on_error, sinks=sinks)


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _check_result(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: Any, lse: Any) -> None:
    """``out`` / ``lse`` of ``verify``."""
    B, L, H, _ = q.shape
    want = (B, L, H, v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() == 4 else tuple(q.shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        raise ValueError(f"out must be a tensor of shape {want}, got {_shape(out) or type(out).__name__}"
                         f"{rank_suffix()}")
    if lse is not None and (not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, H, L)):
        raise ValueError(f"lse must be a tensor of shape {(B, H, L)} or None, got "
                         f"{_shape(lse) or type(lse).__name__}{rank_suffix()}")


def placement(mesh: Any = None, method: str = "ring", layout: str | None = None,
              cu_seqlens: torch.Tensor | Sequence[int] | None = None, *, causal: bool = True,
              mask_mod: Any = None) -> tuple[Layout, int, SeqParallelGroups]:
    """``(layout, this rank's piece, groups)`` of ``method``/``layout`` on ``mesh``: where tokens live.

    Every name ``attention`` or ``linear_attention`` accepts works ("auto" places tokens as the ring does on a
    1D mesh and as USP on a 2D one: auto never re-shards). ``layout=None`` is the method's default.
    Document layouts ("balanced", "balanced_whole", "doc_contiguous", "doc_zigzag") need the batch's ``cu_seqlens``.
    ``causal`` and ``mask_mod`` matter only to "balanced" with a named mask, which balances the keys each query
    sees under them: pass the attention call's values (Note [Balanced layout]).
    """
    if method == "auto":
        method = "usp" if getattr(mesh, "ndim", 1) == 2 else "ring"
    from .linear_api import get_linear_method, linear_methods

    if method in linear_methods():
        mod = get_linear_method(method)
        layout = layout or mod.LAYOUTS[0]
        if layout not in mod.LAYOUTS:
            raise ValueError(f"layout must be one of {list(mod.LAYOUTS)} for method={method!r}, got {layout!r}"
                             f"{rank_suffix()}")
        groups = SeqParallelGroups.resolve(mesh, mod.MESH_DIMS)
        lay, index = mod.placement(layout, groups)
        return lay, index, groups
    try:
        m = methods.get(method)
    except ValueError:
        raise ValueError(f"method must be one of {methods.available() + linear_methods()} or 'auto', got "
                         f"{method!r}{rank_suffix()}") from None
    layout = layout or m.default_layout()
    groups = SeqParallelGroups.resolve(mesh, m.mesh_dims)
    if layout not in m.layouts:
        raise ValueError(f"layout must be one of {list(m.layouts)} for method={method!r}, got {layout!r}"
                         f"{rank_suffix()}")
    try:
        lay, index = m.placement(layout, groups, _call.host_cu_seqlens(cu_seqlens),
                                 balance_rule(layout, causal, mask_mod))
    except ValueError as e:
        raise ValueError(f"{e}{rank_suffix()}") from None
    return lay, index, groups


def placement_divisor(mesh: Any, method: str, layout: str | None = None,
                      cu_seqlens: Sequence[int] | None = None) -> int:
    """The multiple the global length must be for ``method``/``layout`` on ``mesh`` (pad to it otherwise)."""
    return placement(mesh, method, layout, cu_seqlens)[0].divisor


def shard(x: torch.Tensor, *, mesh: Any = None, method: str = "ring", layout: str | None = None, dim: int = 1,
          pad: bool = False, cu_seqlens: torch.Tensor | Sequence[int] | None = None, causal: bool = True,
          mask_mod: Any = None) -> torch.Tensor:
    """This rank's tokens of the global tensor ``x`` (a copy), in the method's layout.

    A length the layout cannot split raises, saying the length needed; with ``pad=True`` the end is
    zero-padded to it instead, and ``attention`` must then get ``seq_len=<the true length>``. Document
    layouts need the batch's global ``cu_seqlens``; "balanced" with a named ``mask_mod`` places by the work under
    it and ``causal``: pass the attention call's values here too (``placement``).
    """
    lay, index, _ = placement(mesh, method, layout, cu_seqlens, causal=causal, mask_mod=mask_mod)
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
            dim: int = 1, seq_len: int | None = None,
            cu_seqlens: torch.Tensor | Sequence[int] | None = None, causal: bool = True,
            mask_mod: Any = None) -> torch.Tensor:
    """The global tensor from every rank's shard (a collective: call it on every rank).

    ``seq_len`` drops end padding added by ``shard(..., pad=True)``; ``causal``, ``mask_mod`` as for ``shard``.
    """
    lay, _, groups = placement(mesh, method, layout, cu_seqlens, causal=causal, mask_mod=mask_mod)
    full = lay.unshard(groups.all_gather(x), dim)
    return full if seq_len is None else full.narrow(dim, 0, seq_len)


def positions(seq_len: int, *, mesh: Any = None, method: str = "ring", layout: str | None = None,
              device: torch.device | str | None = None,
              cu_seqlens: torch.Tensor | Sequence[int] | None = None, causal: bool = True,
              mask_mod: Any = None) -> torch.Tensor:
    """Global positions of this rank's tokens, int64 ``(L,)``, in local order (for RoPE; ``causal``,
    ``mask_mod`` as for ``shard``)."""
    lay, index, _ = placement(mesh, method, layout, cu_seqlens, causal=causal, mask_mod=mask_mod)
    try:
        lay.check_len(seq_len)
    except ValueError as e:
        raise ValueError(f"{e}{rank_suffix()}") from None
    return lay.positions(index, seq_len, device)


def shard_info(seq_len: int, *, mesh: Any = None, method: str = "ring", layout: str | None = None,
               cu_seqlens: torch.Tensor | Sequence[int] | None = None,
               device: torch.device | str | None = None, causal: bool = True, mask_mod: Any = None) -> ShardInfo:
    """This rank's global positions, positions inside documents (RoPE), local segments and pad mask.

    A separate function rather than ``shard(..., return_info=True)``: the facts depend on the batch's
    structure (length, documents, placement), not on any one tensor, so they are computed once per batch
    and can be had before the tensors exist (position ids feed the embedding); ``shard`` stays a
    tensor-in, tensor-out function called once per tensor.

    Args:
        seq_len: the valid global length; when the layout cannot split it, the shards are padded at the end
            to ``info.padded_len`` (``shard(x, pad=True)``) and ``attention`` needs ``seq_len=seq_len``.
        mesh, method, layout: as for ``shard`` (``layout=None``: the method's default).
        cu_seqlens: global document boundaries (0 first, ``seq_len`` last); None = one document.
        device: where the returned tensors live.
        causal, mask_mod: as for ``shard`` ("balanced" with a named mask places by its work).

    Returns:
        ``ShardInfo`` (``seqpar.layouts.varlen``): ``positions``, ``positions_in_document``, ``documents``,
        ``pad_mask`` (each ``(L,)`` in local row order), the local ``cu_seqlens`` (int32) and the lengths.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}{rank_suffix()}")
    cu = _call.host_cu_seqlens(cu_seqlens)
    lay, index, _ = placement(mesh, method, layout, cu, causal=causal, mask_mod=mask_mod)
    try:
        return _shard_info(lay, index, seq_len, cu, device)
    except ValueError as e:
        raise ValueError(f"{e}{rank_suffix()}") from None


def _choose(groups: SeqParallelGroups, dims: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
            causal: bool, window: tuple[int, int], cu_seqlens: Any, kernel: str, grad_dtype: torch.dtype,
            options: dict[str, Any], grad: bool, features: list[str], mask: Any = None) -> tuple[str, dict[str, Any]]:
    """``method="auto"``: the planner's choice (the planner is imported only when asked for; the runtime reaches
    it through ``runtime.call.CHOOSE``, so it imports no planner)."""
    from . import planner
    from .comm.link import auto_profile

    profile = options.get("profile") or auto_profile(groups, q.device)
    name, chosen, _ = planner.choose(
        tuple(q.shape), k.shape[2], causal, window, groups.world, dims, layout, profile,
        ulysses=groups.ulysses_size if dims == 2 else None, dtype=q.dtype, device=q.device.type,
        mode="fwd+bwd" if grad else "fwd", features=features, kernel=kernel, grad_dtype=grad_dtype,
        cu_seqlens=cu_seqlens, transports=tuple(dict.fromkeys(("nccl", options.get("transport", "nccl")))),
        mask=mask)
    return name, chosen


_call.CHOOSE = _choose
