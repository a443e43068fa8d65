"""Cross-rank agreement: before the first collective of a call, the ranks check that they make the same call.

    agreement.check(items, mesh, device)     # local validation passed: one tiny round, raises on a mismatch
    agreement.share_error(err, mesh)         # local validation failed: join the round, then the caller re-raises

``items`` is the call's signature: ``(label, value)`` pairs such as ``("k shape", (1, 8, 2, 16))`` built by
``attention_signature`` / ``linear_signature``. A mismatch raises ``RankDisagreementError`` with the same
message on every rank, naming the ranks that differ and how::

    ranks disagree on the call: rank 2 has k shape (1, 8, 2, 16) where ranks 0-1, 3 have (1, 8, 4, 16)

Note [Agreement protocol]
    A round is ONE small collective that every rank of the group runs, whatever its local outcome: an
    all-reduce (MAX) of four int64 ``[h, -h, e, -e]``, where ``h`` is a 62-bit digest of this rank's signature
    and ``e`` is 1 when this rank rejected the call in local validation. Every rank then holds the same
    ``max h, min h, max e, min e`` and so takes the same branch - which is what makes it hang-free:

    * digests equal, nobody rejected: the call proceeds (the common path: one collective, nothing else);
    * everybody rejected: each rank raises its own validation error (no further communication);
    * otherwise: ONE ``all_gather_object`` of each rank's readable signature (or its error), then every
      rank that accepted raises ``RankDisagreementError`` with the same message; a rank that rejected raises
      its own error. The reference for "where ranks ... have" is the most common signature.

    On a 2D mesh the round runs over each mesh axis in turn (MAX over the Ulysses axis, then over the ring
    axis, is the MAX over all of them); the group list depends only on the ``mesh`` argument, so a rank that
    failed validation joins exactly the collectives the others run. ``check`` / ``share_error`` run a round
    on every call (``linear_attention``, ``verify``); ``seqpar.attention`` runs it on the calls Note [When
    the round is read] picks.

Note [When the round is read]
    Whether a call runs the round must be decided identically on every rank: a rank that runs an extra
    all-reduce pairs it with the others' next collective (a hang, or silently mixed data). Local facts - a
    plan-cache miss, a changed input - cannot decide it: they are exactly what differs on the rank that
    went wrong. So ``seqpar.attention`` decides from a per-group call counter (``Tracker``), which is the same
    on every rank as long as the ranks make the same calls: the group's calls with ``check_ranks`` not
    False count (calls recomputed by activation checkpointing do not: they run no round), the first call of
    the group is call 0, and with ``check_ranks=N`` (``True`` is ``CHECK_EVERY``) a call runs the round when
    its counter is a multiple of the period ``p``. ``check_ranks`` must then be the same on every rank, as
    ``False`` always had to be.

    * Read at once (the host waits for the result before the method's first collective): on the group's
      first call - which catches most misuse (a wrong shape, layout or option is wrong from the start) -
      on every call with ``check_ranks=1`` (a check on every call, read at once: the explicit request), and
      on every round of a group whose backend carries CPU tensors (gloo), where reading costs nothing
      beyond the collective. Here ``p = N``, and a disagreement or a rejection raises on every rank before
      any method collective of that call.
    * Read lazily (a device group, NCCL): the round is posted on the stream, its result copied to pinned
      host memory behind it and an event recorded; no call waits for it. The next round settles it, on
      every rank at the same call (``event.query()``; the wait in ``event.synchronize()`` happens only if
      the device has not yet reached work queued a whole period earlier), and a disagreement then raises
      the same named error everywhere (every rank is at the same point, so all join the signature
      exchange). Here ``p = N // 2``, so a disagreement that starts at call k is posted by call k + p - 1
      and raised by call k + 2p - 1 < k + N.

    Either way a disagreement present from call k on raises ``RankDisagreementError`` on every rank by call
    k + N - 1, and in steady state the round adds no per-call collective and no host stall (one 32-byte
    all-reduce every ``p`` calls). What a sampled check cannot do: a disagreement confined to calls without a
    round goes unseen, and the calls between a disagreement and its round run the methods on mismatched
    inputs - a mismatch that changes a method's collectives blocks there, and the process-group timeout
    bounds it (docs/RELIABILITY.md, section 2). A rank that rejects a call on a round read lazily raises at
    once while the others post and proceed; it keeps the round's outcome so that, should the group be called
    again, every rank settles it alike. ``check_ranks=1`` checks every call before any method collective.

    Calls captured in a CUDA graph (``check_ranks=False`` is then required) run no round.

Note [Cost of the round]
    The round is one collective - the floor for any cross-rank check. On a group whose backend carries CPU
    tensors (gloo, or a ``"cpu:gloo,cuda:nccl"`` process group) it is a CPU all-reduce of 32 bytes: no
    device work, no device synchronisation; it costs what one small gloo collective costs on the host
    (``benchmarks/bench_agreement.py``: 0.7 ms at W = 2 and 3.4 ms at W = 4 on the 2-core CI VM, where a
    barrier costs 0.3 / 1.5 ms; tens of microseconds on an unloaded multi-core host). The signature and
    its cached digest cost ~40 us of Python. On a NCCL-only group the round is a device all-reduce
    (~10-20 us on NVLink) whose result the host must read: read at once, the read waits for every kernel
    queued before the call (a device sync, which costs the CPU's run-ahead). Measured on 4x H200, a
    ``"cpu:gloo,cuda:nccl"`` group (the round on gloo) was slower still (+0.6 ms per short call, docs/
    RELIABILITY.md). Hence the schedule of Note [When the round is read]: ``seqpar.attention`` runs the
    round every ``p`` calls of a group and reads it at once only on the group's first call, with
    ``check_ranks=1`` and on gloo; on NCCL the other rounds are read lazily, so the steady state has neither
    a per-call collective nor a host stall.

    Scope: the round compares what the ranks pass. A rank that never calls, or passes a different group,
    cannot be detected by it; the process-group timeout bounds those (docs: fault handling).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .config import AttentionConfig
from .errors import RankDisagreementError, rank_suffix
from .groups import SeqParallelGroups

__all__ = ["Items", "Tracker", "attention_signature", "check", "digest", "linear_signature", "max_over",
           "reduce_groups", "share_error"]

Items = tuple[tuple[str, Any], ...]
"""A call signature: ``(label, value)`` pairs, hashable; labels are what error messages print."""

_MASK = (1 << 62) - 1


def _canon(value: Any) -> Any:
    """``value`` with a process-independent repr: containers recursed, other objects by type name only
    (an object's default repr carries its address, which differs between ranks)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_canon(x) for x in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _canon(x)) for k, x in value.items()))
    if isinstance(value, torch.device):
        return str(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _digest(items: Items) -> int:
    raw = hashlib.blake2b(repr(_canon(items)).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & _MASK


_cached_digest = functools.lru_cache(maxsize=1024)(_digest)


def digest(items: Items) -> int:
    """A 62-bit digest of ``items``, identical in every process (``hash()`` is salted per process); cached
    per signature, so a repeated call hashes nothing."""
    try:
        return _cached_digest(items)
    except TypeError:           # an unhashable option value: digest it uncached
        return _digest(items)


def reduce_groups(mesh: Any) -> list[dist.ProcessGroup | None]:
    """The groups one round runs over, from the ``mesh`` argument alone (Note [Agreement protocol])."""
    if mesh is None:
        return [None]
    if isinstance(mesh, dist.ProcessGroup):
        return [mesh]
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):          # a DeviceMesh, any number of dims
        return [mesh.get_group(d) for d in range(mesh.ndim)]
    raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}{rank_suffix()}")


def _device(groups: Sequence[dist.ProcessGroup | None], hint: torch.device | None) -> torch.device:
    """CPU when the group's backend carries CPU tensors (no device sync), else the data's device."""
    backend = str(dist.get_backend(groups[0])).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if hint is not None and hint.type != "cpu":
        return hint
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_max(values: list[int] | list[float], dtype: torch.dtype, groups, device) -> list:
    t = torch.tensor(values, dtype=dtype, device=device)
    for g in groups:
        if dist.get_world_size(g) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    return t.tolist()


def max_over(values: list[float], mesh: Any, device: torch.device | None = None) -> list[float]:
    """Element-wise MAX of ``values`` over every rank of ``mesh`` (fp64; a collective on every rank)."""
    groups = reduce_groups(mesh)
    return _all_reduce_max(list(values), torch.float64, groups, _device(groups, device))


class _Payload(NamedTuple):
    rank: int
    items: Items | None
    error: str | None
    digest: int


def _gather(payload: _Payload, groups) -> list[_Payload]:
    """Every rank's payload (the slow path only): one ``all_gather_object`` per mesh axis."""
    got: list[Any] = [payload._replace(items=_canon(payload.items))]
    for g in groups:
        parts: list[Any] = [None] * dist.get_world_size(g)
        dist.all_gather_object(parts, got, group=g)
        got = list(itertools.chain.from_iterable(parts))
    return sorted(got, key=lambda p: p.rank)


class _Outcome(NamedTuple):
    """What one round says, the same on every rank."""

    same: bool          # every digest equal
    anybody: bool       # some rank rejected the call
    everybody: bool     # every rank rejected it


def _outcome(values: list[int]) -> _Outcome:
    hmax, neg_hmin, emax, neg_emin = values
    return _Outcome(hmax == -neg_hmin, emax == 1, -neg_emin == 1)


def _round(h: int, rejected: bool, groups, device) -> _Outcome:
    """One round, read at once: ``[h, -h, e, -e]`` MAX-reduced (Note [Agreement protocol])."""
    e = int(rejected)
    return _outcome(_all_reduce_max([h, -h, e, -e], torch.int64, groups, device))


def _accepted(items: Items, h: int) -> _Payload:
    return _Payload(dist.get_rank(), items, None, h)


def _rejected(err: BaseException) -> _Payload:
    text = re.sub(r" \(rank \d+ of \d+\)$", "", str(err))          # the others add their own suffix
    return _Payload(dist.get_rank(), None, f"{type(err).__name__}: {text}", 0)


class _Posted:
    """One round posted on a device group, read lazily (Note [When the round is read]): the reduced values
    land in pinned host memory behind the round, and an event says when."""

    def __init__(self, values: list[int], groups, device: torch.device, call: int, mine: _Payload):
        self.call, self.mine = call, mine
        t = torch.tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        for g in groups:
            if dist.get_world_size(g) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g, async_op=True).wait()   # a stream dependency
        self.host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def values(self) -> list[int]:
        if not self.event.query():     # posted a whole period ago: waits only for a device that far behind
            self.event.synchronize()
        return self.host.tolist()


