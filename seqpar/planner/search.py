"""Strategy search: every method configuration that fits, ranked by the cost model, with the reason.

    seqpar.plan(seq_len=131072, heads=32, kv_heads=8, world=4)        # -> Ranking (print it)
    seqpar.plan(..., cu_seqlens=cu, layout="zigzag")                  # a packed batch on the layout you shard with
    seqpar.plan(..., cached=65536, layers=32)                         # + prefill and decode of a cached prefix
    seqpar.planner.choose(q_shape, kv_heads, causal, window, world, mesh_dims, layout)   # method="auto"

The methods are the registry's (``seqpar.methods``): ``plan`` asks each declaration for its configurations
on the layouts it may use (``Method.candidates``), drops those that cannot run - features, options, the
layout's length rules (through the method's own ``placement``), the method's rules (``Method.why_not``),
memory - with the reason, predicts the rest (``Method.cost``) and sorts by predicted time. Results are
cached per signature (``functools.lru_cache``): every argument is hashable, profiles and the method
declarations included (a method registered again is a new key).

Note [Auto is deterministic]
    ``choose`` is a pure function of its arguments, a built-in or explicitly passed profile and the registered
    methods (the same on every rank that imports the same code): no measurement, no clock, no rank-dependent
    input, no communication, and ties break by the candidate's label. Every rank that calls
    ``seqpar.attention(method="auto")`` with the same shapes (and the same ``cu_seqlens``) therefore makes the
    same choice. Auto never changes the token layout - the caller already sharded - so it picks among the
    registered methods whose layouts include the caller's and whose mesh dimensionality matches. A packed
    batch is ranked with Note [Packed batches] (``seqpar.cost.model``): per new ``cu_seqlens``, W rank
    works and the documents' run pairs in closed form, never O(S), cached per batch.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import methods as _methods
from ..comm.symmetric import TRANSPORTS
from ..cost.model import Candidate, Machine, Prediction, Problem, single_gpu_ms
from ..cost.profile import Profile, load_profile
from ..cost.topology import Network, Topology, get_topology
from ..groups import GroupSizes
from ..layouts import DOCUMENT_LAYOUTS, LAYOUTS, ONE_DOCUMENT
from ..methods import Method
from .inference import InferenceCase, inference_case

__all__ = ["AUTO_CHOICE", "DTYPE_BYTES", "MODES", "Entry", "Ranking", "choose", "default_profile", "modelled_methods",
           "plan", "predict"]

log = logging.getLogger("seqpar.planner")
AUTO_CHOICE = "method='auto' -> %s %s for q %s, kv_heads %d, world %d (profile %s%s): %s"
"""The INFO record of each ``method="auto"`` choice on ``seqpar.planner``; its first two arguments are the method
and its options (the bench reads them: Note [Auto rows] in ``seqpar.bench``)."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
MODES = ("fwd", "fwd+bwd")


def modelled_methods() -> list[str]:
    """The registered methods the planner can rank: those that declare a cost model."""
    return [name for name in _methods.available() if _methods.get(name).cost is not None]


def predict(p: Problem, c: Candidate, m: Machine) -> Prediction:
    """The prediction of ``c`` on ``p`` and ``m`` by its method's declared cost model (``Method.cost``)."""
    cost = _methods.get(c.method).cost
    if cost is None:
        raise ValueError(f"method {c.method!r} must declare a cost model (Method.cost) to be predicted, got None")
    return cost(p, c, m)


@dataclass(frozen=True)
class Entry:
    """One ranked candidate: its prediction, or why it cannot run."""

    candidate: Candidate
    label: str
    prediction: Prediction | None
    time_ms: float
    efficiency: float
    peak_mem_gib: float
    why_not: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.why_not


