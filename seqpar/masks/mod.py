"""A user's ``mask_mod``: validated, fingerprinted for the agreement round, and classified per planned block.

Note [Generic mask_mod]
    A function ``fn(b, h, q_idx, kv_idx) -> bool`` on global positions (flex's convention) declares no structure,
    so the planner finds it: it plans the blocks of causal/window/documents as usual, then evaluates ``fn`` on
    each block's global positions, once per planned call (the plan is cached per signature), on the call's
    device, in row slabs of at most ``EVAL_CELLS`` cells. A block where ``fn`` hides every visible cell is
    dropped; one where it hides none keeps its dense kernel; the rest become ``Modded`` blocks, which flex
    (GPU, its own block mask skipping empty and unmasking full tiles) or the reference kernel (CPU) run.
    ``fn`` must not depend on ``b`` or ``h`` (checked by tracing it; such masks are refused by name): one
    plan serves every batch row and head. A plan is cached per function object AND the version and storage of
    every tensor it captured (``stamp``: closure, defaults, a callable object's attributes), so refilling a
    captured tensor in place (a per-batch document table) plans again instead of reusing the old blocks; a
    tensor it reads otherwise (a global) is not seen: pass it through a closure.

    Before any collective, ``check`` calls ``fn`` on a probe grid of the sequence (its first and last positions
    and a seeded sample between), the same on every rank: a function that raises, returns a wrong shape or
    dtype raises there, and the grid's bits become the call's fingerprint in the agreement round, so ranks
    passing different masks fail together instead of hanging. A difference outside the probe grid is not
    seen; pass the same function on every rank.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import rank_suffix

__all__ = ["EVAL_CELLS", "ModMask", "cache_key", "check", "checked", "classify", "evaluate", "stamp", "wrap"]

EVAL_CELLS = 1 << 26
"""Cells (query x key) a planning evaluation of a ``mask_mod`` holds at once."""
PROBE = 48
"""Query and key positions of the probe grid (``check``)."""


@dataclass(frozen=True)
class ModMask:
    """A user's ``mask_mod``: equal by the function object and the ``stamp`` of the tensors it reads (a plan is
    cached on both), with the probe grid's fingerprint once ``checked``."""

    fn: Callable[..., Any]
    stamp: tuple = ()
    """``stamp(fn)``: the tensors the function captured, by version and storage (Note [Generic mask_mod])."""
    fingerprint: str = field(default="", compare=False)
    device: str = field(default="cpu", compare=False)
    """Where the planner evaluates ``fn`` (the call's device: the function may close over its tensors)."""

    def spec(self) -> tuple:
        return ("mask_mod", self.fingerprint)


def wrap(mask: Any) -> Any:
    """``mask_mod=`` as the config holds it: a named mask as is, a callable as a ``ModMask``."""
    from .named import PieceMask

    if isinstance(mask, (PieceMask, ModMask)):
        return mask
    if not callable(mask):
        raise TypeError(f"mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool tensor or a seqpar.masks named "
                        f"mask, got {mask!r}{rank_suffix()}")
    return ModMask(mask, stamp(mask))


def stamp(fn: Callable[..., Any]) -> tuple:
    """What a refill of ``fn``'s captured tensors changes: the version counter and storage of every tensor in its
    closure, its defaults and (a callable object) its attributes. An inference tensor keeps no version counter,
    so a function capturing one gets a new stamp on every call (planned every call)."""
    held = [_contents(c) for c in getattr(fn, "__closure__", None) or ()]
    held += list(getattr(fn, "__defaults__", None) or ())
    if not isinstance(fn, types.FunctionType):
        held += list(getattr(fn, "__dict__", {}).values())
    out: list[Any] = []
    for t in held:
        if isinstance(t, torch.Tensor):
            out.append(object() if t.is_inference() else (t._version, t.untyped_storage().data_ptr()))
    return tuple(out)


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:                  # a cell not yet bound
        return None


def cache_key(mask: Any) -> Any:
    """``mask_mod=`` as a plan-cache key: a named mask itself, a function with its ``stamp``."""
    from .named import PieceMask

    return mask if mask is None or isinstance(mask, PieceMask) or not callable(mask) else (mask, stamp(mask))


def checked(mask: Any, total: int, device: torch.device | str = "cpu") -> Any:
    """The config's mask after ``check`` on a sequence of ``total`` positions (a ``ModMask`` gets its fingerprint)."""
    if isinstance(mask, ModMask):
        return ModMask(mask.fn, mask.stamp, check(mask.fn, total, device)[1], str(device))
    check(mask, total, device)
    return mask


