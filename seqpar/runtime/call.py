"""The planned call: everything a call's signature fixes is computed once, kept in a bounded cache.

    plan = planned(q, k, v, sinks, mesh=..., method=..., ...)     # validation, placement, engine, on a miss
    out, lse = op.run(plan, q, k, v, sinks)                         # launches kernels and transfers only

Note [Planned calls]
    The signature is what the ranks must agree on and what fixes the work: tensor shapes, dtypes and devices,
    whether a backward follows, the mesh, the method and its options, the layout, the mask (causal, window,
    documents, valid length), the scale, the kernel, sinks and softcap, the wire dtype, the flags. On a miss
    the call is validated (every rule that needs only local facts, with errors naming the argument, the value
    and the rank), ``method="auto"`` is resolved, and the placement and the engine are built (block schedule,
    kernel per kind of block, the communication plan). A hit goes straight to the engine. Planning is linear
    in the documents (``seqpar.layouts.blocks``), since packed batches make a new signature per batch.

    The agreement round (``seqpar.agreement``, Note [When the round is read]) runs on the calls of a group with
    more than one rank whose per-group count is a multiple of the period ``check_ranks`` sets - hit or miss
    alike, since a miss is a local fact - and on the group's first call.

Note [Bounded plan cache]
    Plans are kept in two least-recently-used tiers under one byte budget. A signature with per-batch facts
    (``cu_seqlens`` or ``seq_len``: a packed or padded batch) is reused by every layer of one step, forward and
    backward, and then never again, so those plans live in a tier of ``BATCH_CACHE_SIZE`` entries: a batch's
    plan, with its schedule and the device index tensors of a selective gather (~20 MB at 1M tokens), goes
    a few batches after its step. Other signatures (one per layer shape and option set) keep ``CACHE_SIZE``
    entries. Every plan is entered with an estimate of the bytes it holds (``footprint``: the storages of the
    tensors its engine holds, once each, and its host structures by its documents and ranks); past
    ``CACHE_BYTES`` the least recently used plans go, per-batch ones first, never the plan just made. A plan
    in use is never broken by eviction: a call holds its plan (autograd keeps it for backward).

Note [Threads and the plan cache]
    Every read and write of the caches happens under ``_LOCK``, and nothing that can block or call back runs
    inside it: plans are built outside (two threads that miss on one signature both build; one is kept),
    and evicted plans are released after the lock is. A mesh's plans and agreement tracker go with the mesh,
    through a weakref finalizer - which may run inside any allocation, the locked section included, so it
    never takes the lock: it only records that a mesh died (``_DEAD``), and the next locked access drops the
    entries whose mesh is gone. Agreement rounds are collectives of a group, so one group's calls must come
    in the same order on every rank; different threads should use different groups.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from .. import agreement, methods
from ..comm import symmetric
from ..config import AttentionConfig
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..kernels import Kernel, available_kernels
from ..layouts import LAYOUTS
from ..masks import mod as _masks
from ..masks import named as _named
from ..memo import Same
from ..methods.base import Call, Engine, Method
from . import graphs as _graphs

__all__ = [
    "BATCH_CACHE_SIZE",
    "CACHE_BYTES",
    "CACHE_SIZE",
    "CHECK_EVERY",
    "CHOOSE",
    "Plan",
    "cache_clear",
    "cache_info",
    "config",
    "footprint",
    "host_cu_seqlens",
    "planned",
    "traced_key",
    "traced_plan",
    "traced_saved_meta",
    "validated",
]

#: plans of signatures without per-batch facts (Note [Bounded plan cache])
CACHE_SIZE = 256
#: plans of signatures with ``cu_seqlens`` or ``seq_len``: one per packed or padded batch, used for one step
BATCH_CACHE_SIZE = 8
#: the estimated bytes all cached plans may hold together
CACHE_BYTES = 1 << 30
#: ``check_ranks=True``: the round's period in calls of a group (Note [When the round is read])
CHECK_EVERY = 64


@dataclass(eq=False)
class Plan:
    """One planned call (Note [Planned calls])."""

    method: Method
    cfg: AttentionConfig
    groups: SeqParallelGroups
    call: Call
    engine: Engine
    items: agreement.Items
    return_lse: bool
    verify: bool
    direct: Any = None
    """``f(q, k, v) -> out`` when the whole call is one kernel call PyTorch differentiates (Note [Direct calls]
    in ``seqpar.kernels.base``): W = 1, out only, no sinks."""


_PLANS: OrderedDict[Any, tuple[Plan, int]] = OrderedDict()        # key -> (plan, bytes), least recent first
_BATCH_PLANS: OrderedDict[Any, tuple[Plan, int]] = OrderedDict()  # the same for per-batch signatures
_BYTES = 0                          # the bytes of both tiers' entries
_TRACKERS: dict[int | None, agreement.Tracker] = {}
_LOCK = threading.Lock()
_DEAD: list[int] = []               # ids of meshes that died since the last locked access (Note [Threads ...])
_MESH_AT = 11                       # the mesh's position in a plan key


def cache_clear() -> None:
    """Forget every planned call (tests; a process that changes process groups)."""
    global _BYTES
    with _LOCK:
        dropped = [*_PLANS.values(), *_BATCH_PLANS.values()]
        _PLANS.clear()
        _BATCH_PLANS.clear()
        _BYTES = 0
    del dropped                     # released outside the lock


def cache_info() -> dict[str, int]:
    """``{"plans", "batch_plans", "bytes", "trackers"}``: what the caches hold now (Note [Bounded plan cache])."""
    with _LOCK:
        dropped = _drain()
        info = {"plans": len(_PLANS), "batch_plans": len(_BATCH_PLANS), "bytes": _BYTES, "trackers": len(_TRACKERS)}
    del dropped                     # released outside the lock
    return info


def _forget(mesh_id: int) -> None:
    """A mesh (or group) went away (weakref finalizer): noted only, never locked (Note [Threads and the plan
    cache]); the next locked access drops its plans and its agreement tracker."""
    _DEAD.append(mesh_id)


def _drain() -> list[Any]:
    """Under ``_LOCK``: drop the entries of meshes that died; returns them, to be released after the lock."""
    global _BYTES
    if not _DEAD:
        return []
    del _DEAD[:len(_DEAD)]
    dropped: list[Any] = []
    for tier in (_PLANS, _BATCH_PLANS):
        for key in [k for k in tier if k[_MESH_AT].dead()]:
            dropped.append(tier.pop(key))
            _BYTES -= dropped[-1][1]
    for key in [k for k, t in _TRACKERS.items() if k is not None and t.mesh is None]:
        dropped.append(_TRACKERS.pop(key))
    return dropped


def _lookup(key: Any, batch: bool) -> Plan | None:
    with _LOCK:
        dropped = _drain()
        tier = _BATCH_PLANS if batch else _PLANS
        hit = tier.get(key)
        if hit is not None:
            tier.move_to_end(key)
    del dropped
    return None if hit is None else hit[0]


def _insert(key: Any, batch: bool, plan: Plan) -> None:
    global _BYTES
    nbytes = footprint(plan)
    with _LOCK:
        dropped = _drain()
        tier = _BATCH_PLANS if batch else _PLANS
        old = tier.pop(key, None)
        if old is not None:
            dropped.append(old)
            _BYTES -= old[1]
        tier[key] = (plan, nbytes)
        _BYTES += nbytes
        for t, most in ((_BATCH_PLANS, BATCH_CACHE_SIZE), (_PLANS, CACHE_SIZE)):
            while len(t) > most:
                dropped.append(t.popitem(last=False)[1])
                _BYTES -= dropped[-1][1]
        for t in (_BATCH_PLANS, _PLANS):                # over the budget: least recent first, batches first
            while _BYTES > CACHE_BYTES and t and next(iter(t)) != key:
                dropped.append(t.popitem(last=False)[1])
                _BYTES -= dropped[-1][1]
        passed = [p for p, _ in _BATCH_PLANS.values() if p.call.packed and p.cfg.cu_seqlens != plan.cfg.cu_seqlens] \
            if plan.call.packed else []
    for p in passed:                                    # Note [Graphed batches]: one batch's graphs at a time
        retire = getattr(p.engine, "retire", None)
        if retire is not None:
            if _same_but_batch(p, plan):
                plan.engine.inherit(p.engine)           # and the last batch's graph decisions
            retire()
    del dropped


def _same_but_batch(old: Plan, new: Plan) -> bool:
    """Whether two graphed plans differ only in their batch's documents (Note [Graphed batches])."""
    if not hasattr(new.engine, "inherit"):
        return False
    a, b = old.call, new.call
    return (old.method is new.method and a.q_shape == b.q_shape
            and a.k_shape == b.k_shape and a.v_shape == b.v_shape and a.dtype == b.dtype and a.device == b.device
            and a.grad == b.grad and a.lse_grad == b.lse_grad and a.groups is b.groups
            and replace(old.cfg, cu_seqlens=None) == replace(new.cfg, cu_seqlens=None))


