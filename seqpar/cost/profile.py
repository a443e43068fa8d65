"""What a machine can do, measured once: kernel throughput, link bandwidth, latency, overlap loss, HBM.

A ``Profile`` is the planner's only view of hardware (ALGORITHMS.md §12.1). It is a frozen, hashable
dataclass (plans are cached on it) with a JSON form; ``load_profile(name_or_path)`` reads one of the
built-in profiles shipped under ``seqpar/cost/profiles/`` or a file written by ``python -m
seqpar.calibrate``. Every number carries its provenance in ``source`` (measured, derived or fitted).

Curves::

    kernel rate   (kernel, mask, direction) -> TFLOP/s at a call of "size" n tokens, n = sqrt(rows * cols)
    link rate     pattern -> GB/s per rank at a message of m bytes per rank

Both interpolate linearly in log2(x) and hold the end values beyond the measured range. Link patterns:
"p2p" (ring, one direction), "p2p_bidir" (both directions at once, bytes summed), "a2a"
(``all_to_all_single``), "allgather" (bytes received per rank), "reduce_scatter" (bytes sent per rank) and
"allpairs" (batched P2P to every peer at once, TASP's round). A pattern a profile lacks falls back to its
nearest measured relative (``_LINK_FALLBACK``), which the profile's ``source`` says.

Note [Link time]
    ``link_ms(pattern, m)`` is the pure transfer time ``m / B(m)`` for m at or above the smallest measured
    size; below it the time falls linearly from the smallest measured transfer to the pattern's latency
    at zero bytes (latency-bound small messages). The latency is ``latency_us[pattern]`` (its fallback
    relatives', else ``alpha_us``).

Note [Fixed costs]
    Time that does not scale with the problem, in three kinds (Note [Step time] in ``model.py`` says where
    each is added):

    * per call and pass, ``call_us["fwd"]`` / ``call_us["bwd"]``: validation, the agreement round
      (``seqpar.agreement``), setup, the autograd hand-off - paid once however many steps follow;
    * per schedule step of a method and pass, ``step_us["ring/fwd"]``, ...: posting and waiting on the
      step's exchange, its kernel launches and merges; a method without an entry pays ``alpha_us``;
    * per collective, ``latency_us[pattern]``: what a transfer of almost no bytes takes (Note [Link time]).

    The first two are host time and overlap with the device's work up to ``host_overlap_loss`` (κ,
    Note [Step time] in ``model.py``). ``python -m seqpar.planner.fit`` fits ``call_us``, ``step_us``
    and κ to benchmark times (Note [Fixed-cost fit] there). ``alpha_us`` alone (no ``call_us``, no
    ``step_us``, κ = 1) is the older single-constant model that ``python -m seqpar.calibrate`` still
    measures: one P2P ring step of 4 KiB.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["Curve", "KernelRate", "LinkRate", "Profile", "builtin_profiles", "load_profile"]

PATTERNS = ("p2p", "p2p_bidir", "a2a", "allgather", "reduce_scatter", "allpairs", "p2p_copy")
"""``p2p_copy``: a ring step on copy engines over symmetric memory (Note [Copy-engine ring] in
``seqpar.comm.symmetric``); it falls back to no other pattern - a profile without its curve plans no copy-engine
configuration (``has_link``)."""
_LINK_FALLBACK = {"p2p_bidir": "p2p", "allpairs": "a2a", "reduce_scatter": "allgather", "allgather": "p2p",
                  "a2a": "p2p"}
MASKS = ("full", "causal")
DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class Curve:
    """``y(x)`` sampled at increasing ``x > 0``; log2-linear in between, constant beyond the ends."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [x for x, _ in self.points]
        if not self.points or any(x <= 0 for x in xs) or xs != sorted(set(xs)):
            raise ValueError(f"curve points must have distinct increasing x > 0, got {self.points}")
        if any(y <= 0 for _, y in self.points):
            raise ValueError(f"curve values must be positive, got {self.points}")

    def at(self, x: float) -> float:
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if x <= x1:
                t = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
                return y0 + t * (y1 - y0)
        return pts[-1][1]

    @staticmethod
    def of(points) -> Curve:
        return Curve(tuple((float(x), float(y)) for x, y in points))


@dataclass(frozen=True)
class KernelRate:
    """Throughput of one local kernel: ``curve`` maps call size (tokens) to TFLOP/s."""

    kernel: str
    mask: str
    direction: str
    curve: Curve


@dataclass(frozen=True)
class LinkRate:
    """Per-rank bandwidth of one communication pattern: ``curve`` maps bytes per rank to GB/s."""

    pattern: str
    curve: Curve