@dataclass(frozen=True)
class Ranking:
    """Candidates sorted by predicted time (those that cannot run last), and why the first won."""

    problem: Problem
    mode: str
    profile: str
    topology: str
    kernel: str
    limit_ms: float
    """Single-GPU kernel time on the whole problem / W: the efficiency yardstick."""
    entries: tuple[Entry, ...]
    reason: str
    inference: InferenceCase | None = None
    """Prefill and decode of a cached prefix (``plan(cached=...)``), else None."""

    @property
    def best(self) -> Entry | None:
        return self.entries[0] if self.entries and self.entries[0].ok else None

    def table(self, limit: int | None = None) -> str:
        """The ranking as text; a packed batch adds the work balance and the bytes each rank sends."""
        p = self.problem
        packed = p.documents is not None
        head = (f"S={p.seq_len} B={p.batch} H={p.heads}/{p.kv_heads} D={p.head_dim} W={p.world} "
                f"{'causal' if p.causal else 'full'}" + (f" window={p.window}" if p.window != (-1, -1) else "")
                + (f" documents={len(p.documents) - 1}" if packed else "")
                + f" | {self.mode} | profile {self.profile}, {self.topology}, kernel {self.kernel} | "
                f"single-GPU limit {self.limit_ms:.3f} ms")
        extra = f" {'work max/mean':>13} {'lockstep':>8} {'MiB/rank':>9}" if packed else ""
        rows = [head, f"{'#':>3} {'method':<28} {'time ms':>10} {'eff':>6} {'mem GiB':>8} {'exposed ms':>11}"
                      f"{extra}  notes"]
        for i, e in enumerate(self.entries[:limit]):
            if e.ok:
                pr = e.prediction
                assert pr is not None       # ok entries are predicted (Entry.ok)
                cols = (f" {pr.work_imbalance:>13.2f} {pr.lockstep:>8.2f} {pr.bytes(self.mode) / 2**20:>9.1f}"
                        if packed else "")
                rows.append(f"{i + 1:>3} {e.label:<28} {e.time_ms:>10.3f} {e.efficiency:>6.1%} {e.peak_mem_gib:>8.2f} "
                            f"{pr.exposed_ms(self.mode):>11.3f}{cols}  {'; '.join(pr.notes[:2])}")
            else:
                dash = f" {'-':>13} {'-':>8} {'-':>9}" if packed else ""
                rows.append(f"  - {e.label:<28} {'-':>10} {'-':>6} {'-':>8} {'-':>11}{dash}  cannot run: "
                            + "; ".join(e.why_not))
        rows.append(f"choice: {self.reason}")
        if self.inference is not None:
            rows.append(str(self.inference))
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def default_profile(device: str = "cuda") -> Profile:
    """The built-in profile for a device type: "h200-nvswitch" on CUDA, "cpu-gloo" on CPU."""
    return load_profile("cpu-gloo" if device == "cpu" else "h200-nvswitch")


