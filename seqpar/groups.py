"""The process groups a method runs on, derived from what the caller passes - no globals.

``SeqParallelGroups.resolve(mesh, dims)`` accepts a ``DeviceMesh`` (1D, or 2D with dims named
``"ulysses"`` and ``"ring"`` for USP), a ``ProcessGroup``, or None (the default group). The sequence-parallel
index of a rank - which piece of the sequence it holds - comes from its mesh coordinates, so both
placements of a 2D mesh (Ulysses groups on contiguous ranks, or strided) shard correctly.

``make_mesh(ulysses=U, ring=R)`` builds such a mesh over the default group.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .errors import rank_suffix

__all__ = ["GroupSizes", "SeqParallelGroups", "make_mesh"]

try:  # DeviceMesh is importable on every torch >= 2.4 build with distributed support
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
except ImportError:  # pragma: no cover
    DeviceMesh = None  # type: ignore[assignment,misc]
    init_device_mesh = None  # type: ignore[assignment]

ULYSSES, RING = "ulysses", "ring"


def _weak(group: dist.ProcessGroup | None) -> Any:
    return None if group is None else weakref.ref(group)


def _strong(ref: Any, what: str) -> dist.ProcessGroup | None:
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise RuntimeError(f"the {what} process group of this call was destroyed; pass a live group or mesh"
                           f"{rank_suffix()}")
    return group


@dataclass(frozen=True)
class GroupSizes:
    """What a placement reads of ``SeqParallelGroups`` (``Method.placement``), without process groups: the planner
    and a method's host-side planning place tokens with it."""

    world: int
    ulysses_size: int = 1
    index: int = 0

    @property
    def ring_size(self) -> int:
        return self.world // self.ulysses_size