def _owner(mesh: Any) -> Any:
    """What a call's plans and agreement rounds belong to: ``mesh``, or for ``mesh=None`` the default group as it
    is now - a process that destroys and re-creates its default group gets new plans and a new round schedule, not
    the ones of the destroyed group (whose rings, lanes and posted rounds are gone with it)."""
    if mesh is None and dist.is_initialized():
        return dist.group.WORLD
    return mesh


def _tracker(mesh: Any) -> agreement.Tracker:
    key = None if mesh is None else id(mesh)
    with _LOCK:
        t = _TRACKERS.get(key)
        if t is None or not t.serves(mesh):
            t = _TRACKERS[key] = agreement.Tracker(mesh)
            if mesh is not None:
                weakref.finalize(mesh, _forget, key)
    return t


def footprint(plan: Plan) -> int:
    """The bytes ``plan`` holds, estimated (Note [Bounded plan cache]): the storages of the tensors within a few
    attribute levels of its engine (each once; index tensors, captured buffers), plus its host structures at
    16 KiB and ``_DOC_BYTES`` per document and rank (schedules and their tasks grow with both). Walking every
    task of a schedule would cost as much as planning it; this costs microseconds."""
    seen: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    todo: list[tuple[Any, int]] = [(plan.engine, 0)]
    while todo and len(seen) < 512:
        obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[(str(st.device), st.data_ptr())] = st.nbytes()
        elif depth < 4 and isinstance(obj, (tuple, list)):
            todo += [(x, depth + 1) for x in obj[:16]]
        elif depth < 4 and isinstance(obj, dict):
            todo += [(x, depth + 1) for x in list(obj.values())[:16]]
        elif depth < 4 and type(obj).__module__.startswith("seqpar.") and not isinstance(obj, (Kernel, Method)):
            fields = [*getattr(obj, "__dict__", {}).values()]
            fields += [getattr(obj, n, None) for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
            todo += [(x, depth + 1) for x in fields]
    docs = 0 if plan.cfg.cu_seqlens is None else len(plan.cfg.cu_seqlens) - 1
    return sum(storages.values()) + (16 << 10) + _DOC_BYTES * docs * plan.groups.world


_DOC_BYTES = 96
"""Host bytes of a plan per document and rank (tracemalloc at W = 4, 300 documents: 40-165 KB per plan)."""


def _in_recompute() -> bool:
    """Inside the backward pass (activation-checkpoint recompute): the same call on every rank, no round."""
    return torch._C._current_graph_task_id() != -1


def host_cu_seqlens(cu: Any) -> tuple[int, ...] | None:
    """``cu_seqlens`` as host ints (a CUDA tensor costs one device read); validated as a 1D int tensor."""
    if cu is None:
        return None
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be a 1D int32 tensor, got {cu.dtype} of shape {tuple(cu.shape)}"
                            f"{rank_suffix()}")
        return tuple(cu.tolist())
    return tuple(int(x) for x in cu)