@dataclass(frozen=True, kw_only=True)
class Profile:
    """One machine's measured (or derived) constants; see the module docstring for units."""

    name: str
    """Short name ("h200-nvswitch"); built-in profiles are loaded by it."""
    device: str
    """"cuda" or "cpu"."""
    gpu: str
    """Device model the kernel numbers come from."""
    gpus_per_node: int
    """Ranks one node of this kind holds; the measured link curves are valid inside one node."""
    interconnect: str
    """What the link curves were measured over ("NVSwitch", "gloo/loopback", ...)."""
    dtype: str
    """Element type of the kernel measurements ("bfloat16")."""
    head_dim: int
    """Head dim of the kernel measurements (rates at other head dims are taken as equal)."""
    default_kernel: str
    """The kernel ``kernel="auto"`` runs on this device for full and causal blocks."""
    kernels: tuple[KernelRate, ...]
    links: tuple[LinkRate, ...]
    alpha_us: float
    """Fixed cost of one schedule step where ``step_us`` has no entry, and the default latency (Note [Fixed costs])."""
    launch_us: float
    """Fixed cost of one kernel call."""
    hbm_gbps: float
    """Achievable memory bandwidth (copy), for merges and accumulator passes."""
    merge_passes: float
    """fp32 accumulator passes one MERGE costs (unfused elementwise ops: about 5-10)."""
    overlap_loss: tuple[tuple[str, float], ...]
    """Per pattern: fraction of the hidden time lost when the transfer runs beside a kernel (δ)."""
    memory_gib: float
    """Device memory, for feasibility."""
    call_us: tuple[tuple[str, float], ...] = ()
    """Per pass ("fwd", "bwd"): fixed cost of one call (Note [Fixed costs]); absent: 0."""
    step_us: tuple[tuple[str, float], ...] = ()
    """Per method and pass ("ring/fwd", "ulysses/bwd", ...): fixed cost of one step; absent: ``alpha_us``."""
    latency_us: tuple[tuple[str, float], ...] = ()
    """Per pattern: time of a transfer of no bytes (Note [Link time]); absent: ``alpha_us``."""
    permute_gelems: float = 0.0
    """G elements per second of a row permute (``index_select``, all-gather's global order); 0: a copy of
    2-byte elements at ``hbm_gbps`` (``hbm_gbps / 4``)."""
    varlen_tile_us: tuple[tuple[str, float], ...] = ()
    """Per pass ("fwd", "bwd"): GPU microseconds one query tile of a packed call costs beyond its pairs, per head
    (Note [Query tiles of packed calls] in ``model.py``); absent: 0."""
    band_tflops: tuple[tuple[str, Curve], ...] = ()
    """Per pass ("fwd", "bwd"): TFLOP/s of a windowed band's call by its size (tokens), on the kernel ``auto`` runs
    wide bands on (flex on sm90, Note [Bands on flex]); absent: the default kernel's causal rate (Note [Band
    rates] in ``model.py``)."""
    host_overlap_loss: float = 1.0
    """κ: the part of the shorter of a pass's host time (fixed costs) and device time that does not overlap
    (Note [Step time] in ``model.py``); 1 adds the fixed costs to the device time."""
    source: str = ""
    """Provenance of the numbers: measured where, derived how, fitted to what."""
    derived_from: str | None = None
    meta: tuple[tuple[str, str], ...] = field(default=())
    """Host, versions and the command that produced the profile."""

    def __post_init__(self) -> None:
        for k in self.kernels:
            if k.mask not in MASKS or k.direction not in DIRECTIONS:
                raise ValueError(f"kernel rate mask must be in {MASKS} and direction in {DIRECTIONS}, got "
                                 f"{k.mask!r}, {k.direction!r}")
        for lk in self.links:
            if lk.pattern not in PATTERNS:
                raise ValueError(f"link pattern must be one of {PATTERNS}, got {lk.pattern!r}")
        for name, table, keys in (("call_us", self.call_us, DIRECTIONS), ("latency_us", self.latency_us, PATTERNS),
                                  ("varlen_tile_us", self.varlen_tile_us, DIRECTIONS),
                                  ("band_tflops", self.band_tflops, DIRECTIONS)):
            bad = [k for k, _ in table if k not in keys]
            if bad:
                raise ValueError(f"{name} keys must be in {keys}, got {bad}")
        bad = [k for k, _ in self.step_us if k.count("/") != 1 or k.split("/")[1] not in DIRECTIONS]
        if bad:
            raise ValueError(f"step_us keys must be '<method>/fwd' or '<method>/bwd', got {bad}")
        if not self.permute_gelems >= 0:
            raise ValueError(f"permute_gelems must be >= 0, got {self.permute_gelems}")
        if not 0.0 <= self.host_overlap_loss <= 1.0:
            raise ValueError(f"host_overlap_loss must be in [0, 1], got {self.host_overlap_loss}")
        for name in ("call_us", "step_us", "latency_us", "varlen_tile_us"):
            neg = [k for k, v in getattr(self, name) if not v >= 0]
            if neg:
                raise ValueError(f"{name} values must be >= 0, got {dict(getattr(self, name))}")
        if not any(lk.pattern == "p2p" for lk in self.links):
            raise ValueError(f"profile {self.name!r} must have a 'p2p' link curve (every fallback ends there)")
        if self.default_kernel not in self.kernel_names:
            raise ValueError(f"default_kernel must be one of {self.kernel_names}, got {self.default_kernel!r}")

    # --- lookups -------------------------------------------------------------------------------------
    @property
    def kernel_names(self) -> tuple[str, ...]:
        return tuple(sorted({k.kernel for k in self.kernels}))

    def rate_tflops(self, kernel: str, mask: str, direction: str, tokens: float) -> float:
        """TFLOP/s of ``kernel`` on a call of ``tokens = sqrt(rows * cols)``; masks/directions fall back."""
        table = {(k.mask, k.direction): k.curve for k in self.kernels if k.kernel == kernel}
        if not table:
            raise ValueError(f"kernel must be one of {list(self.kernel_names)} for profile {self.name!r}, "
                             f"got {kernel!r}")
        for key in ((mask, direction), (_other(mask), direction), (mask, _other_dir(direction)),
                    (_other(mask), _other_dir(direction))):
            if key in table:
                return table[key].at(tokens)
        raise AssertionError("unreachable: a kernel has at least one curve")

    def link_gbps(self, pattern: str, nbytes: float) -> float:
        return self._link(pattern).at(nbytes)

    def link_ms(self, pattern: str, nbytes: float) -> float:
        """Transfer time of ``nbytes`` per rank in ``pattern`` (Note [Link time])."""
        if nbytes <= 0:
            return 0.0
        curve = self._link(pattern)
        m0, b0 = curve.points[0]
        if nbytes >= m0:
            return nbytes / (curve.at(nbytes) * 1e9) * 1e3
        t0 = m0 / (b0 * 1e9) * 1e3
        a = min(self.latency(pattern) * 1e-3, t0)
        return a + (t0 - a) * nbytes / m0

    def latency(self, pattern: str) -> float:
        """Microseconds of a transfer of no bytes in ``pattern`` (Note [Link time])."""
        return self._fallback(dict(self.latency_us), pattern, self.alpha_us)

    def step_cost_us(self, method: str, direction: str) -> float:
        """Fixed microseconds of one schedule step of ``method`` in ``direction`` (Note [Fixed costs])."""
        return dict(self.step_us).get(f"{method}/{direction}", self.alpha_us)

    def call_cost_us(self, direction: str) -> float:
        """Fixed microseconds of one call's ``direction`` pass (Note [Fixed costs])."""
        return dict(self.call_us).get(direction, 0.0)

    def tile_cost_us(self, direction: str) -> float:
        """GPU microseconds of one query tile (per head) of a packed call's ``direction`` pass beyond its pairs
        (Note [Query tiles of packed calls])."""
        return dict(self.varlen_tile_us).get(direction, 0.0)

    def band_rate(self, direction: str, tokens: float) -> float | None:
        """TFLOP/s of a windowed band's call of ``tokens = sqrt(rows * cols)`` in ``direction``, or None where the
        profile measured none (Note [Band rates] in ``model.py``)."""
        curve = dict(self.band_tflops).get(direction)
        return None if curve is None else curve.at(tokens)

    def overlap(self, pattern: str) -> float:
        return self._fallback(dict(self.overlap_loss), pattern, 0.0)

    @staticmethod
    def _fallback(table: dict[str, float], pattern: str, default: float) -> float:
        while pattern not in table and pattern in _LINK_FALLBACK:
            pattern = _LINK_FALLBACK[pattern]
        return table.get(pattern, default)

    def has_link(self, pattern: str) -> bool:
        """Whether the profile measured ``pattern`` itself (no fallback)."""
        return any(lk.pattern == pattern for lk in self.links)

    def _link(self, pattern: str) -> Curve:
        curves = {lk.pattern: lk.curve for lk in self.links}
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        while pattern not in curves:
            if pattern not in _LINK_FALLBACK:
                raise ValueError(f"profile {self.name!r} has no {pattern!r} link curve")
            pattern = _LINK_FALLBACK[pattern]
        return curves[pattern]

    # --- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "device": self.device, "gpu": self.gpu, "gpus_per_node": self.gpus_per_node,
            "interconnect": self.interconnect, "dtype": self.dtype, "head_dim": self.head_dim,
            "default_kernel": self.default_kernel,
            "kernels": [{"kernel": k.kernel, "mask": k.mask, "direction": k.direction,
                         "tflops_at_tokens": [list(p) for p in k.curve.points]} for k in self.kernels],
            "links": [{"pattern": lk.pattern, "gbps_at_bytes": [list(p) for p in lk.curve.points]}
                      for lk in self.links],
            "alpha_us": self.alpha_us, "launch_us": self.launch_us, "hbm_gbps": self.hbm_gbps,
            "merge_passes": self.merge_passes, "overlap_loss": dict(self.overlap_loss),
            "memory_gib": self.memory_gib, "call_us": dict(self.call_us), "step_us": dict(self.step_us),
            "latency_us": dict(self.latency_us), "permute_gelems": self.permute_gelems,
            "varlen_tile_us": dict(self.varlen_tile_us),
            "band_tflops": {d: [list(p) for p in c.points] for d, c in self.band_tflops},
            "host_overlap_loss": self.host_overlap_loss, "source": self.source, "derived_from": self.derived_from,
            "meta": dict(self.meta),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Profile:
        try:
            return Profile(
                name=str(d["name"]), device=str(d["device"]), gpu=str(d["gpu"]),
                gpus_per_node=int(d["gpus_per_node"]), interconnect=str(d["interconnect"]), dtype=str(d["dtype"]),
                head_dim=int(d["head_dim"]), default_kernel=str(d["default_kernel"]),
                kernels=tuple(KernelRate(k["kernel"], k["mask"], k["direction"], Curve.of(k["tflops_at_tokens"]))
                              for k in d["kernels"]),
                links=tuple(LinkRate(lk["pattern"], Curve.of(lk["gbps_at_bytes"])) for lk in d["links"]),
                alpha_us=float(d["alpha_us"]), launch_us=float(d["launch_us"]), hbm_gbps=float(d["hbm_gbps"]),
                merge_passes=float(d["merge_passes"]),
                overlap_loss=tuple(sorted((str(k), float(v)) for k, v in d["overlap_loss"].items())),
                memory_gib=float(d["memory_gib"]), call_us=_table(d.get("call_us")), step_us=_table(d.get("step_us")),
                latency_us=_table(d.get("latency_us")), permute_gelems=float(d.get("permute_gelems", 0.0)),
                varlen_tile_us=_table(d.get("varlen_tile_us")),
                band_tflops=tuple(sorted((str(k), Curve.of(v)) for k, v in d.get("band_tflops", {}).items())),
                host_overlap_loss=float(d.get("host_overlap_loss", 1.0)),
                source=str(d.get("source", "")),
                derived_from=d.get("derived_from"),
                meta=tuple(sorted((str(k), str(v)) for k, v in d.get("meta", {}).items())))
        except KeyError as e:
            raise ValueError(f"a profile must have the key {e.args[0]!r}") from None

    def to_json(self) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        return re.sub(r"\[\s+([-+.\deE]+),\s+([-+.\deE]+)\s+\]", r"[\1, \2]", text) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    def replace(self, **kw: Any) -> Profile:
        from dataclasses import replace

        return replace(self, **kw)


