"""Strategy search: every method configuration that fits, ranked by the cost model, with the reason.

    seqpar.plan(seq_len=131072, heads=32, kv_heads=8, world=4)        # -> Ranking (print it)
    seqpar.planner.choose(q_shape, kv_heads, causal, window, world, mesh_dims, layout)   # method="auto"

``plan`` enumerates methods x layouts x Ulysses/ring degrees x method options (all-gather's
``heads_k_stride``, TASP's schedule, double ring's node size), drops those that cannot run (head-count
rules, divisibility, a missing feature, memory) with the rule that excludes them, predicts the rest
(``cost.py``) and sorts by predicted time. Results are cached per signature (``functools.lru_cache``):
every argument is hashable, profiles included.

Note [Auto is deterministic]
    ``choose`` is a pure function of its arguments and a built-in or explicitly passed profile: no
    measurement, no clock, no rank-dependent input, and ties break by the candidate's label. Every rank
    that calls ``seqpar.attention(method="auto")`` with the same shapes therefore makes the same choice,
    with no collective. Auto never changes the token layout - the caller already sharded - so it picks
    among the available methods whose layouts include the caller's and whose mesh dimensionality matches.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import methods as _methods
from .cost import Candidate, Machine, Prediction, Problem, head_chunk_valid, kv_wire_heads, predict, single_gpu_ms
from .profile import Profile, load_profile
from .topology import Network, Topology, get_topology

__all__ = ["ALL_METHODS", "Entry", "Ranking", "choose", "default_profile", "plan"]

log = logging.getLogger("seqpar.planner")

#: every method the model knows; what each accepts when its module is not merged yet (ALGORITHMS.md)
_SPEC: dict[str, tuple[tuple[str, ...], int, tuple[str, ...]]] = {
    "ring": (("contiguous", "zigzag", "stripe"), 1, ()),
    "allgather": (("contiguous", "zigzag"), 1, ("heads_k_stride",)),
    "ulysses": (("contiguous",), 1, ()),
    "usp": (("contiguous", "zigzag", "stripe"), 2, ()),
    "tokenring": (("zigzag", "contiguous"), 1, ()),
    "tasp": (("zigzag", "contiguous"), 1, ("schedule",)),
    "double_ring": (("zigzag",), 1, ("node_size",)),
}
ALL_METHODS = tuple(_SPEC)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
MODES = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class _Info:
    layouts: tuple[str, ...]
    mesh_dims: int
    options: tuple[str, ...]
    features: frozenset[str] | None      # None: not merged, features unknown
    available: bool


def _info(name: str) -> _Info:
    if name in _methods.available():
        m = _methods.get(name)
        return _Info(tuple(m.layouts), int(m.mesh_dims), tuple(m.options), frozenset(m.features), True)
    layouts, dims, opts = _SPEC[name]
    return _Info(layouts, dims, opts, None, False)


@dataclass(frozen=True)
class Entry:
    """One ranked candidate: its prediction, or why it cannot run."""

    candidate: Candidate
    label: str
    prediction: Prediction | None
    time_ms: float
    efficiency: float
    peak_mem_gib: float
    available: bool
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

    @property
    def best(self) -> Entry | None:
        return self.entries[0] if self.entries and self.entries[0].ok else None

    def table(self, limit: int | None = None) -> str:
        p = self.problem
        head = (f"S={p.seq_len} B={p.batch} H={p.heads}/{p.kv_heads} D={p.head_dim} W={p.world} "
                f"{'causal' if p.causal else 'full'}" + (f" window={p.window}" if p.window != (-1, -1) else "")
                + f" | {self.mode} | profile {self.profile}, {self.topology}, kernel {self.kernel} | "
                f"single-GPU limit {self.limit_ms:.3f} ms")
        rows = [head, f"{'#':>3} {'method':<28} {'time ms':>10} {'eff':>6} {'mem GiB':>8} {'exposed ms':>11}  notes"]
        for i, e in enumerate(self.entries[:limit]):
            if e.ok:
                pr = e.prediction
                assert pr is not None
                note = "; ".join(pr.notes[:2]) + ("" if e.available else " [not in this build]")
                rows.append(f"{i + 1:>3} {e.label:<28} {e.time_ms:>10.3f} {e.efficiency:>6.1%} {e.peak_mem_gib:>8.2f} "
                            f"{pr.exposed_ms(self.mode):>11.3f}  {note}")
            else:
                rows.append(f"  - {e.label:<28} {'-':>10} {'-':>6} {'-':>8} {'-':>11}  cannot run: "
                            + "; ".join(e.why_not))
        rows.append(f"choice: {self.reason}")
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


def plan(*, seq_len: int, heads: int, world: int, kv_heads: int | None = None, head_dim: int = 128, batch: int = 1,
         causal: bool = True, window: tuple[int, int] = (-1, -1), dtype: Any = "bfloat16",
         grad_dtype: Any = "float32", mode: str = "fwd+bwd", profile: Profile | str | Path | None = None,
         topology: Topology | str | None = None, kernel: str | None = None,
         methods: Sequence[str] | str | None = None, layout: str | None = None, ulysses: int | None = None,
         memory_gib: float | None = None, features: Iterable[str] = (), pad: bool = False) -> Ranking:
    """Rank every method configuration for one attention layer by predicted time.

    Args:
        seq_len, heads, kv_heads, head_dim, batch: the global problem (kv_heads defaults to heads).
        world: ranks in the sequence-parallel group.
        causal, window: the mask (flash-attn window convention).
        dtype, grad_dtype: activation dtype and the dtype of gradient partials on the wire.
        mode: "fwd" or "fwd+bwd": which time ranks.
        profile: a Profile, a built-in name or a JSON path (default: the built-in H200 profile).
        topology: a Topology or preset name (``seqpar.planner.topology.PRESETS``); default: one node of
            the profile's host, which needs ``world <= profile.gpus_per_node``.
        kernel: the local kernel (default: the profile's ``default_kernel``, what "auto" runs).
        methods: names to consider; None = those available in this build; "all" = every modelled method.
        layout: only candidates with this token layout (USP: the ring layout).
        ulysses: only USP with this Ulysses degree (a fixed 2D mesh).
        memory_gib: per-device memory limit (default: the profile's).
        features: features the call needs ("window", "varlen", "padding"); merged methods that lack one
            cannot run.
        pad: assume lengths a layout cannot split are padded (the simulator); otherwise they exclude.

    Returns:
        A ``Ranking``: ``best``, ``entries`` (time, efficiency, memory, notes, or why not) and ``reason``.
    """
    prof = load_profile(profile) if profile is not None else default_profile()
    if methods is None:
        names = tuple(m for m in ALL_METHODS if m in _methods.available())
    elif methods == "all":
        names = ALL_METHODS
    else:
        names = tuple(methods)
        bad = [m for m in names if m not in _SPEC]
        if bad:
            raise ValueError(f"methods must be names from {list(ALL_METHODS)}, got {bad}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    problem = Problem(seq_len=seq_len, heads=heads, kv_heads=kv_heads or heads, head_dim=head_dim, batch=batch,
                      world=world, causal=causal, window=tuple(window), dtype_bytes=_bytes(dtype),
                      grad_bytes=_bytes(grad_dtype))
    return _plan(problem, mode, prof, topology, kernel or prof.default_kernel, names, layout, ulysses,
                 memory_gib if memory_gib is not None else prof.memory_gib, frozenset(features), pad)


@functools.lru_cache(maxsize=256)
def _plan(problem: Problem, mode: str, prof: Profile, topology: Topology | str | None, kernel: str,
          names: tuple[str, ...], layout: str | None, ulysses: int | None, memory_gib: float,
          features: frozenset[str], pad: bool) -> Ranking:
    topo = get_topology(topology, prof)
    topo.check_world(problem.world)
    if kernel not in prof.kernel_names:
        raise ValueError(f"kernel must be one of {list(prof.kernel_names)} for profile {prof.name!r}, got {kernel!r}")
    machine = Machine(prof, Network(topo, prof), kernel)
    limit = single_gpu_ms(problem, machine, mode)
    entries = []
    for name in names:
        info = _info(name)
        for cand in _candidates(name, info, problem, topo, layout, ulysses):
            why = _why_not(cand, info, problem, features, pad)
            pred = None if why else predict(problem, cand, machine)
            mem = pred.peak_mem(mode) / 2**30 if pred else math.inf
            if pred and mem > memory_gib:
                why = [f"needs {mem:.1f} GiB per device, more than {memory_gib:g} GiB"]
            t = pred.time_ms(mode) if pred else math.inf
            entries.append(Entry(cand, cand.label(problem.world), pred, t, limit / t if t else 0.0, mem,
                                 info.available, tuple(why)))
    entries.sort(key=lambda e: (not e.ok, e.time_ms, e.label))
    return Ranking(problem, mode, prof.name, topo.name, kernel, limit, tuple(entries), _reason(entries, mode))


def _candidates(name: str, info: _Info, p: Problem, topo: Topology, layout: str | None,
                ulysses: int | None) -> list[Candidate]:
    layouts = [lay for lay in info.layouts if layout is None or lay == layout]
    W = p.world
    if name == "usp":
        degrees = [ulysses] if ulysses is not None else [u for u in range(2, W) if W % u == 0]
        return [Candidate("usp", lay, u) for u in degrees for lay in layouts]
    if ulysses is not None:
        return []                                                         # a 2D mesh runs USP only
    if name == "ulysses":
        return [Candidate("ulysses", lay) for lay in layouts]
    if name == "allgather":
        strides = [None] + [s for s in sorted({p.kv_heads // 2, p.kv_heads // 4, 1}, reverse=True)
                            if 0 < s < p.kv_heads and p.kv_heads % s == 0]
        return [Candidate(name, lay, options=() if s is None else (("heads_k_stride", s),))
                for lay in layouts for s in strides]
    if name == "tokenring" or name == "tasp":
        layouts = [lay for lay in layouts if lay == "zigzag" or not p.causal]
        if name == "tokenring":
            return [Candidate(name, lay) for lay in layouts]
        schedules = ("direct", "cycles") if W > topo.node_size else ("direct",)   # §8.4: direct inside a node
        return [Candidate(name, lay, options=(("schedule", s),)) for lay in layouts for s in schedules]
    if name == "double_ring":
        w = topo.node_size
        if not 1 < w < W or W % w:
            return []
        return [Candidate(name, lay, options=(("node_size", w),)) for lay in layouts]
    return [Candidate(name, lay) for lay in layouts]


def _divisor(c: Candidate, W: int) -> int:
    """The global length a candidate's layout splits evenly (TASP's W-1 sub-chunks may be uneven)."""
    if c.method == "usp":
        R = W // c.ulysses
        outer = {"contiguous": R, "zigzag": 2 * R, "stripe": R}[c.layout]
        return math.lcm(outer, W)
    return 2 * W if c.layout == "zigzag" else W


def _why_not(c: Candidate, info: _Info, p: Problem, features: frozenset[str], pad: bool) -> list[str]:
    why = []
    W, S = p.world, p.seq_len
    if info.features is not None:
        missing = sorted(features - info.features)
        if missing:
            why.append(f"{c.method} does not support {', '.join(missing)}")
        extra = sorted(set(dict(c.options)) - set(info.options))
        if extra:
            why.append(f"this build's {c.method} has no option {', '.join(extra)}")
    div = _divisor(c, W)
    if S % div and (not pad or S < div):
        why.append(f"seq_len {S} must be {'at least' if pad else 'a multiple of'} {div} for {c.label(W)}")
    U = W if c.method == "ulysses" else c.ulysses
    if c.method in ("ulysses", "usp"):
        if p.heads % U:
            why.append(f"ulysses degree {U} must divide heads={p.heads}")
        if p.kv_heads % U and U % p.kv_heads:
            why.append(f"ulysses degree {U} and kv_heads={p.kv_heads} must divide one another")
        elif c.method == "usp" and kv_wire_heads(p.kv_heads, U) % U:
            why.append(f"ulysses degree {U} must divide the KV heads on the wire")
        hc = c.option("head_chunks", 1)
        if hc != "auto" and not (isinstance(hc, int) and head_chunk_valid(p.heads, p.kv_heads, U, hc)):
            why.append(f"head_chunks {hc!r} must split heads={p.heads} and kv_heads={p.kv_heads} into groups "
                       f"that keep the slot rules over degree {U}")
    if c.method == "tasp" and c.option("schedule") == "cycles" and W in (4, 6):
        why.append(f"no Hamiltonian cycle decomposition exists for W={W} (use schedule='direct')")
    if c.method == "double_ring" and W % int(c.option("node_size")):
        why.append(f"node_size {c.option('node_size')} must divide W={W}")
    return why


def _reason(entries: list[Entry], mode: str) -> str:
    ok = [e for e in entries if e.ok]
    if not ok:
        return "no candidate can run: " + " | ".join(f"{e.label}: {'; '.join(e.why_not)}" for e in entries[:6])
    best = ok[0]
    pr = best.prediction
    assert pr is not None
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
            features: frozenset[str], kernel: str, grad_dtype: str) -> tuple[str, tuple[tuple[str, Any], ...], str]:
    B, L, H, D = q_shape
    names = tuple(m for m in ALL_METHODS if m in _methods.available() and _info(m).mesh_dims == mesh_dims
                  and layout in _info(m).layouts)
    topology = None if world <= profile.gpus_per_node else "nvswitch"
    ranking = plan(seq_len=L * world, heads=H, kv_heads=kv_heads, world=world, head_dim=D, batch=B, causal=causal,
                   window=window, dtype=dtype, grad_dtype=grad_dtype, mode=mode, profile=profile,
                   topology=topology, kernel=kernel, methods=names, layout=layout,
                   ulysses=ulysses if mesh_dims == 2 else None, features=features)
    best = ranking.best
    if best is None:
        raise NotImplementedError(f"method='auto' found no available method for layout={layout!r} on a {mesh_dims}D "
                                  f"mesh of {world} ranks: {ranking.reason}")
    log.info("method='auto' -> %s %s for q %s, kv_heads %d, world %d (profile %s): %s", best.candidate.method,
             dict(best.candidate.options), q_shape, kv_heads, world, profile.name, ranking.reason)
    return best.candidate.method, best.candidate.options, ranking.reason


def choose(q_shape: Sequence[int], kv_heads: int, causal: bool, window: tuple[int, int], world: int, mesh_dims: int,
           layout: str, profile: Profile | str | Path | None = None, *, ulysses: int | None = None,
           dtype: Any = "bfloat16", device: str = "cuda", mode: str = "fwd+bwd", features: Iterable[str] = (),
           kernel: str = "auto", grad_dtype: Any = "float32") -> tuple[str, dict[str, Any], str]:
    """The method ``seqpar.attention(method="auto")`` runs (Note [Auto is deterministic]).

    Args:
        q_shape: the LOCAL query shape ``(B, L, H, D)``; the global length is ``L * world``.
        kv_heads: KV heads.
        causal, window: the mask.
        world: ranks in the sequence-parallel group.
        mesh_dims: 1 (a group or 1D mesh) or 2 (a ("ulysses", "ring") mesh: USP with ``ulysses`` fixed).
        layout: the caller's token layout; only methods accepting it are considered.
        profile: a Profile, built-in name or path; default the built-in profile of ``device``.
        kernel: the kernel the call runs ("auto": the profile's default kernel; a kernel the profile
            has no numbers for is planned with the default kernel's numbers).

    Returns:
        ``(method, options, reason)``: the method name, its method-specific options, and why.
    """
    prof = load_profile(profile) if profile is not None else default_profile(device)
    kern = kernel if kernel in prof.kernel_names else prof.default_kernel
    method, options, reason = _choose(tuple(int(x) for x in q_shape), int(kv_heads), bool(causal), tuple(window),
                                      int(world), int(mesh_dims), layout, prof, ulysses,
                                      str(dtype).removeprefix("torch."), mode, frozenset(features), kern,
                                      str(grad_dtype).removeprefix("torch."))
    return method, dict(options), reason