def planned(q, k, v, sinks, *, mesh, method, layout, causal, softmax_scale, kernel, return_lse, window_size,
            cu_seqlens, seq_len, deterministic, grad_dtype, dropout_p, alibi_slopes, softcap, check_ranks, verify,
            options, graphs: bool | None = None, mask_mod: Any = None, balance: str | None = None) -> Plan:
    """The planned call for these arguments: cached, or built (Note [Planned calls]); runs the round."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))
    window = tuple(window_size) if isinstance(window_size, list) else window_size
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, grad,
               None if sinks is None else (sinks.shape, sinks.dtype, sinks.device), Same(_owner(mesh)), method, layout,
               causal, softmax_scale, kernel, return_lse, window, host_cu_seqlens(cu_seqlens), seq_len,
               deterministic, grad_dtype, dropout_p, alibi_slopes is None, softcap, verify,
               tuple(options.items()) if options else (), graphs, _masks.cache_key(mask_mod), balance)
        hash(key)
    except TypeError:
        key = None                     # an unhashable argument: plan without caching (validation explains it)
    batch = cu_seqlens is not None or seq_len is not None
    plan = _lookup(key, batch) if key is not None else None
    rounds = check_ranks is not False and not _in_recompute()
    if plan is not None:
        _check_ranks_arg(check_ranks)
        if rounds and plan.groups.world > 1:
            _round(plan.items, mesh, check_ranks, q.device)
        return plan
    m, cfg, groups, lay, index = validated(
        q, k, v, sinks, mesh=mesh, method=method, layout=layout, causal=causal, softmax_scale=softmax_scale,
        kernel=kernel, window_size=window, cu_seqlens=cu_seqlens, seq_len=seq_len, deterministic=deterministic,
        grad_dtype=grad_dtype, dropout_p=dropout_p, alibi_slopes=alibi_slopes, softcap=softcap, options=options,
        grad=grad, check_ranks=check_ranks, round_now=False, mask_mod=mask_mod, balance=balance,
        extra=lambda: (_flag_args(check_ranks, verify, return_lse), _graphs_arg(graphs, q.device)))
    items = agreement.attention_signature(q, k, v, cfg, groups, return_lse=return_lse, verify=verify,
                                          sinks=None if sinks is None else tuple(sinks.shape))
    if rounds and groups.world > 1:     # before the method's own rules: a disagreement names what differs
        _round(items, mesh, check_ranks, q.device)
    call = Call(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, cfg, groups, lay, index, grad,
                return_lse)
    m.check(call)                       # the same on every rank now that the signatures agree
    engine = m.engine(call)
    direct = getattr(engine, "direct", None)
    direct = direct(call) if direct is not None and not (return_lse or verify or sinks is not None) else None
    hazard = _graphs.capture_hazard(groups) if graphs is not False and q.device.type == "cuda" and \
        groups.world > 1 else None     # one rank: no transfer inside the call
    if graphs is True and hazard is not None:
        raise ValueError(f"graphs=True cannot run here: {hazard} (Note [Graphs and shutdown] in "
                         f"seqpar.runtime.graphs); set NCCL_GRAPH_REGISTER=0, or pass graphs=None or False"
                         f"{rank_suffix()}")
    if _graphs.wanted(graphs, device=q.device, world=groups.world, rows=q.shape[0] * q.shape[1],
                      direct=direct is not None, hazard=hazard):
        engine, direct = _graphs.Graphed(engine, required=graphs is True), None
    plan = Plan(m, cfg, groups, call, engine, items, return_lse, verify, direct)
    if key is not None:
        _tracker(_owner(mesh))          # registers the mesh's finalizer (drops these plans with it)
        _insert(key, batch, plan)
    return plan


def _every(check_ranks: Any) -> int:
    """The round's period asked for by ``check_ranks`` (True: ``CHECK_EVERY``; an invalid value: every call,
    so that a rank rejecting it still joins a round)."""
    if check_ranks is True:
        return CHECK_EVERY
    return check_ranks if isinstance(check_ranks, int) and check_ranks >= 1 else 1


def _round(items: agreement.Items, mesh: Any, check_ranks: Any, device: torch.device) -> None:
    """Count the call on its group; run the round when it is due (Note [When the round is read])."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"check_ranks must be False for a call captured in a CUDA graph (the agreement round "
                         f"reads its result on the host), got {check_ranks!r}{rank_suffix()}")
    _tracker(_owner(mesh)).round(items, every=_every(check_ranks), device=device)


