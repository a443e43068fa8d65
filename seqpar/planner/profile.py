"""What a machine can do, measured once: kernel throughput, link bandwidth, latency, overlap loss, HBM.

A ``Profile`` is the planner's only view of hardware (ALGORITHMS.md §12.1). It is a frozen, hashable
dataclass (plans are cached on it) with a JSON form; ``load_profile(name_or_path)`` reads one of the
built-in profiles shipped under ``seqpar/planner/profiles/`` or a file written by ``python -m
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
    size; below it the time falls linearly from the smallest measured transfer to ``alpha_us`` at zero
    bytes (latency-bound small messages). ``alpha_us`` itself is the fixed cost of one schedule step
    (launch, sync, Python), added once per step by the cost model whether or not the transfer hides.
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

PATTERNS = ("p2p", "p2p_bidir", "a2a", "allgather", "reduce_scatter", "allpairs")
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
    """Fixed cost of one schedule step: launches, synchronisation, Python (Note [Link time])."""
    launch_us: float
    """Fixed cost of one kernel call."""
    hbm_gbps: float
    """Achievable memory bandwidth (copy), for merges and accumulator passes."""
    merge_passes: float
    """fp32 accumulator passes one MERGE costs (unfused elementwise ops: about 5)."""
    overlap_loss: tuple[tuple[str, float], ...]
    """Per pattern: fraction of the hidden time lost when the transfer runs beside a kernel (δ)."""
    memory_gib: float
    """Device memory, for feasibility."""
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
        a = min(self.alpha_us * 1e-3, t0)
        return a + (t0 - a) * nbytes / m0

    def overlap(self, pattern: str) -> float:
        d = dict(self.overlap_loss)
        while pattern not in d and pattern in _LINK_FALLBACK:
            pattern = _LINK_FALLBACK[pattern]
        return d.get(pattern, 0.0)

    def _link(self, pattern: str) -> Curve:
        curves = {lk.pattern: lk.curve for lk in self.links}
        if pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
        while pattern not in curves:
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
            "memory_gib": self.memory_gib, "source": self.source, "derived_from": self.derived_from,
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
                memory_gib=float(d["memory_gib"]), source=str(d.get("source", "")),
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


def _other(mask: str) -> str:
    return "causal" if mask == "full" else "full"


def _other_dir(direction: str) -> str:
    return "bwd" if direction == "fwd" else "fwd"


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with seqpar."""
    root = resources.files("seqpar.planner") / "profiles"
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
        text = (resources.files("seqpar.planner") / "profiles" / f"{name}.json").read_text()
        _BUILTIN[name] = Profile.from_dict(json.loads(text))
    return _BUILTIN[name]