@dataclass(frozen=True, init=False)
class SeqParallelGroups:
    """Groups of one sequence-parallel call.

    The process groups are held by weak reference: planned calls keep this object, and a cache must never
    keep a group alive after its owner drops it (gloo closes a group's connections only when the group
    object goes away - the fail-fast recipe of docs/RELIABILITY.md depends on it).

    Attributes:
        group: the whole sequence-parallel group for 1D methods; None for a 2D mesh (use the axes).
        ulysses: the Ulysses axis group (2D meshes), else None.
        ring: the ring axis group (2D meshes), else None.
        world: ranks in the sequence-parallel group (U * R for a 2D mesh).
        index: this rank's sequence-parallel index: which piece of the layout it holds
            (``ring_rank * U + ulysses_rank`` on a 2D mesh).
    """

    world: int
    index: int
    _refs: tuple = field(repr=False)

    def __init__(self, group: dist.ProcessGroup | None, ulysses: dist.ProcessGroup | None,
                 ring: dist.ProcessGroup | None, world: int, index: int):
        object.__setattr__(self, "world", world)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "_refs", (_weak(group), _weak(ulysses), _weak(ring)))

    @property
    def group(self) -> dist.ProcessGroup | None:
        return _strong(self._refs[0], "sequence-parallel")

    @property
    def ulysses(self) -> dist.ProcessGroup | None:
        return _strong(self._refs[1], "ulysses")

    @property
    def ring(self) -> dist.ProcessGroup | None:
        return _strong(self._refs[2], "ring")

    @property
    def ulysses_size(self) -> int:
        return 1 if self.ulysses is None else dist.get_world_size(self.ulysses)

    @property
    def ring_size(self) -> int:
        return self.world if self.ring is None else dist.get_world_size(self.ring)

    @staticmethod
    def resolve(mesh, dims: int = 1) -> SeqParallelGroups:
        """Groups from a DeviceMesh / ProcessGroup / None, checking the mesh has ``dims`` dimensions."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first "
                               "(or launch with torchrun / seqpar.testing.ProcessPool)")
        if DeviceMesh is not None and isinstance(mesh, DeviceMesh):
            return _from_mesh(mesh, dims)
        if dims != 1:
            raise ValueError(f"mesh must be a {dims}D DeviceMesh with dims named ({ULYSSES!r}, {RING!r}) for this "
                             f"method, got {type(mesh).__name__}{rank_suffix()}")
        group = mesh if mesh is not None else dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"mesh must be a DeviceMesh, a ProcessGroup or None, got {type(mesh).__name__}"
                            f"{rank_suffix()}")
        return SeqParallelGroups(group, None, None, dist.get_world_size(group), dist.get_rank(group))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape everywhere), ordered by sequence-parallel index."""
        if self.group is not None:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return parts
        u, r = self.ulysses_size, self.ring_size
        inner = [torch.empty_like(x) for _ in range(u)]
        dist.all_gather(inner, x.contiguous(), group=self.ulysses)
        stacked = torch.stack(inner)
        outer = [torch.empty_like(stacked) for _ in range(r)]
        dist.all_gather(outer, stacked, group=self.ring)
        return [outer[i // u][i % u] for i in range(self.world)]


def _from_mesh(mesh, dims: int) -> SeqParallelGroups:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != dims:
        want = "a 1D mesh (or a ProcessGroup)" if dims == 1 else \
            f"a 2D mesh with dims named ({ULYSSES!r}, {RING!r})"
        raise ValueError(f"mesh must be {want} for this method, got a {mesh.ndim}D mesh with dims {names}"
                         f"{rank_suffix()}")
    if dims == 1:
        g = mesh.get_group()
        return SeqParallelGroups(g, None, None, dist.get_world_size(g), dist.get_rank(g))
    if sorted(names) != sorted((ULYSSES, RING)):
        raise ValueError(f"a 2D mesh must name its dims ({ULYSSES!r}, {RING!r}), got {names}{rank_suffix()}")
    ug, rg = mesh.get_group(ULYSSES), mesh.get_group(RING)
    u, r = dist.get_world_size(ug), dist.get_world_size(rg)
    return SeqParallelGroups(None, ug, rg, u * r, dist.get_rank(rg) * u + dist.get_rank(ug))


def make_mesh(*, ulysses: int = 1, ring: int | None = None, placement: str = "contiguous",
              device_type: str | None = None):
    """A 2D DeviceMesh with dims ``("ulysses", "ring")`` over the default group (a collective call).

    Nothing is stored: pass the returned mesh to ``seqpar.attention`` / ``SequenceParallelAttention`` /
    ``seqpar.shard``. Either placement shards correctly (the SP index comes from mesh coordinates).

    Args:
        ulysses: the Ulysses degree U.
        ring: the ring degree R (default: world // U). U * R must equal the world size.
        placement: "contiguous" puts each Ulysses group on consecutive ranks (keep the all-to-all inside a
            node); "strided" puts the ring groups on consecutive ranks.
        device_type: "cuda" or "cpu" (default: cuda if available).
    """
    if placement not in ("contiguous", "strided"):
        raise ValueError(f"placement must be 'contiguous' or 'strided', got {placement!r}{rank_suffix()}")
    for name, degree in (("ulysses", ulysses), ("ring", ring)):
        if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int) or degree < 1):
            raise ValueError(f"{name} must be a positive int, got {degree!r}{rank_suffix()}")
    world = dist.get_world_size()
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    if ring is None and world % ulysses:
        raise ValueError(f"ulysses must divide the world size {world} (valid: {divisors}), got {ulysses}"
                         f"{rank_suffix()}")
    ring = world // ulysses if ring is None else ring
    if ulysses * ring != world:
        raise ValueError(f"ulysses * ring must equal the world size {world}, got {ulysses} * {ring}{rank_suffix()}")
    dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if placement == "contiguous":     # global rank = rho * U + u
        return init_device_mesh(dev, (ring, ulysses), mesh_dim_names=(RING, ULYSSES))
    return init_device_mesh(dev, (ulysses, ring), mesh_dim_names=(ULYSSES, RING))   # global rank = u * R + rho