def _check_ranks_arg(check_ranks: Any) -> None:
    if check_ranks is True or check_ranks is False:
        return
    if not isinstance(check_ranks, int) or check_ranks < 1:
        raise TypeError(f"check_ranks must be True, False or a positive int (check every N calls), got "
                        f"{check_ranks!r}{rank_suffix()}")


def _graphs_arg(graphs: Any, device: torch.device) -> None:
    if graphs is not None and not isinstance(graphs, bool):
        raise TypeError(f"graphs must be None (auto), True or False, got {graphs!r}{rank_suffix()}")
    if graphs and device.type != "cuda":
        raise ValueError(f"graphs=True needs CUDA tensors (a call captured as a CUDA graph), got device {device}"
                         f"{rank_suffix()}")


def _flag_args(check_ranks: Any, verify: Any, return_lse: Any) -> None:
    _check_ranks_arg(check_ranks)
    for name, value in (("verify", verify), ("return_lse", return_lse)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}{rank_suffix()}")


def validated(q, k, v, sinks, *, mesh, method, layout, causal, softmax_scale, kernel, window_size, cu_seqlens,
              seq_len, deterministic, grad_dtype, dropout_p, alibi_slopes, softcap, options, grad,
              check_ranks: Any = True, round_now: bool = True, extra=None, flags: dict | None = None,
              mask_mod: Any = None, balance: str | None = None):
    """Every local check of a call, then (``round_now``) an agreement round read at once:
    ``(method, cfg, groups, layout, index)``, or the same error on every rank.

    A rank whose validation fails still joins the round (``share_error``) so the others raise too, naming it,
    instead of waiting in the method's first collective: with ``round_now`` always, else (``planned``) when
    the call's round is due (Note [When the round is read]).
    """
    try:
        if extra is not None:
            extra()
        check_tensors(q, k, v)
        if method == "auto":
            layout = layout or "zigzag"
            method, options = _auto(q, k, v, mesh, layout, causal, window_size, cu_seqlens, seq_len, kernel,
                                    grad_dtype, options, grad, mask_mod)
        m = methods.get(method)
        layout = layout or m.default_layout()
        cfg = config(m, layout=layout, causal=causal, softmax_scale=softmax_scale, kernel=kernel,
                     window_size=window_size, cu_seqlens=cu_seqlens, seq_len=seq_len, deterministic=deterministic,
                     grad_dtype=grad_dtype, dropout_p=dropout_p, alibi_slopes=alibi_slopes, softcap=softcap,
                     options=options, value_dim=v.shape[-1], head_dim=q.shape[-1], sinks=sinks is not None,
                     mask_mod=mask_mod, balance=balance)
        groups = SeqParallelGroups.resolve(mesh, m.mesh_dims)
        if cfg.mask is not None:        # probed before any collective (Note [Generic mask_mod])
            cfg = dataclasses.replace(cfg, mask=_masks.checked(cfg.mask, q.shape[1] * groups.world, q.device))
        lay, index = m.placement(cfg.layout, groups, cfg.cu_seqlens, cfg.balance_rule)
        validate_inputs(q, k, v, sinks, cfg, groups, m, lay)
    except Exception as err:    # every rank must hear of it; re-raised unchanged below
        if check_ranks is not False and not _in_recompute():
            if round_now:
                agreement.share_error(err, mesh)
            else:
                _tracker(_owner(mesh)).share_error(err, _every(check_ranks))
        raise
    if round_now:
        agreement.check(agreement.attention_signature(q, k, v, cfg, groups, **(flags or {})), mesh, q.device)
    return m, cfg, groups, lay, index


