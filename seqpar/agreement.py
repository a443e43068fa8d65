"""Cross-rank agreement: before the first collective of a call, the ranks check that they make the same call.

    agreement.check(items, mesh, device)     # local validation passed: one tiny round, raises on a mismatch
    agreement.share_error(err, mesh)         # local validation failed: join the round, then the caller re-raises

``items`` is the call's signature: ``(label, value)`` pairs such as ``("k shape", (1, 8, 2, 16))`` built by
``attention_signature`` / ``linear_signature``. A mismatch raises ``RankDisagreementError`` with the same
message on every rank, naming the ranks that differ and how::

    ranks disagree on the call: rank 2 has k shape (1, 8, 2, 16) where ranks 0-1, 3 have (1, 8, 4, 16)

Note [Agreement protocol]
    Every call runs exactly ONE small collective on every rank (the *round*), whatever the local outcome:
    an all-reduce (MAX) of four int64 ``[h, -h, e, -e]``, where ``h`` is a 62-bit digest of this rank's
    signature and ``e`` is 1 when this rank rejected the call in local validation. Every rank then holds the
    same ``max h, min h, max e, min e`` and so takes the same branch - which is what makes it hang-free:

    * digests equal, nobody rejected: the call proceeds (the common path: one collective, nothing else);
    * everybody rejected: each rank raises its own validation error (no further communication);
    * otherwise: ONE ``all_gather_object`` of each rank's readable signature (or its error), then every
      rank that accepted raises ``RankDisagreementError`` with the same message; a rank that rejected raises
      its own error. The reference for "where ranks ... have" is the most common signature.

    On a 2D mesh the round runs over each mesh axis in turn (MAX over the Ulysses axis, then over the ring
    axis, is the MAX over all of them); the group list depends only on the ``mesh`` argument, so a rank that
    failed validation joins exactly the collectives the others run.

Note [When the round is read]
    Skipping the round on a repeated signature is unsafe on its own: the decision is local, so a rank whose
    inputs changed would run the round while the others skip it, and its all-reduce would pair with their
    next collective (a hang, or silently mixed data). So the round's collective is POSTED on every call, by
    every rank of the group - the sequence of collectives stays identical whatever each rank decides - and
    what is optional is *reading* its result, which is what costs on a GPU (a device synchronisation):

    * the result is read at once on a call whose signature is new to this rank's plan cache, on every
      ``period``-th call of the group, and on every call of a gloo (CPU) group, where reading costs nothing
      beyond the collective;
    * otherwise (NCCL, a repeated signature) the round's result is copied to pinned host memory behind the
      call and checked when it has arrived - at the start of the next call on this group at the latest, so
      a rank that disagrees makes every rank raise within one call. A fourth pair of values in the round
      says whether every rank read it at once; only then do the ranks exchange their signatures to name who
      differs (an object all-gather every rank must join); otherwise each raises without the gather.

    Calls recomputed by activation checkpointing (inside the backward pass, the same call on every rank)
    and calls captured in a CUDA graph (``check_ranks=False`` is then required) run no round.

Note [Cost of the round]
    The round is one collective - the floor for any cross-rank check. On a group whose backend carries CPU
    tensors (gloo, or a ``"cpu:gloo,cuda:nccl"`` process group) it is a CPU all-reduce of 32 bytes: no
    device work, no device synchronisation; it costs what one small gloo collective costs on the host
    (``benchmarks/bench_agreement.py``: 0.7 ms at W = 2 and 3.4 ms at W = 4 on the 2-core CI VM, where a
    barrier costs 0.3 / 1.5 ms; tens of microseconds on an unloaded multi-core host). The signature and
    its cached digest cost ~40 us of Python. On a NCCL-only group the round is a device all-reduce
    (~10-20 us on NVLink) whose result the host must read: the read waits for every kernel queued before
    the call (a device sync per call, which costs the CPU's run-ahead). Measured on 4x H200, a
    ``"cpu:gloo,cuda:nccl"`` group (the round on gloo) was slower still (+0.6 ms per short call, docs/
    RELIABILITY.md), so on GPUs keep NCCL and, where calls are only a few ms, check periodically:
    ``check_ranks=(step % N == 0)`` - a value that must be the same on EVERY rank: a rank that skips the
    round while the others run it hangs them, which no library can detect.

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
    got: list[Any] = [payload]
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
    all_read: bool      # every rank read the round at once (so all can join the signature exchange)


def _round(h: int, rejected: bool, groups, device, read_now: bool = True) -> _Outcome:
    """One round, read at once: ``[h, -h, e, -e, b, -b]`` MAX-reduced (Note [Agreement protocol])."""
    e, b = int(rejected), int(read_now)
    hmax, neg_hmin, emax, neg_emin, _, neg_bmin = _all_reduce_max([h, -h, e, -e, b, -b], torch.int64, groups, device)
    return _Outcome(hmax == -neg_hmin, emax == 1, -neg_emin == 1, -neg_bmin == 1)


class _Posted:
    """One round posted on a device group; its result is read when ready (Note [When the round is read])."""

    def __init__(self, values: list[int], groups, device: torch.device, call: int):
        self.call = call
        t = torch.tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        for g in groups:
            if dist.get_world_size(g) > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g, async_op=True).wait()   # a stream dependency
        self.host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event.query()

    def values(self) -> list[int]:
        self.event.synchronize()
        return self.host.tolist()


class Tracker:
    """The agreement policy of one mesh argument (Note [When the round is read]): counts calls, posts every
    round, reads them at once or lazily. One per mesh object; ``seqpar.runtime.call`` keeps them."""

    def __init__(self, mesh: Any):
        self._mesh = None if mesh is None else weakref.ref(mesh)     # never keeps a group alive
        self.calls = 0
        self.pending: list[_Posted] = []

    def serves(self, mesh: Any) -> bool:
        return (mesh is None and self._mesh is None) or (self._mesh is not None and self._mesh() is mesh)

    @property
    def mesh(self) -> Any:
        return None if self._mesh is None else self._mesh()

    @property
    def groups(self) -> list:
        return reduce_groups(self.mesh)

    def poll(self, block: bool = False) -> None:
        """Check the lazily read rounds that have arrived (all of them with ``block``)."""
        while self.pending and (block or self.pending[0].ready()):
            posted = self.pending.pop(0)
            hmax, neg_hmin, emax, _, _, _ = posted.values()
            if hmax != -neg_hmin or emax:
                self.pending.clear()
                raise RankDisagreementError(
                    f"ranks disagree on the call: call {posted.call} on this group differs between ranks (found "
                    f"after the call; a rank's arguments or inputs differ from another's: run the step with "
                    f"check_ranks=1 to have the ranks named){rank_suffix()}")

    def round(self, items: Items, *, read_now: bool, device: torch.device | None) -> None:
        """Post this call's round; read it now, or leave it for ``poll``; raise on a disagreement."""
        self.calls += 1
        groups = self.groups
        dev = _device(groups, device)
        h = digest(items)
        if dev.type == "cpu" or read_now:
            self.poll(block=True)
            _raise_unless_agreed(items, h, _round(h, False, groups, dev), groups, self.calls)
            return
        self.poll()
        self.pending.append(_Posted([h, -h, 0, 0, 0, 0], groups, dev, self.calls))


