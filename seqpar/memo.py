"""Caches of host-side plans keyed by a call's facts, bounded so that packed batches do not pile up.

Note [Per-batch memos]
    A schedule, a gather plan or a local task list depends on the shapes and, for a packed or padded batch, on
    its document boundaries or valid length. Plans of fixed shapes are few and asked for on every call; a
    packed batch's are asked for while its step runs (every layer, forward and backward) and then never again.
    ``batch_memo`` keeps the two apart: a call whose per-batch arguments (``doc_bounds``, ``valid_len``) are set
    goes to a small least-recently-used cache (``BATCH_ENTRIES``), the others to a large one, so a stream of new
    batches never evicts the fixed plans and never holds more than a few batches' plans.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["BATCH_ENTRIES", "Same", "batch_memo"]

BATCH_ENTRIES = 8
"""Per-batch entries a memo keeps (a step's calls share one batch; a few batches of slack)."""


def batch_memo(plain: int = 256, batch_args: tuple[str, ...] = ("doc_bounds", "valid_len")
               ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``functools.lru_cache`` in two tiers (Note [Per-batch memos]): ``plain`` entries for calls without
    per-batch facts, ``BATCH_ENTRIES`` for calls with any of ``batch_args`` not None."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn).parameters)
        where = [(params.index(n), n) for n in batch_args if n in params]
        fixed = functools.lru_cache(maxsize=plain)(fn)
        per_batch = functools.lru_cache(maxsize=BATCH_ENTRIES)(fn)

        @functools.wraps(fn)
        def memo(*args: Any, **kwargs: Any) -> Any:
            batch = any((args[i] if i < len(args) else kwargs.get(n)) is not None for i, n in where)
            return (per_batch if batch else fixed)(*args, **kwargs)

        def cache_clear() -> None:
            fixed.cache_clear()
            per_batch.cache_clear()

        memo.cache_clear = cache_clear                      # type: ignore[attr-defined]
        memo.tiers = (fixed, per_batch)                     # type: ignore[attr-defined]
        return memo
    return wrap


class Same:
    """A cache-key element equal by identity, holding its object by weak reference where the object takes one: a
    cache must never keep a process group alive (gloo closes a group's connections only when the group object goes
    away, which the fail-fast recipe of docs/RELIABILITY.md relies on), nor a batch's tensor. Two DeviceMeshes over
    the same ranks are equal as values but carry different process groups, hence identity. An entry of a dead object
    never equals a live one (its reference is dead), so an ``id`` reused by a new object never finds the old entry;
    an object that takes no weak reference (a list, a dict) is held strongly."""

    __slots__ = ("id", "ref")

    def __init__(self, obj: Any):
        self.id = None if obj is None else id(obj)
        if obj is None:
            self.ref = None
        else:
            try:
                self.ref = weakref.ref(obj)
            except TypeError:
                self.ref = functools.partial(lambda o: o, obj)

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.id == self.id and (
            self.ref is None or (other.ref is not None and other.ref() is self.ref()))

    def dead(self) -> bool:
        return self.ref is not None and self.ref() is None