#: ``method="auto"``'s planner query, set by ``seqpar.api`` (the runtime imports no planner): ``(groups, dims,
#: mesh, q, k, v, layout, causal, window, cu_seqlens, kernel, grad_dtype, options, grad, features) -> (name, opts)``
CHOOSE: Any = None


def _auto(q, k, v, mesh, layout, causal, window, cu_seqlens, seq_len, kernel, grad_dtype, options, grad, mask_mod):
    """``method="auto"``: (method, options) from the planner (Note [Auto is deterministic] in planner.search)."""
    extra = sorted(set(options) - {"profile", "transport"})
    if extra:
        raise TypeError(f"method='auto' takes only the options 'profile' and 'transport' (it picks the method's "
                        f"options), got {extra}{rank_suffix()}")
    AttentionConfig(window_size=window)                       # validates the window before planning with it
    dims = 2 if getattr(mesh, "ndim", 1) == 2 else 1
    groups = SeqParallelGroups.resolve(mesh, dims)
    if "transport" in options:            # what auto may use (Note [Copy-engine ring] in seqpar.comm.symmetric)
        symmetric.check(options["transport"], groups.group if groups.group is not None else groups.ring, q.device)
    used = {"window": window != (-1, -1), "varlen": cu_seqlens is not None, "padding": seq_len is not None,
            "value_dim": v.shape[-1] != q.shape[-1], "mask": mask_mod is not None}
    named = mask_mod if isinstance(mask_mod, _named.PieceMask) else None      # a generic mask_mod: no blocks
    return CHOOSE(groups, dims, q, k, v, layout, bool(causal), window, cu_seqlens, kernel, grad_dtype, options, grad,
                  [f for f, on in used.items() if on], named)