class Tracker:
    """The agreement schedule of one mesh argument (Note [When the round is read]): counts the group's calls,
    runs the round on the calls whose count is a multiple of the period, reads it at once or settles it at
    the next round. One per mesh object; ``seqpar.runtime.call`` keeps them."""

    def __init__(self, mesh: Any):
        self._mesh = None if mesh is None else weakref.ref(mesh)     # never keeps a group alive
        self.calls = 0
        self.pending: _Posted | None = None
        self._lazily: bool | None = None        # a device group: rounds read lazily (found on the first call)

    def serves(self, mesh: Any) -> bool:
        return (mesh is None and self._mesh is None) or (self._mesh is not None and self._mesh() is mesh)

    @property
    def mesh(self) -> Any:
        return None if self._mesh is None else self._mesh()

    @property
    def groups(self) -> list:
        return reduce_groups(self.mesh)

    def _count(self, every: int, device: torch.device | None) -> tuple[int, bool, bool]:
        """Count one call: ``(its index, whether it runs the round, whether the round is read at once)``, from
        facts that are the same on every rank (the counter, ``every``, the group's backend)."""
        if self._lazily is None:
            self._lazily = _device(self.groups, device).type != "cpu"
        call, self.calls = self.calls, self.calls + 1
        if not self._lazily or every == 1:
            return call, call % every == 0, True
        return call, call % max(1, every // 2) == 0, call == 0

    def round(self, items: Items, *, every: int, device: torch.device | None) -> None:
        """A call that passed local validation, checked every ``every`` calls: count it; if it runs the round,
        settle the previous one, then run this one; raise ``RankDisagreementError`` on a disagreement."""
        call, due, at_once = self._count(every, device)
        if not due:
            return
        groups = self.groups
        dev = _device(groups, device)
        self._settle(groups)
        h = digest(items)
        if at_once:
            _raise_unless_agreed(_round(h, False, groups, dev), _accepted(items, h), groups)
        else:
            self.pending = _Posted([h, -h, 0, 0], groups, dev, call, _accepted(items, h))

    def share_error(self, err: BaseException, every: int) -> None:
        """A call that failed local validation: count it and, if it runs the round, join it as a rank that
        rejected the call (``share_error``); the caller re-raises ``err``."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        try:
            groups = self.groups
            dev = _device(groups, None)
            call, due, at_once = self._count(every, None)
        except Exception:        # the mesh argument is the problem: there is no group to run a round on
            return
        if not due:
            return
        self._settle(groups)
        if at_once:
            _raise_unless_agreed(_round(0, True, groups, dev), _rejected(err), groups)
        else:                    # the others read it later: keep it, so that every rank settles it alike
            self.pending = _Posted([0, 0, 1, -1], groups, dev, call, _rejected(err))

    def _settle(self, groups) -> None:
        """Act on the round read lazily: every rank does so at the same call (the next round)."""
        posted, self.pending = self.pending, None
        if posted is not None:
            _raise_unless_agreed(_outcome(posted.values()), posted.mine, groups, call=posted.call)


def check(items: Items, mesh: Any, device: torch.device | None = None) -> None:
    """Run the round for a call that passed local validation; raise ``RankDisagreementError`` on a mismatch.

    A collective on every rank of ``mesh`` (Note [Agreement protocol]); ``device`` is where the data lives
    (the round itself runs on CPU when the backend allows, Note [Cost of the round]).
    """
    groups = reduce_groups(mesh)
    h = digest(items)
    _raise_unless_agreed(_round(h, False, groups, _device(groups, device)), _accepted(items, h), groups)


def _raise_unless_agreed(res: _Outcome, mine: _Payload, groups, call: int | None = None) -> None:
    """Raise what a round says, on every rank alike. ``call``: the group's call a lazily read round belonged
    to (it is settled at the next round, where a rank that rejected it raises the common error too)."""
    if (res.same and not res.anybody) or res.everybody:     # everybody rejected: each raised its own error
        return
    payloads = _gather(mine, groups)                         # every rank is here: name who differs
    if mine.error is not None and call is None:
        return                                               # the caller re-raises this rank's own error
    found = "" if call is None else f" (call {call} of this group, found at its next round)"
    raise RankDisagreementError(f"ranks disagree on the call: {_describe(payloads)}{found}{rank_suffix()}")


def share_error(err: BaseException, mesh: Any) -> None:
    """Join the round as a rank that rejected the call, so the others raise instead of waiting for it.

    Returns normally; the caller re-raises ``err`` (its own, more specific error). Does nothing when there is
    no process group to tell, or the ``mesh`` argument itself is unusable (then nothing can carry the news).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        groups = reduce_groups(mesh)
        device = _device(groups, None)
    except Exception:        # the mesh argument is the problem: there is no group to run a round on
        return
    _raise_unless_agreed(_round(0, True, groups, device), _rejected(err), groups)


# ------------------------------------------------------------------------------------------------ messages


def _ranks(ranks: Sequence[int]) -> str:
    """``"rank 3"`` or ``"ranks 0-2, 5"``."""
    rs = sorted(ranks)
    spans = [[rs[0], rs[0]]]
    for r in rs[1:]:
        if r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(rs) == 1 else f"ranks {text}"


def _fmt(value: Any) -> str:
    if isinstance(value, tuple) and len(value) > 8:      # long cu_seqlens: ends, count and a digest of the whole
        head, tail = ", ".join(map(str, value[:3])), ", ".join(map(str, value[-2:]))
        return f"({head}, ..., {tail}) [{len(value)} values, digest {digest((('v', value),)) & 0xFFFF:04x}]"
    return repr(value) if isinstance(value, str) else str(value)


def _describe(payloads: list[_Payload]) -> str:
    """Which ranks differ and how, against the most common signature."""
    clauses = [f"rank {p.rank} rejected it with {p.error}" for p in payloads if p.error is not None]
    accepted = [p for p in payloads if p.error is None]
    by_digest: dict[int, list[_Payload]] = {}
    for p in accepted:
        by_digest.setdefault(p.digest, []).append(p)
    if len(by_digest) > 1:
        counts = Counter({d: len(ps) for d, ps in by_digest.items()})
        ref_digest = max(counts, key=lambda d: (counts[d], -by_digest[d][0].rank))
        ref = by_digest[ref_digest]
        ref_items = dict(ref[0].items or ())
        for d, ps in by_digest.items():
            if d == ref_digest:
                continue
            items = dict(ps[0].items or ())
            labels = [*ref_items, *(x for x in items if x not in ref_items)]
            who, where = _ranks([p.rank for p in ps]), _ranks([p.rank for p in ref])
            has, have = ("has" if len(ps) == 1 else "have"), ("has" if len(ref) == 1 else "have")
            diffs = [f"{who} {has} {label} {_fmt(items.get(label, '<absent>'))} where {where} {have} "
                     f"{_fmt(ref_items.get(label, '<absent>'))}"
                     for label in labels if items.get(label, "<absent>") != ref_items.get(label, "<absent>")]
            clauses += diffs or [f"{who} {has} a different call signature than {where}"]
    return "; ".join(clauses) if clauses else "signatures differ"


# ------------------------------------------------------------------------------------------------ signatures


def _tensor_items(name: str, t: torch.Tensor | None) -> Items:
    if t is None:
        return ((f"{name}", None),)
    return ((f"{name} shape", tuple(t.shape)), (f"{name} dtype", t.dtype))


def _backward(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _group_items(groups: SeqParallelGroups) -> Items:
    if groups.group is not None:
        return (("group ranks", tuple(dist.get_process_group_ranks(groups.group))),)
    return (("mesh (ulysses, ring)", (groups.ulysses_size, groups.ring_size)),)


def attention_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig,
                        groups: SeqParallelGroups, **flags: Any) -> Items:
    """Everything the ranks of one ``seqpar.attention`` call must agree on (``flags``: return_lse, verify)."""
    return (*_tensor_items("q", q), *_tensor_items("k", k), *_tensor_items("v", v),
            ("device type", q.device.type), ("method", cfg.method), ("layout", cfg.layout),
            ("causal", cfg.causal), ("window_size", cfg.window_size), ("softmax_scale", cfg.softmax_scale),
            ("kernel", cfg.kernel), ("options", cfg.options), ("cu_seqlens", cfg.cu_seqlens),
            ("seq_len", cfg.seq_len), ("deterministic", cfg.deterministic),
            ("grad_dtype", cfg.grad_dtype), ("backward", _backward(q, k, v)),
            ("mask_mod", None if cfg.mask is None else cfg.mask.spec()), ("balance", cfg.balance),
            *sorted(flags.items()), *_group_items(groups))


def linear_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                     h0: torch.Tensor | None, cfg: Any, groups: SeqParallelGroups, **flags: Any) -> Items:
    """Everything the ranks of one ``seqpar.linear_attention`` call must agree on (``cfg``: a LinearConfig)."""
    fm = flags.pop("feature_map", None)
    if callable(fm):
        fm = f"callable {getattr(fm, '__module__', '?')}.{getattr(fm, '__qualname__', type(fm).__name__)}"
    return (*_tensor_items("q", q), *_tensor_items("k", k), *_tensor_items("v", v),
            *_tensor_items("decay/gates", g), *_tensor_items("initial_state", h0),
            ("device type", q.device.type), ("method", cfg.method), ("layout", cfg.layout),
            ("causal", cfg.causal), ("feature_map", fm), ("chunk_size", cfg.chunk_size), ("kernel", cfg.kernel),
            ("cu_seqlens", cfg.cu_seqlens), ("seq_len", cfg.seq_len), ("grad_dtype", cfg.grad_dtype),
            ("output_final_state", cfg.output_final_state), ("backward", _backward(q, k, v, g, h0)),
            *sorted(flags.items()), *_group_items(groups))
