"""Named masks: the masks of current models, with their block structure declared analytically.

Pass one as ``seqpar.attention(..., mask_mod=...)``; each is also a flex ``mask_mod`` (call it on int tensors
``(b, h, q_idx, kv_idx)``), which is how the oracle checks it::

    chunked(8192)                         Llama 4 chunked attention (with causal=True)
    spans([(10, 266), ...])               Gemma 3 image tokens: bidirectional spans in a causal sequence
    prefix_lm(512)                        a bidirectional prefix, causal after it
    block_causal(1560)                    video DiT: a frame sees its own frame and every earlier one
    shared_prefix(16384, [2048] * 8)      RL: one prompt, many responses; a response sees the prompt and itself
    tree(cuts, parents)                   a prefix tree of pieces (multi-turn, packed prompts)
    sink_window(4095, sinks=4)            sliding window plus the first ``sinks`` tokens (StreamingLLM)

Positions are global token positions, as in flex. A mask composes with ``causal``, ``window_size``,
``cu_seqlens`` and padding: a key is visible when all of them allow it. ``spans``, ``prefix_lm``,
``block_causal``, ``tree`` and ``sink_window`` carry their own causality, so they are used with
``causal=False`` (causal=True would cut their bidirectional parts); ``chunked`` is used with ``causal=True``.

Note [Masks as pieces]
    A named mask cuts the positions into pieces (consecutive intervals: chunks, frames, spans and the gaps
    between them, the prompt and each response) and declares, for a query piece a and a key piece b, which
    keys are visible as a band of ``key_pos - query_pos`` (``relation(a, b)``: ``(lo, hi)`` with None for
    unbounded, or None for nothing). Everything the block planner does for documents then carries over
    (Note [Block planning] in ``seqpar.layouts.blocks``): runs are cut at piece boundaries as they are at
    document boundaries, each (query run, key run) pair gets the intersection of the relation's band with
    the rule's (causal, window), and pairs with no band are never computed. Every block therefore lands on a
    dense kernel (a band or varlen call) and the mask is never evaluated on any grid: planning costs
    O(pairs of runs), with no S^2 or W^2 mask evaluation, and blocks a mask leaves fully visible (a response
    against the prompt) run at the dense kernel's speed, where flex would pay its masked path.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = ["Chunked", "PieceMask", "SinkWindow", "Spans", "Tree", "block_causal", "chunked", "from_spec",
           "prefix_lm", "shared_prefix", "sink_window", "spans", "tree"]

Bounds = tuple[int | None, int | None] | None
FULL: Bounds = (None, None)
CAUSAL: Bounds = (None, 0)
_END = 1 << 62


class PieceMask(ABC):
    """A mask declared by pieces and their pairwise bands (Note [Masks as pieces]); hashable, frozen."""

    #: only pairs within one piece can be visible (the planner then buckets key runs by piece)
    same_piece_only: ClassVar[bool] = False
    name: ClassVar[str]

    @abstractmethod
    def piece(self, pos: int) -> int:
        """The piece holding global position ``pos``."""

    @abstractmethod
    def piece_end(self, pos: int) -> int:
        """The first position after ``pos``'s piece."""

    @abstractmethod
    def relation(self, a: int, b: int) -> Bounds:
        """Bounds on ``key_pos - query_pos`` for queries of piece a and keys of piece b, or None."""

    def pieces_within(self, length: int, most: int) -> int:
        """Pieces over positions ``[0, length)``, counted up to ``most + 1`` (O(most))."""
        n, pos = 0, 0
        while pos < length and n <= most:
            pos, n = self.piece_end(pos), n + 1
        return n

    def __call__(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The mask on broadcasting int tensors -> bool (eager: the oracle, a generic ``mask_mod``)."""
        return self.mod(q_idx.device)(b, h, q_idx, kv_idx)

    @abstractmethod
    def mod(self, device: torch.device | str, length: int | None = None) -> Callable[..., torch.Tensor]:
        """The mask as a flex ``mask_mod`` closed over its lookup tensors on ``device``. With the sequence
        ``length``, positions index a per-position table of pieces (what a compiled ``flex_attention`` lowers);
        without it, pieces come from ``torch.bucketize`` (eager, ``create_block_mask``)."""

    def spec(self) -> tuple:
        """``(name, *args)`` as literals: ``from_spec(m.spec()) == m`` (compiled-call keys, the agreement round)."""
        return (self.name, *(getattr(self, f.name) for f in dataclasses.fields(self)))  # type: ignore[arg-type]


def _pos_int(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class _Periodic(PieceMask):
    size: int

    def __post_init__(self) -> None:
        _pos_int("size", self.size)

    def piece(self, pos: int) -> int:
        return pos // self.size

    def piece_end(self, pos: int) -> int:
        return (pos // self.size + 1) * self.size


@dataclass(frozen=True)
class Chunked(_Periodic):
    """Llama 4 chunked attention: a query sees keys of its own ``size``-token chunk (use with causal=True)."""

    name: ClassVar[str] = "chunked"
    same_piece_only: ClassVar[bool] = True

    def relation(self, a: int, b: int) -> Bounds:
        return FULL if a == b else None

    def mod(self, device, length=None):
        size = self.size

        def chunked_mod(b, h, q_idx, kv_idx):
            return (q_idx // size) == (kv_idx // size)
        return chunked_mod


@dataclass(frozen=True)
class BlockCausal(_Periodic):
    """Video frames of ``size`` tokens: a query sees its own frame and every earlier one (causal=False)."""

    name: ClassVar[str] = "block_causal"

    def relation(self, a: int, b: int) -> Bounds:
        return FULL if b <= a else None

    def mod(self, device, length=None):
        size = self.size

        def block_causal_mod(b, h, q_idx, kv_idx):
            return (kv_idx // size) <= (q_idx // size)
        return block_causal_mod


@dataclass(frozen=True)
class Spans(PieceMask):
    """Causal attention (optionally a left ``window``) plus bidirectional attention inside each ``[start, end)``
    span: Gemma 3's image tokens, a prefix LM's prefix (causal=False)."""

    spans: tuple[tuple[int, int], ...]
    window: int = -1
    name: ClassVar[str] = "spans"

    def __post_init__(self) -> None:
        at = 0
        for s in self.spans:
            if not (isinstance(s, tuple) and len(s) == 2 and all(isinstance(x, int) for x in s) and at <= s[0] < s[1]):
                raise ValueError(f"spans must be sorted, disjoint, non-empty (start, end) int pairs, got {s!r} in "
                                 f"{list(self.spans)[:8]}")
            at = s[1]
        _pos_int("window", self.window, -1)

    @property
    def cuts(self) -> tuple[int, ...]:
        return tuple(x for s in self.spans for x in s)

    def piece(self, pos: int) -> int:          # even: a gap (before span 0, between, after), odd: a span
        return bisect.bisect_right(self.cuts, pos)

    def piece_end(self, pos: int) -> int:
        i = bisect.bisect_right(self.cuts, pos)
        return self.cuts[i] if i < len(self.cuts) else _END

    def relation(self, a: int, b: int) -> Bounds:
        if a == b and a % 2:
            return FULL
        return (None if self.window < 0 else -self.window, 0)

    def mod(self, device, length=None):
        piece, window = _pieces(torch.tensor(self.cuts or (_END,)), device, length), self.window

        def spans_mod(b, h, q_idx, kv_idx):
            pq, pk = piece(q_idx), piece(kv_idx)
            causal = kv_idx <= q_idx
            if window >= 0:
                causal = causal & (q_idx - kv_idx <= window)
            return causal | ((pq == pk) & (pq % 2 == 1))
        return spans_mod


@dataclass(frozen=True)
class Tree(PieceMask):
    """A prefix tree of pieces ``[cuts[i], cuts[i+1])``: a query sees its own piece causally and every ancestor
    piece whole (``parents[i]`` < i, -1 for a root). Positions past ``cuts[-1]`` see nothing (causal=False)."""

    cuts: tuple[int, ...]
    parents: tuple[int, ...]
    name: ClassVar[str] = "tree"

    def __post_init__(self) -> None:
        c, p = self.cuts, self.parents
        if len(c) < 2 or c[0] != 0 or any(not isinstance(x, int) or y <= x for x, y in itertools.pairwise(c)):
            raise ValueError(f"cuts must be increasing ints from 0, got {list(c)[:12]}")
        if len(p) != len(c) - 1 or any(not isinstance(x, int) or not -1 <= x < i for i, x in enumerate(p)):
            raise ValueError(f"parents must give each of the {len(c) - 1} pieces an earlier piece or -1, got "
                             f"{list(p)[:12]}")
        anc = []
        for i, x in enumerate(p):
            anc.append(frozenset({i}) | (anc[x] if x >= 0 else frozenset()))
        object.__setattr__(self, "_anc", tuple(anc))

    def piece(self, pos: int) -> int:
        return bisect.bisect_right(self.cuts, pos) - 1

    def piece_end(self, pos: int) -> int:
        i = bisect.bisect_right(self.cuts, pos)
        return self.cuts[i] if i < len(self.cuts) else _END

    def relation(self, a: int, b: int) -> Bounds:
        if a >= len(self.parents) or b >= len(self.parents):
            return None
        if a == b:
            return CAUSAL
        return FULL if b in self._anc[a] else None     # type: ignore[attr-defined]

    def mod(self, device, length=None):
        n = len(self.parents)
        table = torch.zeros(n + 1, n + 1, dtype=torch.bool)     # row n: positions past the tree see nothing
        for i, a in enumerate(self._anc):              # type: ignore[attr-defined]
            table[i, list(a)] = True
        table, piece = table.to(device), _pieces(torch.tensor(self.cuts[1:]), device, length)

        def tree_mod(b, h, q_idx, kv_idx):
            pq, pk = piece(q_idx), piece(kv_idx)
            return table[pq, pk] & ((pq != pk) | (kv_idx <= q_idx))
        return tree_mod


@dataclass(frozen=True)
class SinkWindow(PieceMask):
    """Causal sliding window ``q - k <= window`` plus the first ``sinks`` tokens, always visible (causal=False)."""

    window: int
    sinks: int
    name: ClassVar[str] = "sink_window"

    def __post_init__(self) -> None:
        _pos_int("window", self.window, 0)
        _pos_int("sinks", self.sinks, 1)

    def piece(self, pos: int) -> int:
        return 0 if pos < self.sinks else 1

    def piece_end(self, pos: int) -> int:
        return self.sinks if pos < self.sinks else _END

    def relation(self, a: int, b: int) -> Bounds:
        return CAUSAL if b == 0 else (-self.window, 0)

    def mod(self, device, length=None):
        window, sinks = self.window, self.sinks

        def sink_window_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & ((q_idx - kv_idx <= window) | (kv_idx < sinks))
        return sink_window_mod


def _pieces(cuts: torch.Tensor, device, length: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Position -> index of the cut interval it falls in (``bucketize(pos, cuts, right=True)``): a lookup table
    of ``length`` entries when the length is known, else ``torch.bucketize`` itself."""
    if length is None:
        cuts = cuts.to(device)
        return lambda pos: torch.bucketize(pos, cuts, right=True)
    table = torch.bucketize(torch.arange(length), cuts, right=True).to(device)
    return lambda pos: table[pos]


def chunked(size: int) -> Chunked:
    """Llama 4 chunked attention over chunks of ``size`` tokens (use with ``causal=True``)."""
    return Chunked(size)


def block_causal(size: int) -> BlockCausal:
    """Frames of ``size`` tokens, each seeing itself and every earlier frame (use with ``causal=False``)."""
    return BlockCausal(size)


def spans(spans: Sequence[tuple[int, int]], window: int = -1) -> Spans:
    """Causal (left ``window`` if >= 0) plus bidirectional ``[start, end)`` spans (use with ``causal=False``)."""
    return Spans(tuple((int(a), int(b)) for a, b in spans), window)


def prefix_lm(prefix: int) -> Spans:
    """A bidirectional prefix of ``prefix`` tokens, causal after it (use with ``causal=False``)."""
    return Spans(((0, _pos_int("prefix", prefix)),))


def tree(cuts: Sequence[int], parents: Sequence[int]) -> Tree:
    """A prefix tree of pieces (``Tree``; use with ``causal=False``)."""
    return Tree(tuple(int(c) for c in cuts), tuple(int(p) for p in parents))


def shared_prefix(prompt: int, responses: Sequence[int]) -> Tree:
    """One ``prompt`` followed by ``responses``: each response sees the prompt and itself (causal=False)."""
    cuts = [0, _pos_int("prompt", prompt)]
    for r in responses:
        cuts.append(cuts[-1] + _pos_int("response length", r))
    return Tree(tuple(cuts), (-1,) + (0,) * len(responses))


def sink_window(window: int, sinks: int) -> SinkWindow:
    """Sliding window ``q - k <= window`` (flash-attn's left window) plus ``sinks`` leading tokens (causal=False)."""
    return SinkWindow(window, sinks)


_NAMED = {cls.name: cls for cls in (Chunked, BlockCausal, Spans, Tree, SinkWindow)}


def from_spec(spec: tuple) -> PieceMask:
    """The named mask ``spec`` describes (``PieceMask.spec``)."""
    name, *args = spec
    if name not in _NAMED:
        raise ValueError(f"mask spec must name one of {sorted(_NAMED)}, got {name!r}")
    return _NAMED[name](*args)