def config(m: Method, *, layout, causal, softmax_scale, kernel, window_size, cu_seqlens, seq_len, deterministic,
           grad_dtype, dropout_p=0.0, alibi_slopes=None, softcap=0.0, options, value_dim=None, head_dim=None,
           sinks=False, mask_mod: Any = None, balance: str | None = None) -> AttentionConfig:
    """The validated ``AttentionConfig`` of a call to ``m`` (errors name the argument, the value, the rank)."""
    name = m.name
    unsupported = {"dropout_p": (dropout_p, dropout_p != 0.0), "alibi_slopes": (alibi_slopes, alibi_slopes is not None)}
    for arg, (value, given) in unsupported.items():
        if given:
            raise NotImplementedError(f"{arg} is not supported yet (it needs position-keyed handling in every "
                                      f"schedule); got {arg}={value!r}{rank_suffix()}")
    if layout not in all_layouts():
        raise ValueError(f"layout must be one of {sorted(all_layouts())}, got {layout!r}{rank_suffix()}")
    if layout not in m.layouts:
        raise ValueError(f"layout must be one of {list(m.layouts)} for method={name!r}, got {layout!r}"
                         f"{rank_suffix()}")
    if kernel not in available_kernels():
        raise ValueError(f"kernel must be one of {available_kernels()}, got {kernel!r}{rank_suffix()}")
    unknown = sorted(set(options) - set(m.options))
    if unknown:
        raise TypeError(f"method={name!r} takes options {sorted(m.options) or 'none'}, got {unknown}"
                        f"{rank_suffix()}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}{rank_suffix()}")
    if causal and layout not in m.serves_causal:
        ok = m.serves_causal
        need = f"layout={ok[0]!r}" if len(ok) == 1 else f"a layout in {list(ok)}"
        raise ValueError(f"method={name!r} with causal=True needs {need}, got layout={layout!r}{rank_suffix()}")
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    need = {"window": window != (-1, -1), "varlen": cu_seqlens is not None, "padding": seq_len is not None,
            "value_dim": value_dim is not None and head_dim is not None and value_dim != head_dim,
            "sinks": sinks, "softcap": bool(softcap), "document_layouts": layout not in LAYOUTS,
            "mask": mask_mod is not None}
    for feature, used in need.items():
        if used and feature not in m.features:
            raise NotImplementedError(f"method={name!r} does not support {feature.replace('_', ' ')} yet"
                                      f"{rank_suffix()}")
    return AttentionConfig(method=name, layout=layout, causal=causal, window_size=window,
                           softmax_scale=softmax_scale, kernel=kernel, cu_seqlens=host_cu_seqlens(cu_seqlens),
                           seq_len=seq_len, deterministic=deterministic, grad_dtype=grad_dtype, softcap=softcap,
                           mask=None if mask_mod is None else _masks.wrap(mask_mod), balance=balance,
                           options=AttentionConfig.pack_options({**m.options, **options}))