def _table(d: Mapping[str, Any] | None) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((str(k), float(v)) for k, v in (d or {}).items()))


def _other(mask: str) -> str:
    return "causal" if mask == "full" else "full"


def _other_dir(direction: str) -> str:
    return "bwd" if direction == "fwd" else "fwd"


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with seqpar."""
    root = resources.files("seqpar.cost") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(profile: Profile | str | Path) -> Profile:
    """A ``Profile`` from itself, a built-in name (``builtin_profiles()``) or a JSON path."""
    if isinstance(profile, Profile):
        return profile
    if not isinstance(profile, (str, Path)):
        raise TypeError(f"profile must be a Profile, a built-in name or a path, got {type(profile).__name__}")
    if isinstance(profile, str) and profile in builtin_profiles():
        return _builtin(profile)
    path = Path(profile)
    if not path.is_file():
        raise ValueError(f"profile must be one of {builtin_profiles()} or a JSON file, got {str(profile)!r}")
    return Profile.from_dict(json.loads(path.read_text()))


_BUILTIN: dict[str, Profile] = {}


def _builtin(name: str) -> Profile:
    if name not in _BUILTIN:
        text = (resources.files("seqpar.cost") / "profiles" / f"{name}.json").read_text()
        _BUILTIN[name] = Profile.from_dict(json.loads(text))
    return _BUILTIN[name]