def check(items: Items, mesh: Any, device: torch.device | None = None) -> None:
    """Run the round for a call that passed local validation; raise ``RankDisagreementError`` on a mismatch.

    A collective on every rank of ``mesh`` (Note [Agreement protocol]); ``device`` is where the data lives
    (the round itself runs on CPU when the backend allows, Note [Cost of the round]).
    """
    groups = reduce_groups(mesh)
    h = digest(items)
    _raise_unless_agreed(items, h, _round(h, False, groups, _device(groups, device)), groups, None)


def _raise_unless_agreed(items: Items, h: int, res: _Outcome, groups, call: int | None) -> None:
    if res.same and not res.anybody:
        return
    if res.all_read:                   # every rank is here: name who differs
        payloads = _gather(_Payload(dist.get_rank(), _canon(items), None, h), groups)
        raise RankDisagreementError(f"ranks disagree on the call: {_describe(payloads)}{rank_suffix()}")
    raise RankDisagreementError(
        f"ranks disagree on the call: call {call} on this group differs between ranks (some ranks repeated an "
        f"earlier call signature; run the step with check_ranks=1 to have the ranks named){rank_suffix()}")


def share_error_tracked(err: BaseException, tracker: Tracker) -> None:
    """``share_error`` for a call of a tracked mesh (counts the call)."""
    tracker.calls += 1
    share_error(err, tracker.mesh)


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
    res = _round(0, True, groups, device)
    if not res.everybody and res.all_read:
        text = re.sub(r" \(rank \d+ of \d+\)$", "", str(err))          # the others add their own suffix
        _gather(_Payload(dist.get_rank(), None, f"{type(err).__name__}: {text}", 0), groups)


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