def all_layouts() -> Sequence[str]:
    """Every layout name (plain and per-batch document layouts)."""
    from .. import layouts

    return layouts.ALL_LAYOUT_NAMES


def validate_inputs(q, k, v, sinks, cfg: AttentionConfig, groups: SeqParallelGroups, m: Method, layout) -> None:
    """Every check that needs only local facts; raises the same error on every rank given the same input."""
    rs = rank_suffix()
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}{rs}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}{rs}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same (batch, seq_local, kv heads), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}{rs}")
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
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (H,):
            what = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a floating tensor of shape ({H},) (one logit per query head), got "
                             f"{what}{rs}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}{rs}")
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


def check_tensors(q, k, v) -> None:
    rs = rank_suffix()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}{rs}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4D (batch, seq_local, heads, head_dim), got shape "
                             f"{tuple(t.shape)}{rs}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}{rs}")


# ------------------------------------------------------------------------------------------ under torch.compile

_MESH_TAGS: dict[str, list[weakref.ref]] = {}      # a mesh description -> the meshes tagged #0, #1, ... (weak)


def _mesh_description(mesh: Any) -> str:
    import torch.distributed as dist

    if mesh is None:
        return "default-group"
    if isinstance(mesh, dist.ProcessGroup):
        return f"group{tuple(dist.get_process_group_ranks(mesh))}"
    if hasattr(mesh, "mesh_dim_names"):
        return f"mesh{tuple(mesh.mesh_dim_names or ())}{mesh.mesh.tolist()}"
    return type(mesh).__name__


def _mesh_tag(mesh: Any) -> str:
    """``mesh``'s description, with ``#n`` when another live mesh has the same one. Meshes are held weakly: a
    dead mesh's slot goes to the next mesh with its description, so the table holds at most as many meshes
    as are alive at once."""
    text = _mesh_description(mesh)
    if mesh is None:
        return text
    with _LOCK:
        refs = _MESH_TAGS.setdefault(text, [])
        n = next((i for i, r in enumerate(refs) if r() is mesh), None)
        if n is None:
            n = next((i for i, r in enumerate(refs) if r() is None), len(refs))
            refs[n:n + 1] = [weakref.ref(mesh)]
    return text if n == 0 else f"{text}#{n}"


def _tagged_mesh(tag: str) -> Any:
    if tag == "default-group":
        return None
    text, _, n = tag.partition("#")
    with _LOCK:
        refs = _MESH_TAGS.get(text, [])
        mesh = refs[int(n or 0)]() if int(n or 0) < len(refs) else None
    if mesh is None:
        raise RuntimeError(f"the mesh of this compiled seqpar call ({tag}) no longer exists: a compiled graph can "
                           f"only run on the mesh it was traced with{rank_suffix()}")
    return mesh


_TRACED_ARGS = ("method", "layout", "causal", "softmax_scale", "kernel", "window_size", "seq_len", "deterministic",
                "grad_dtype", "softcap", "check_ranks", "options", "graphs", "mask", "balance")