def evaluate(fn: Callable[..., Any], q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``fn`` on the grid ``q_pos x k_pos`` (b = h = 0), as a bool ``(len(q_pos), len(k_pos))`` tensor."""
    zero = torch.zeros((), dtype=torch.long, device=q_pos.device)
    out = fn(zero, zero, q_pos[:, None], k_pos[None, :])
    shape = (len(q_pos), len(k_pos))
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a bool tensor, got {type(out).__name__}"
                        f"{'' if not isinstance(out, torch.Tensor) else ' of dtype ' + str(out.dtype)}{rank_suffix()}")
    try:
        fits = tuple(torch.broadcast_shapes(out.shape, shape)) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"mask_mod must return the broadcast shape of its index tensors {shape}, got "
                         f"{tuple(out.shape)}{rank_suffix()}")
    return out.expand(shape)


def _uses_batch_or_head(fn: Callable[..., Any], device: torch.device) -> list[str]:
    """Which of ``b``, ``h`` the traced ``fn`` reads (tracing with make_fx: exact for traceable functions)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    args = (torch.zeros((), dtype=torch.long, device=device), torch.zeros((), dtype=torch.long, device=device),
            torch.arange(4, device=device)[:, None], torch.arange(4, device=device)[None, :])
    try:
        graph = make_fx(fn)(*args).graph
    except Exception:           # not traceable: compare values at several (b, h) instead
        base = fn(*args)
        used = []
        for i, name in ((0, "b"), (1, "h")):
            for x in (1, 3, 7):
                alt = list(args)
                alt[i] = torch.tensor(x, device=device)
                if not torch.equal(fn(*alt), base):
                    used.append(name)
                    break
        return used
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    return [name for name, n in zip("bh", holders) if n.users]


def check(mask: Any, total: int, device: torch.device | str = "cpu") -> tuple:
    """Validate ``mask`` (a ``mask_mod`` or a named mask) for a sequence of ``total`` global positions, calling it
    with index tensors on ``device`` (the call's: a function may close over device tensors); returns the literal
    the agreement round compares (Note [Generic mask_mod])."""
    from .named import PieceMask

    if isinstance(mask, PieceMask):
        return mask.spec()
    if not callable(mask):
        raise TypeError(f"mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool tensor or a seqpar.masks named "
                        f"mask, got {mask!r}{rank_suffix()}")
    g = torch.Generator().manual_seed(total)
    inner = torch.randint(0, max(total, 1), (PROBE - 2,), generator=g)
    pos = torch.cat([torch.tensor([0, total - 1]), inner]).sort().values.to(device)
    try:
        bits = evaluate(mask, pos, pos)
        used = _uses_batch_or_head(mask, torch.device(device))
    except (TypeError, ValueError) as err:
        if "mask_mod must" in str(err):
            raise
        raise ValueError(f"mask_mod raised {type(err).__name__}: {err} when called on global positions in "
                         f"[0, {total}){rank_suffix()}") from err
    except Exception as err:
        raise ValueError(f"mask_mod raised {type(err).__name__}: {err} when called on global positions in "
                         f"[0, {total}){rank_suffix()}") from err
    if used:
        raise NotImplementedError(f"mask_mod must not depend on the batch or head index (one plan serves every "
                                  f"row and head), got a function reading {' and '.join(used)}{rank_suffix()}")
    digest = hashlib.sha1(bits.cpu().numpy().tobytes()).hexdigest()[:16]
    return ("mask_mod", digest)


def _band_rows(lo: int | None, hi: int | None, a: int, b: int, n: int, device: torch.device) -> torch.Tensor:
    d = torch.arange(n, device=device)[None, :] - torch.arange(a, b, device=device)[:, None]
    vis = torch.ones(b - a, n, dtype=torch.bool, device=device)
    if lo is not None:
        vis &= d >= lo
    if hi is not None:
        vis &= d <= hi
    return vis


def classify(fn: Callable[..., Any], lo: int | None, hi: int | None, q_pos: torch.Tensor, k_pos: torch.Tensor,
             device: torch.device | str = "cpu") -> str:
    """How much of a band block's visible cells ``fn`` keeps: "none", "all" or "some" (row slabs of at most
    ``EVAL_CELLS`` cells, on the call's ``device``; Note [Generic mask_mod])."""
    dev = torch.device(device)
    q_pos, k_pos = q_pos.to(dev), k_pos.to(dev)
    m, n = len(q_pos), len(k_pos)
    rows = max(1, EVAL_CELLS // max(n, 1))
    kept = hidden = False
    for a in range(0, m, rows):
        b = min(m, a + rows)
        vis = _band_rows(lo, hi, a, b, n, dev)
        f = evaluate(fn, q_pos[a:b], k_pos)
        kept = kept or bool((vis & f).any())
        hidden = hidden or bool((vis & ~f).any())
        if kept and hidden:
            return "some"
    return "all" if kept else "none"