def _bytes(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[name]


def _declarations(methods: Sequence[str] | str | None) -> tuple[Method, ...]:
    """The declarations to rank: every modelled method (None, "all", "available") or the named ones."""
    if methods is None or methods in ("all", "available"):
        return tuple(_methods.get(name) for name in modelled_methods())
    names = (methods,) if isinstance(methods, str) else tuple(methods)
    bad = [name for name in names if name not in modelled_methods()]
    if bad:
        raise ValueError(f"methods must be names from {modelled_methods()} (registered methods with a cost model), "
                         f"got {bad}")
    return tuple(_methods.get(name) for name in names)


def _documents(cu_seqlens: Any) -> tuple[int, ...] | None:
    """``cu_seqlens`` (a sequence or 1-D tensor of ints, O(documents)) as a tuple, or None."""
    if cu_seqlens is None:
        return None
    values = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else cu_seqlens
    return tuple(int(c) for c in values)


def plan(*, seq_len: int, heads: int, world: int, kv_heads: int | None = None, head_dim: int = 128, batch: int = 1,
         causal: bool = True, window: tuple[int, int] = (-1, -1), dtype: Any = "bfloat16",
         grad_dtype: Any = "float32", mode: str = "fwd+bwd", profile: Profile | str | Path | None = None,
         topology: Topology | str | None = None, kernel: str | None = None,
         methods: Sequence[str] | str | None = None, layout: str | None = None, ulysses: int | None = None,
         memory_gib: float | None = None, features: Iterable[str] = (), pad: bool = False,
         cu_seqlens: Sequence[int] | Any | None = None, cached: int | None = None, layers: int = 1,
         transports: Sequence[str] = ("nccl",), mask_mod: Any = None) -> Ranking:
    """Rank every method configuration for one attention layer by predicted time.

    Args:
        seq_len, heads, kv_heads, head_dim, batch: the global problem (kv_heads defaults to heads).
        world: ranks in the sequence-parallel group.
        causal, window: the mask (flash-attn window convention).
        dtype, grad_dtype: activation dtype and the dtype of gradient partials on the wire.
        mode: "fwd" or "fwd+bwd": which time ranks.
        profile: a Profile, a built-in name or a JSON path (default: the built-in H200 profile).
        topology: a Topology or preset name (``seqpar.cost.topology.PRESETS``); default: one node of
            the profile's host, which needs ``world <= profile.gpus_per_node``.
        kernel: the local kernel (default: the profile's ``default_kernel``, what "auto" runs).
        methods: names to consider; None, "all" or "available" = every registered method with a cost model.
        layout: only candidates with this token layout (USP: the ring layout); a document layout over one
            document: the methods that take it, ranked on the plain layout that places it alike
            (``layouts.ONE_DOCUMENT``; the table names that layout).
        ulysses: only 2D methods with this Ulysses degree (a fixed 2D mesh).
        memory_gib: per-device memory limit (default: the profile's).
        features: features the call needs ("window", "varlen", "padding", ...); methods that lack one
            cannot run.
        pad: assume lengths a layout cannot split are padded (the simulator); otherwise they exclude.
        cu_seqlens: a packed batch's global document boundaries (0 first, the valid length last): every plain
            layout and the document layouts a method accepts are ranked with Note [Packed batches] (work
            max/mean, lockstep and bytes per rank in the table).
        cached: tokens already cached (P < seq_len): adds prefill of the ``seq_len - cached`` new tokens
            (pass-KV or pass-Q by bytes, with the reason) and decode at ``seq_len`` tokens to the ranking
            (``seqpar.inference.plan_inference``; ``layers`` layers of cache).
        transports: how the methods that take a ``transport`` option may move their hops ("nccl", "copy_engine":
            Note [Copy-engine ring] in ``seqpar.comm.symmetric``); each is ranked as a configuration of its own,
            copy engines only within one host and with a profile that measured them (``p2p_copy``).
        mask_mod: a named mask (``seqpar.masks``), ANDed with ``causal`` and ``window``: every method is ranked on
            the blocks its ranks compute under it and the bytes they move (Note [Masked problems] in
            ``seqpar.cost.model``); only methods that take masks. A generic ``mask_mod`` function has no
            declared blocks: pass ``features=("mask",)`` and plan without it (its blocks are an upper bound).

    Returns:
        A ``Ranking``: ``best``, ``entries`` (time, efficiency, memory, notes, or why not), ``reason``, and
        ``inference`` when ``cached`` is given.
    """
    prof = load_profile(profile) if profile is not None else default_profile()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    documents = _documents(cu_seqlens)
    needs = (frozenset(features) | ({"varlen"} if documents is not None else set())
             | ({"mask"} if mask_mod is not None else set()))
    problem = Problem(seq_len=seq_len, heads=heads, kv_heads=kv_heads or heads, head_dim=head_dim, batch=batch,
                      world=world, causal=causal, window=tuple(window), dtype_bytes=_bytes(dtype),
                      grad_bytes=_bytes(grad_dtype), documents=documents, mask=mask_mod)
    declared = _declarations(methods)
    if layout in DOCUMENT_LAYOUTS and problem.documents is None:
        # one document (a Problem keeps none): the methods that take the layout, ranked on its plain counterpart
        declared = tuple(m for m in declared if layout in m.layouts)
        layout = ONE_DOCUMENT[layout]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports:
        raise ValueError(f"transports must name some of {TRANSPORTS}, got {list(transports)}")
    ranking = _plan(problem, mode, prof, topology, kernel or prof.default_kernel, declared, layout,
                    ulysses, memory_gib if memory_gib is not None else prof.memory_gib, needs, pad,
                    tuple(dict.fromkeys(transports)))
    if cached is None:
        return ranking
    case = inference_case(context=seq_len, cached=cached, world=world, layers=layers, heads=heads,
                          kv_heads=kv_heads or heads, head_dim=head_dim, batch=batch, dtype=str(dtype))
    return replace(ranking, inference=case)


@functools.lru_cache(maxsize=256)
def _plan(problem: Problem, mode: str, prof: Profile, topology: Topology | str | None, kernel: str,
          declared: tuple[Method, ...], layout: str | None, ulysses: int | None, memory_gib: float,
          features: frozenset[str], pad: bool, transports: tuple[str, ...] = ("nccl",)) -> Ranking:
    topo = get_topology(topology, prof)
    topo.check_world(problem.world)
    if kernel not in prof.kernel_names:
        raise ValueError(f"kernel must be one of {list(prof.kernel_names)} for profile {prof.name!r}, got {kernel!r}")
    machine = Machine(prof, Network(topo, prof), kernel)
    limit = single_gpu_ms(problem, machine, mode)
    entries = []
    for m in declared:
        for cand in _with_transports(_candidates(m, problem, topo, layout, ulysses), m, transports):
            why = _why_not(cand, m, problem, features, pad) + _transport_why_not(cand, problem, topo, prof)
            pred = None if why else m.cost(problem, cand, machine)
            mem = pred.peak_mem(mode) / 2**30 if pred else math.inf
            if pred and mem > memory_gib:
                why = [f"needs {mem:.1f} GiB per device, more than {memory_gib:g} GiB"]
            t = pred.time_ms(mode) if pred else math.inf
            entries.append(Entry(cand, cand.label(problem.world, show_layout=len(m.layouts) > 1), pred, t,
                                 limit / t if t else 0.0, mem, tuple(why)))
    entries.sort(key=lambda e: (not e.ok, e.time_ms, e.label))
    return Ranking(problem, mode, prof.name, topo.name, kernel, limit, tuple(entries), _reason(entries, mode))


def _candidates(m: Method, p: Problem, topo: Topology, layout: str | None, ulysses: int | None) -> list[Candidate]:
    """``m``'s configurations on the layouts it may use here: the caller's (or all), serving the mask, and
    document layouts only for a packed problem (``Method.candidates``, else one per layout)."""
    if ulysses is not None and m.mesh_dims == 1:
        return []                                                         # a 2D mesh runs 2D methods only
    layouts = tuple(lay for lay in m.layouts if (layout is None or lay == layout)
                    and (lay in LAYOUTS or p.documents is not None) and (lay in m.serves_causal or not p.causal))
    if m.candidates is not None:
        return m.candidates(p, topo, layouts, ulysses)
    if m.mesh_dims == 1:
        return [Candidate(m.name, lay) for lay in layouts]
    W = p.world
    degrees = [ulysses] if ulysses is not None else [u for u in range(2, W) if W % u == 0]
    return [Candidate(m.name, lay, u) for u in degrees for lay in layouts]


def _with_transports(cands: list[Candidate], m: Method, transports: tuple[str, ...]) -> list[Candidate]:
    """``cands`` on each of ``transports`` for a method that takes the ``transport`` option (its default as it
    is, any other as the option), else as they are."""
    if "transport" not in m.options:
        return cands
    out = []
    for t in (t for t in transports if t in m.modelled_transports):
        extra = () if t == m.options["transport"] else (("transport", t),)
        out += [replace(c, options=tuple(sorted((*c.options, *extra)))) for c in cands]
    return out


def _transport_why_not(c: Candidate, p: Problem, topo: Topology, prof: Profile) -> list[str]:
    """Why ``c``'s transport cannot run here: copy engines need one host and a profile that measured them."""
    if c.option("transport") != "copy_engine":
        return []
    why = []
    if p.world > topo.node_size:
        why.append(f"copy engines reach one host only ({topo.node_size} GPUs, world {p.world})")
    if not prof.has_link("p2p_copy"):
        why.append(f"profile {prof.name!r} has not measured copy engines (p2p_copy)")
    return why


def _why_not(c: Candidate, m: Method, p: Problem, features: frozenset[str], pad: bool) -> list[str]:
    """Why ``c`` cannot run on ``p``: features, options, the layout's length rules, the method's own rules."""
    why = []
    missing = sorted(features - m.features)
    if missing:
        why.append(f"{c.method} does not support {', '.join(missing)}")
    extra = sorted(set(dict(c.options)) - set(m.options))
    if extra:
        why.append(f"{c.method} has no option {', '.join(extra)}")
    why += _length_rules(c, m, p, pad)
    if m.why_not is not None:
        why += m.why_not(p, c)
    return why


def _length_rules(c: Candidate, m: Method, p: Problem, pad: bool) -> list[str]:
    """What the method's placement of ``c.layout`` needs of the length (and of the documents)."""
    W, S = p.world, p.seq_len
    try:
        lay, _ = m.placement(c.layout, GroupSizes(W, c.ulysses), p.documents)
    except ValueError as e:                           # a document layout the documents cannot be cut into
        return [str(e)]
    div = lay.divisor
    if S % div and (not pad or S < div):
        return [f"seq_len {S} must be {'at least' if pad else 'a multiple of'} {div} for {c.label(W)}"]
    return []


def _reason(entries: list[Entry], mode: str) -> str:
    ok = [e for e in entries if e.ok]
    if not entries:
        return "no method offers a configuration for this problem (its layout, mesh and methods)"
    if not ok:
        return "no candidate can run: " + " | ".join(f"{e.label}: {'; '.join(e.why_not)}" for e in entries[:6])
    best = ok[0]
    pr = best.prediction
    assert pr is not None           # ok entries are predicted (Entry.ok)
    text = f"{best.label}: {best.time_ms:.3f} ms {mode}, {best.efficiency:.0%} of the single-GPU kernel rate"
    others = [e for e in ok[1:] if e.candidate.method != best.candidate.method]
    if others:
        gap = others[0].time_ms / best.time_ms - 1
        text += f", {gap:.1%} ahead of {others[0].label}"
    exposed = pr.exposed_ms(mode)
    text += (f"; {exposed:.3f} ms of communication exposed" if exposed > 0.005 * best.time_ms
             else "; communication hidden")
    if pr.notes:
        text += f"; {pr.notes[0]}"
    return text


@functools.lru_cache(maxsize=1024)
def _choose(q_shape: tuple[int, ...], kv_heads: int, causal: bool, window: tuple[int, int], world: int,
            mesh_dims: int, layout: str, profile: Profile, ulysses: int | None, dtype: str, mode: str,
            features: frozenset[str], kernel: str, grad_dtype: str, declared: tuple[Method, ...],
            documents: tuple[int, ...] | None, transports: tuple[str, ...] = ("nccl",), mask: Any = None
            ) -> tuple[str, tuple[tuple[str, Any], ...], str]:
    B, L, H, D = q_shape
    names = [m.name for m in declared if m.mesh_dims == mesh_dims and layout in m.layouts]
    topology = None if world <= profile.gpus_per_node else "nvswitch"
    ranking = plan(seq_len=L * world, heads=H, kv_heads=kv_heads, world=world, head_dim=D, batch=B, causal=causal,
                   window=window, dtype=dtype, grad_dtype=grad_dtype, mode=mode, profile=profile,
                   topology=topology, kernel=kernel, methods=names, layout=layout,
                   ulysses=ulysses if mesh_dims == 2 else None, features=features, cu_seqlens=documents,
                   transports=transports, mask_mod=mask)
    best = ranking.best
    if best is None:
        raise NotImplementedError(f"method='auto' found no available method for layout={layout!r} on a {mesh_dims}D "
                                  f"mesh of {world} ranks: {ranking.reason}")
    log.info(AUTO_CHOICE, best.candidate.method,
             dict(best.candidate.options), q_shape, kv_heads, world, profile.name,
             "" if documents is None else f", {len(documents) - 1} documents", ranking.reason)
    return best.candidate.method, best.candidate.options, ranking.reason


def choose(q_shape: Sequence[int], kv_heads: int, causal: bool, window: tuple[int, int], world: int, mesh_dims: int,
           layout: str, profile: Profile | str | Path | None = None, *, ulysses: int | None = None,
           dtype: Any = "bfloat16", device: str = "cuda", mode: str = "fwd+bwd", features: Iterable[str] = (),
           kernel: str = "auto", grad_dtype: Any = "float32",
           cu_seqlens: Sequence[int] | Any | None = None, transports: Sequence[str] = ("nccl",), mask: Any = None
           ) -> tuple[str, dict[str, Any], str]:
    """The method ``seqpar.attention(method="auto")`` runs (Note [Auto is deterministic]).

    Args:
        q_shape: the LOCAL query shape ``(B, L, H, D)``; the global length is ``L * world``.
        kv_heads: KV heads.
        causal, window: the mask.
        world: ranks in the sequence-parallel group.
        mesh_dims: 1 (a group or 1D mesh) or 2 (a ("ulysses", "ring") mesh: 2D methods with ``ulysses`` fixed).
        layout: the caller's token layout; only methods accepting it are considered.
        profile: a Profile, built-in name or path; default the built-in profile of ``device``.
        kernel: the kernel the call runs ("auto": the profile's default kernel; a kernel the profile
            has no numbers for is planned with the default kernel's numbers).
        cu_seqlens: the batch's global document boundaries (a sequence or 1-D tensor): methods are ranked
            on this batch's work (Note [Packed batches]); a new batch each step costs O(W^2) block plans.
        transports: the transports the caller allows (``plan``'s); a choice on another than a method's default
            names it in the options.
        mask: the call's named mask (``plan``'s ``mask_mod``), or None (also for a generic ``mask_mod``, whose
            blocks only its evaluation on the device shows).

    Returns:
        ``(method, options, reason)``: the method name, its method-specific options, and why.
    """
    prof = load_profile(profile) if profile is not None else default_profile(device)
    kern = kernel if kernel in prof.kernel_names else prof.default_kernel
    documents = _documents(cu_seqlens)
    method, options, reason = _choose(tuple(int(x) for x in q_shape), int(kv_heads), bool(causal), tuple(window),
                                      int(world), int(mesh_dims), layout, prof, ulysses,
                                      str(dtype).removeprefix("torch."), mode, frozenset(features), kern,
                                      str(grad_dtype).removeprefix("torch."), _declarations(None), documents,
                                      tuple(transports), mask)
    return method, dict(options), reason
