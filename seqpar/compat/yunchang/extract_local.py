"""yunchang's sharding helpers (``EXTRACT_FUNC_DICT``): the global tensor -> one rank's tokens.

Each helper returns the tokens that ``LongContextAttention`` with the matching ``ring_impl_type`` expects on
global rank ``rank``: seqpar's USP placement (``seqpar.layouts.Nested``: the ring layout over R ranks, each ring
rank's tokens cut into U consecutive pieces), at the sequence-parallel index of ``rank`` under the groups of
``set_seq_parallel_pg`` (Note in ``globals``: correct for both ``use_ulysses_low`` values). Before
``set_seq_parallel_pg`` (a plain ring), rank r holds index r.

    basic  ("basic", "basic_pytorch", "basic_flashinfer", "basic_npu"): contiguous, chunk r of W
    zigzag: ring rank rho holds chunks rho and 2R-1-rho of 2R, then its Ulysses piece u
    strip:  ring rank rho holds every R-th token from rho, then its Ulysses piece u
"""

from __future__ import annotations

import torch

from ...errors import rank_suffix
from ...layouts import Nested, make_layout
from .globals import PROCESS_GROUP

__all__ = ["EXTRACT_FUNC_DICT", "basic_extract_local", "stripe_extract_local", "zigzag_extract_local"]


def _index(rank: int, world_size: int, rd: int | None, ud: int | None) -> tuple[int, int, int]:
    """(sequence-parallel index, R, U) of ``rank``, checked against the groups of ``set_seq_parallel_pg``."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "world_size" else 0):
            raise ValueError(f"{name} must be a {'positive' if name == 'world_size' else 'non-negative'} int, got "
                             f"{value!r}{rank_suffix()}")
    pg = PROCESS_GROUP
    R = rd if rd is not None else (pg.ring_degree if pg.is_set else world_size)
    U = ud if ud is not None else (pg.ulysses_degree if pg.is_set else 1)
    if pg.is_set and (R, U) != (pg.ring_degree, pg.ulysses_degree):
        raise ValueError(f"rd and ud must be the degrees given to set_seq_parallel_pg (ring {pg.ring_degree}, "
                         f"ulysses {pg.ulysses_degree}), got rd={rd}, ud={ud}{rank_suffix()}")
    if R * U != world_size:
        raise ValueError(f"world_size must be the sequence-parallel degree rd * ud = {R} * {U}, got {world_size}"
                         f"{rank_suffix()}")
    index = pg.sp_index(rank) if pg.is_set else rank
    if index >= world_size:
        raise ValueError(f"rank must be below world_size={world_size}, got {rank}{rank_suffix()}")
    return index, R, U


def _extract(layout: str, value: torch.Tensor, rank: int, world_size: int, rd: int | None, ud: int | None,
             dim: int) -> torch.Tensor:
    index, R, U = _index(rank, world_size, rd, ud)
    lay = Nested(world_size, outer=make_layout(layout, R), inner=U)
    try:
        lay.check_len(value.shape[dim])
    except ValueError as e:
        raise ValueError(f"{e}{rank_suffix()}") from None
    return lay.shard(value, index, dim)


def basic_extract_local(value: torch.Tensor, rank: int, world_size: int, rd: int | None = None,
                        ud: int | None = None, *args, **kwargs) -> torch.Tensor:
    """Rank ``rank``'s contiguous piece of ``value (b, s, ...)`` along dim 1, detached (yunchang's "basic");
    ``rd``, ``ud`` are checked against the groups when given."""
    _no_more(args, kwargs)
    return _extract("contiguous", value, rank, world_size, rd, ud, 1).detach().clone()


def zigzag_extract_local(value: torch.Tensor, rank: int, world_size: int, rd: int, ud: int, dim: int = 1,
                         *args, **kwargs) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``value`` along ``dim`` for ``ring_impl_type="zigzag"`` (a copy)."""
    _no_more(args, kwargs)
    return _extract("zigzag", value, rank, world_size, rd, ud, dim)


def stripe_extract_local(value: torch.Tensor, rank: int, world_size: int, rd: int, ud: int, *args,
                         **kwargs) -> torch.Tensor:
    """Rank ``rank``'s tokens of ``value (b, s, ...)`` along dim 1 for ``ring_impl_type="strip"`` (a copy)."""
    _no_more(args, kwargs)
    return _extract("stripe", value, rank, world_size, rd, ud, 1)


def _no_more(args: tuple, kwargs: dict) -> None:
    if args or kwargs:
        raise TypeError(f"unexpected arguments {list(args) + sorted(kwargs)} (yunchang's helpers ignore them; seqpar "
                        f"does not accept arguments it would ignore){rank_suffix()}")


EXTRACT_FUNC_DICT = {
    "basic": basic_extract_local,
    "strip": stripe_extract_local,
    "zigzag": zigzag_extract_local,
    "basic_pytorch": basic_extract_local,
    "basic_flashinfer": basic_extract_local,
    "basic_npu": basic_extract_local,
}
