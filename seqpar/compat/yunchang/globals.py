"""yunchang's process-group state: ``set_seq_parallel_pg`` and ``PROCESS_GROUP`` (``...yunchang.globals``).

yunchang keeps its sequence-parallel groups in a global (``PROCESS_GROUP.ULYSSES_PG`` / ``.RING_PG``) that
``set_seq_parallel_pg`` fills and its layers read when they are built. This module is that global and nothing
more: it holds yunchang's two groups plus the 2D DeviceMesh (dims "ulysses", "ring") over them that
``seqpar.attention(method="usp")`` takes. The rest of seqpar keeps no groups of its own.

Placements (as yunchang builds them; ``offset`` = the first rank of this rank's data-parallel replica):

    use_ulysses_low=True   global rank = offset + rho * U + u   (Ulysses groups on consecutive ranks)
    use_ulysses_low=False  global rank = offset + u * R + rho   (ring groups on consecutive ranks)

for ring rank rho and Ulysses rank u. seqpar's sequence-parallel index is ``rho * U + u`` in both (it comes
from mesh coordinates), and the ``extract_local`` helpers shard by that index, so both placements are correct
(yunchang's basic and stripe extraction mismatch its groups with ``use_ulysses_low=False``, PEERS.md §2).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...errors import rank_suffix

__all__ = ["PROCESS_GROUP", "ProcessGroups", "set_seq_parallel_pg"]


class ProcessGroups:
    """yunchang's ``PROCESS_GROUP``: the groups of the last ``set_seq_parallel_pg`` call (None before it).

    Attributes:
        ULYSSES_PG, RING_PG: this rank's Ulysses and ring groups (yunchang's names).
        mesh: the 2D DeviceMesh over them, dims ("ulysses", "ring").
        ulysses_degree, ring_degree, use_ulysses_low: the arguments of that call.
    """

    def __init__(self) -> None:
        self.ULYSSES_PG: Any = None
        self.RING_PG: Any = None
        self.mesh: Any = None
        self.ulysses_degree = 0
        self.ring_degree = 0
        self.use_ulysses_low = True

    @property
    def is_set(self) -> bool:
        return self.mesh is not None

    def sp_index(self, rank: int) -> int:
        """The sequence-parallel index (which piece of the layout it holds) of global rank ``rank``."""
        U, R = self.ulysses_degree, self.ring_degree
        local = rank % (U * R)
        if self.use_ulysses_low:
            return local
        u, rho = divmod(local, R)
        return rho * U + u


PROCESS_GROUP = ProcessGroups()


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}{rank_suffix()}")
    return value


def set_seq_parallel_pg(sp_ulysses_degree: int, sp_ring_degree: int, rank: int, world_size: int,
                        use_ulysses_low: bool = True) -> None:
    """Create yunchang's Ulysses and ring groups (a collective: every rank calls it, in the same order).

    Args:
        sp_ulysses_degree, sp_ring_degree: U and R; U * R ranks form one sequence-parallel group and
            ``world_size // (U * R)`` data-parallel replicas of it sit on consecutive blocks of ranks.
        rank, world_size: this process's global rank and the world size (checked against torch.distributed).
        use_ulysses_low: Ulysses groups on consecutive ranks (True, yunchang's default) or ring groups.
    """
    U, R = _positive("sp_ulysses_degree", sp_ulysses_degree), _positive("sp_ring_degree", sp_ring_degree)
    if not isinstance(use_ulysses_low, bool):
        raise TypeError(f"use_ulysses_low must be a bool, got {use_ulysses_low!r}{rank_suffix()}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group before "
                           "set_seq_parallel_pg")
    if (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
        raise ValueError(f"rank and world_size must be this process's global rank and the world size "
                         f"({dist.get_rank()}, {dist.get_world_size()}), got ({rank!r}, {world_size!r})"
                         f"{rank_suffix()}")
    sp = U * R
    if world_size % sp:
        raise ValueError(f"world_size must be a multiple of sp_ulysses_degree * sp_ring_degree = {U} * {R} = {sp}, "
                         f"got {world_size}{rank_suffix()}")
    mine: dict[str, Any] = {}
    for offset in range(0, world_size, sp):        # yunchang's group order: every rank creates every group
        for kind, ranks in _groups(U, R, offset, use_ulysses_low):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    ulysses_pg, ring_pg = mine["ulysses"], mine["ring"]
    offset = rank - rank % sp
    grid = torch.arange(offset, offset + sp)
    if use_ulysses_low:                            # rank = offset + rho * U + u
        mesh_ranks, dims, groups = grid.reshape(R, U), ("ring", "ulysses"), [ring_pg, ulysses_pg]
    else:                                          # rank = offset + u * R + rho
        mesh_ranks, dims, groups = grid.reshape(U, R), ("ulysses", "ring"), [ulysses_pg, ring_pg]
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    PROCESS_GROUP.mesh = DeviceMesh.from_group(groups, device, mesh=mesh_ranks, mesh_dim_names=dims)
    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = ulysses_pg, ring_pg
    PROCESS_GROUP.ulysses_degree, PROCESS_GROUP.ring_degree = U, R
    PROCESS_GROUP.use_ulysses_low = use_ulysses_low


def _groups(U: int, R: int, offset: int, low: bool) -> list[tuple[str, list[int]]]:
    """(kind, ranks) of one replica's groups, in yunchang's creation order."""
    sp = U * R
    if low:      # Ulysses groups are blocks of U consecutive ranks, ring groups stride U
        return ([("ulysses", list(range(offset + i * U, offset + (i + 1) * U))) for i in range(R)]
                + [("ring", list(range(offset + i, offset + sp, U))) for i in range(U)])
    return ([("ring", list(range(offset + i * R, offset + (i + 1) * R))) for i in range(U)]
            + [("ulysses", list(range(offset + i, offset + sp, R))) for i in range(R)])