@torch.compiler.assume_constant_result
def traced_key(mesh: Any, method: str, layout: str | None, causal: bool, softmax_scale: float | None, kernel: str,
               window_size: tuple[int, int], seq_len: int | None, deterministic: bool, grad_dtype: torch.dtype,
               softcap: float, check_ranks: Any, options: tuple[tuple[str, Any], ...], graphs: bool | None = None,
               mask: tuple | None = None, balance: str | None = None) -> str:
    """Intern the non-tensor arguments of a traced call as a string key (Note [Tracing seqpar.attention]).

    The key spells the arguments out and is read back by ``traced_plan``, so the same key means the same call
    in every process (compiled graphs are cached on disk and shared between processes) and no table of
    arguments grows with the calls; only the mesh is named, by its description and ``#1``, ``#2`` ... for
    other live meshes over the same ranks (held weakly, ``_mesh_tag``).
    """
    args = dict(method=method, layout=layout, causal=causal, softmax_scale=softmax_scale, kernel=kernel,
                window_size=tuple(window_size), seq_len=seq_len, deterministic=deterministic, grad_dtype=grad_dtype,
                softcap=softcap, check_ranks=check_ranks, options=dict(options), graphs=graphs, mask=mask,
                balance=balance)
    key = ";".join(f"{k}={v!r}" for k, v in args.items()) + f";mesh={_mesh_tag(mesh)}"
    try:
        back = _traced_args(key)
    except (ValueError, SyntaxError):
        back = None
    if back is None or {k: back[k] for k in _TRACED_ARGS} != args:
        raise TypeError(f"seqpar.attention under torch.compile takes options whose values are literals (None, "
                        f"bool, int, float, str, tuples of them), got {dict(options)!r}{rank_suffix()}")
    return key


@functools.lru_cache(maxsize=256)
def _traced_args(key: str) -> dict[str, Any]:
    """The arguments ``traced_key`` spelled out (the mesh as its tag); cached per key (cheap to re-read)."""
    parts = dict(part.split("=", 1) for part in key.split(";"))
    args: dict[str, Any] = {"mesh": parts.pop("mesh")}
    for name, text in parts.items():
        args[name] = getattr(torch, text[len("torch."):]) if text.startswith("torch.") else ast.literal_eval(text)
    if not isinstance(args["grad_dtype"], torch.dtype):
        raise ValueError(f"grad_dtype must be a torch.dtype, got {args['grad_dtype']!r}")
    return args


def traced_plan(key: str, q, k, v, sinks, cu_seqlens) -> Plan:
    """The planned call behind a custom-op call (its arguments were interned by ``traced_key``); auto graphs off
    (Note [Graphs under compile] in ``seqpar.runtime.graphs``)."""
    a = _traced_args(key)
    return planned(q, k, v, sinks, mesh=_tagged_mesh(a["mesh"]), method=a["method"], layout=a["layout"],
                   causal=a["causal"], softmax_scale=a["softmax_scale"], kernel=a["kernel"], return_lse=True,
                   window_size=a["window_size"], cu_seqlens=cu_seqlens, seq_len=a["seq_len"],
                   deterministic=a["deterministic"], grad_dtype=a["grad_dtype"], dropout_p=0.0, alibi_slopes=None,
                   softcap=a["softcap"], check_ranks=a["check_ranks"], verify=False, options=a["options"],
                   graphs=False if a["graphs"] is None else a["graphs"],       # Note [Graphs under compile]
                   mask_mod=None if a["mask"] is None else _named.from_spec(a["mask"]),
                   balance=a["balance"])


def traced_saved_meta(key: str, q, k, v) -> list[tuple[tuple[Any, ...], torch.dtype]]:
    """Shapes and dtypes of what the method's engine saves for backward (fake tensors; shapes may be symbolic)."""
    a = _traced_args(key)
    if a["method"] == "auto":
        raise NotImplementedError(f"method='auto' is not supported under torch.compile (it chooses from concrete "
                                  f"shapes): name the method{rank_suffix()}")
    m = methods.get(a["method"])
    if m.saved_meta is None:
        return []
    groups = SeqParallelGroups.resolve(_tagged_mesh(a["mesh"]), m.mesh_dims)
    return m.saved_meta(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, groups, a["options"])
