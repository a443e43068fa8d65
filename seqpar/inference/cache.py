"""``ShardedKVCache``: every layer's keys and values split over the ranks of a sequence-parallel group.

    cache = ShardedKVCache(layers=32, batch=1, mesh=mesh)              # dynamic; max_len=... preallocates
    chunk = cache.begin_prefill(131072, method="ring", layout="zigzag")  # this rank's rows of a sharded prompt
    ... per layer: out = seqpar.inference.attend(q, k, v, cache, layer)   # stores k, v; attends q to the cache
    chunk = cache.begin_decode()                                       # one new token, the same on every rank
    ... per layer: out = seqpar.inference.attend(q, k, v, cache, layer)

Note [Cache layout]
    Rank j holds rows of every layer in position order. A prompt chunk's rows are the ones the chunk's layout
    gave rank j (prefill fills the cache in place from the local K/V, no gather); a decode token at cache
    position p goes to rank ``p mod W`` (round-robin: ranks stay within one token of each other). Every rank
    records every rank's positions (``rows.RankRows``, host integers), so any rank can plan its queries
    against any rank's slice without asking. Buffers are sequence-major, ``(rows, B, Hkv, D)``: any row range
    is one contiguous message for any batch size, and kernels read ``(B, rows, Hkv, D)`` views of it.

Note [Chunks]
    A forward pass over new tokens is a chunk: ``begin_prefill`` (sharded tokens in a layout, extending the
    cache or filling it) or ``begin_decode`` (replicated tokens: every rank computes the same q/k/v). Each
    layer then stores its K/V and attends (``seqpar.inference.attend``); when every layer has, the chunk is
    committed: ``length`` grows and layers with a sliding window evict what no later query can see.

Note [Sliding windows and eviction]
    A causal layer with left window w is only ever asked about keys at positions ``>= q - w``; after a chunk
    ends at position N, every later query is at ``>= N``, so rows below ``N - w`` are dead. Each layer keeps
    the first live row per rank; a rank's dead rows are dropped from its buffer when the space is needed
    (live rows move to the front), so a Mistral-style layer holds O(w / W + chunk) rows per rank, however
    long the sequence. A static cache drops them the same way in eager use; its graph-capturable decode step
    (``decode.StaticDecode``) never moves rows and masks them instead.

Batches: every row shares the cache positions; a row whose prompt starts later (left padding, ``starts``)
sees nothing before its start. GQA/MQA: K and V keep their Hkv heads; V may have its own head dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..api import attention_config, placement
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..layouts.blocks import Rule, Run, Segments
from ..masks import PieceMask
from .choice import PassDecision
from .plans import Pairs, RowGroup, pair_tasks, plan_pairs
from .rows import RankRows

__all__ = ["CacheSpec", "Chunk", "ShardedKVCache"]


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """What a ``ShardedKVCache`` holds (validated once)."""

    layers: int
    """Layers with a KV cache (``layer`` indices 0..layers-1)."""
    batch: int
    """Sequences per batch (B)."""
    max_len: int | None = None
    """Static cache: the most tokens (global, all ranks) it will hold; buffers are preallocated and never
    reallocated. None: dynamic (buffers grow by 1/8 when full, ``_grown``)."""
    spare_rows: int = 256
    """Static cache: rows per rank beyond ``ceil(max_len / W)`` (a chunk in a layout can put up to
    ``divisor / W`` rows more on one rank than an even split; decode tokens are round-robin)."""
    kv_heads: int | None = None
    head_dim: int | None = None
    value_head_dim: int | None = None
    """K and V shapes (Hkv, D, Dv) and ``dtype``/``device``: all given = buffers allocated now; otherwise at
    each layer's first store, from the tensors (and checked against what is given)."""
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    kernel: str = "auto"
    """Local kernel for every block ("auto" or a name, ``seqpar.kernels.available_kernels()``)."""
    passes: str = "auto"
    """How a chunk that extends the cache attends to it: "auto" (by bytes, ``choose_extend_pass``), "kv" or "q"."""

    def __post_init__(self) -> None:
        rs = rank_suffix()
        for name in ("layers", "batch", "spare_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "spare_rows" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}{rs}")
        for name in ("max_len", "kv_heads", "head_dim", "value_head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}{rs}")
        if self.passes not in ("auto", "kv", "q"):
            raise ValueError(f"passes must be 'auto', 'kv' or 'q', got {self.passes!r}{rs}")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None, got {self.dtype!r}{rs}")

    @property
    def shapes_known(self) -> bool:
        return None not in (self.kv_heads, self.head_dim, self.dtype, self.device)


@dataclass(eq=False)
class Chunk:
    """One forward pass over new tokens (Note [Chunks]).

    Attributes:
        start: cache position of the chunk's first token (P).
        tokens: valid tokens in the chunk (T).
        sharded: True for a prompt chunk split over the ranks, False for replicated (decode) tokens.
        mode: "fill" (a sharded chunk on an empty cache: ``seqpar.attention`` with the chunk's method), "extend"
            (a sharded chunk attending to a non-empty cache: pass-KV or pass-Q) or "decode" (replicated).
        rows: this rank's rows of the chunk as runs of cache positions, in local order (sharded: this rank's
            share, padding included; replicated: ``P..P+T-1``). ``positions`` and ``position_ids`` are made from
            them when first read (host tensors); ``position_ids_on`` and ``take`` make theirs on the device.
        starts: each batch row's first real token (left padding).
        valid: this rank's rows that are real tokens (a prefix of its rows; the rest is layout padding).
        method, layout, options: how a sharded chunk is laid out and, for "fill", attended.
        mask_mod: a "fill" chunk's named mask that carries its own causality (``seqpar.masks.spans``: Gemma 3's
            images), attended with ``causal=False`` (``begin_prefill``).
        padded: the chunk's global length after padding to the layout (sharded chunks).
        passes: per layer, the pass an "extend" chunk used and why (``choice.PassDecision``).
        whole: this rank holds every token of the chunk, in order, with no padding (one rank): ``take`` is the
            identity.
    """

    start: int
    tokens: int
    sharded: bool
    mode: str
    rows: Segments
    starts: tuple[int, ...]
    valid: int
    method: str | None = None
    layout: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    mask_mod: Any = None
    padded: int = 0
    queries: tuple[Segments, ...] = ()
    passes: dict[int, PassDecision] = field(default_factory=dict)
    stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    attended: set[int] = field(default_factory=set)
    whole: bool = False

    @property
    def end(self) -> int:
        return self.start + self.tokens

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Cache positions of this rank's rows, int64 ``(L,)`` in local order, on the host."""
        return _positions(self.rows, torch.device("cpu"))

    @functools.cached_property
    def position_ids(self) -> torch.Tensor:
        """RoPE positions ``(B, L)`` on the host: ``positions - start`` of each row (0 on its left padding)."""
        return _rope(self.positions, self.starts)

    def position_ids_on(self, device: torch.device | str) -> torch.Tensor:
        """``position_ids`` made on ``device`` (Note [Chunk positions on the device])."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.position_ids
        return _rope(_positions(self.rows, device), self.starts)

    def take(self, x_BT: torch.Tensor, pad_value: int | float = 0) -> torch.Tensor:
        """This rank's rows of a chunk-wide tensor ``(B, T, ...)`` (dim 1 = the chunk's tokens, unpadded)."""
        if x_BT.shape[1] != self.tokens:
            raise ValueError(f"the chunk's tensor must have {self.tokens} tokens on dim 1, got shape "
                             f"{tuple(x_BT.shape)}{rank_suffix()}")
        if not self.sharded or self.whole:
            return x_BT
        extra = self.padded - self.tokens
        if extra:
            pad = x_BT.new_full((x_BT.shape[0], extra, *x_BT.shape[2:]), pad_value)
            x_BT = torch.cat([x_BT, pad], 1)
        return x_BT.index_select(1, _positions(self.rows, x_BT.device, offset=-self.start))


# Note [Chunk positions on the device]
#     A chunk's rows are a few runs of cache positions (``rows``); the tensors made from them - the rows'
#     positions, their RoPE positions, the indices ``take`` selects - are ``S / W`` long. Made on the host,
#     they cost milliseconds of host tensor work at 128K tokens (measured: ``begin_prefill`` held the first
#     prefill kernel back 2.0 ms on an idle H100, benchmarks/results/2026-11-25-prefill) and then a copy.
#     Made on the device, each run is one ``arange`` launch and nothing crosses from the host, except the
#     rows' left padding when some row has any (a few ints, pinned and non-blocking).


def _positions(rows: Segments, device: torch.device, offset: int = 0) -> torch.Tensor:
    """``(L,)`` int64 on ``device``: every run's positions (plus ``offset``), in local order."""
    parts = [torch.arange(r.glob + offset, r.glob + offset + rows.stride * r.length, rows.stride,
                          dtype=torch.long, device=device) for r in rows.runs]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _rope(positions: torch.Tensor, starts: tuple[int, ...]) -> torch.Tensor:
    """``(B, L)`` RoPE positions: ``positions - starts[b]``, 0 on row b's left padding."""
    if not any(starts):
        return positions[None, :].expand(len(starts), -1)
    return (positions[None, :] - host_to_device(torch.tensor(starts), positions.device)[:, None]).clamp_(min=0)


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory and a non-blocking copy on CUDA, since a copy from
    pageable memory waits for the device queue to drain (the host then stalls mid-forward)."""
    if device.type != "cuda" or x.device == device:
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


class _Layer:
    """One layer's buffers on this rank: sequence-major K ``(cap, B, Hkv, D)`` and V ``(cap, B, Hkv, Dv)``.

    ``base`` is the logical row (``RankRows`` numbering) of buffer row 0; rows below ``evicted[j]`` on rank j
    are dead (Note [Sliding windows and eviction]).
    """

    def __init__(self, world: int):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.base = 0
        self.evicted = [0] * world
        self.window: int | None = None
        self.spare = 0
        """Rows at the end that hold no token: a static cache's scratch row (Note [Static decode step])."""

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[0] - self.spare


class ShardedKVCache:
    """A KV cache whose tokens are split over the ranks of ``mesh`` (Note [Cache layout]).

    Construction is a collective (the ranks exchange their global ranks once); every later call must be made
    on every rank of the group, in the same order, with the same arguments (it is one SPMD program).

    Args:
        layers, batch, max_len, kv_heads, head_dim, value_head_dim, dtype, device, kernel, passes: see
            ``CacheSpec``.
        mesh: the sequence-parallel group: a DeviceMesh (2D ``("ulysses", "ring")`` for caches filled by
            ``usp``), a ProcessGroup, or None for the default group.
    """

    def __init__(self, *, layers: int, batch: int, mesh: Any = None, **spec: Any):
        self.spec = CacheSpec(layers=layers, batch=batch, **spec)
        self.mesh = mesh
        dims = 2 if getattr(mesh, "ndim", 1) == 2 else 1
        self.groups = SeqParallelGroups.resolve(mesh, dims)
        self.world, self.index = self.groups.world, self.groups.index
        self.ranks = tuple(host_gather(self.groups, dist.get_rank()))
        """Global rank of every sequence-parallel index (for point-to-point transfers on any mesh)."""
        self.rows = [RankRows() for _ in range(self.world)]
        self.layers = [_Layer(self.world) for _ in range(layers)]
        self.length = 0
        self.starts: tuple[int, ...] = (0,) * batch
        self.chunk: Chunk | None = None
        self._pairs: dict[tuple, Any] = {}                 # the open chunk's plans, by window and eviction
        self._static: Any = None
        if self.spec.shapes_known:
            for i in range(layers):
                self._allocate(i, self.spec.kv_heads, self.spec.head_dim,
                               self.spec.value_head_dim or self.spec.head_dim, self.spec.dtype,
                               torch.device(self.spec.device))

    # -- what the cache holds ------------------------------------------------------------------------------

    @property
    def static(self) -> bool:
        return self.spec.max_len is not None

    @property
    def rank_capacity(self) -> int | None:
        """Rows per rank of a static cache (None when dynamic)."""
        if self.spec.max_len is None:
            return None
        return -(-self.spec.max_len // self.world) + self.spec.spare_rows

    @property
    def row_groups(self) -> tuple[RowGroup, ...]:
        """Batch rows grouped by start (one group covering the batch when all start together)."""
        starts = sorted(set(self.starts))
        if len(starts) == 1:
            return (RowGroup(starts[0], None),)
        return tuple(RowGroup(s, tuple(b for b, x in enumerate(self.starts) if x == s)) for s in starts)

    def live(self, layer: int, rank: int | None = None) -> tuple[int, int]:
        """Logical rows ``(first, stop)`` of ``layer`` that are live on ``rank`` (default: this one)."""
        j = self.index if rank is None else rank
        return self.layers[layer].evicted[j], self.rows[j].total

    def slice(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's live K ``(n, B, Hkv, D)`` and V ``(n, B, Hkv, Dv)`` of ``layer`` (views, sequence-major)."""
        lay = self.layers[layer]
        first, stop = self.live(layer)
        if lay.k is None or lay.v is None:
            raise RuntimeError(f"layer {layer} has stored nothing yet{rank_suffix()}")
        return lay.k[first - lay.base:stop - lay.base], lay.v[first - lay.base:stop - lay.base]

    def memory(self) -> dict[str, int]:
        """This rank's KV bytes allocated (``allocated``) and held by live rows (``live``), and live rows."""
        allocated = live = rows = 0
        for i, lay in enumerate(self.layers):
            if lay.k is None or lay.v is None:
                continue
            per_row = (lay.k[0].numel() * lay.k.element_size() + lay.v[0].numel() * lay.v.element_size())
            allocated += lay.capacity * per_row
            first, stop = self.live(i)
            live += (stop - first) * per_row
            rows += stop - first
        return {"allocated": allocated, "live": live, "rows": rows}

    # -- chunks --------------------------------------------------------------------------------------------

    def begin_prefill(self, seq_len: int, *, method: str = "ring", layout: str | None = None,
                      starts: tuple[int, ...] | list[int] | None = None, mask_mod: Any = None,
                      **options: Any) -> Chunk:
        """Open a sharded chunk of ``seq_len`` new tokens (global) in ``method``'s ``layout`` (Note [Chunks]).

        On an empty cache the chunk is attended with ``seqpar.attention(method=..., layout=..., **options)``;
        on a non-empty one, by pass-KV or pass-Q over the cache (``CacheSpec.passes``). ``starts``: per batch
        row, the cache position of its first real token (left padding), given with the first chunk only.
        ``mask_mod``: on an empty cache only, a named mask (``seqpar.masks``) in cache positions that carries
        its own causality, e.g. ``spans`` (Gemma 3's images): the fill is attended with ``causal=False``, the
        mask and a layer's left window w as ``window_size=(w, -1)``; later chunks see every cached key causally.
        A length the layout cannot split is padded at the end; use ``chunk.take`` for this rank's tokens.
        """
        rs = rank_suffix()
        self._check_closed()
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}{rs}")
        if mask_mod is not None and (self.length or not isinstance(mask_mod, PieceMask)):
            raise NotImplementedError(f"mask_mod must be a named mask (seqpar.masks) on the chunk that fills an empty "
                                      f"cache (later chunks attend causally), got {mask_mod!r} with {self.length} "
                                      f"tokens cached{rs}")
        if starts is not None:
            self._set_starts(starts)
        if layout is None and self.world == 1 and _serves_causal_contiguous(method):
            layout = "contiguous"              # one rank: every layout is the identity, and contiguous never pads
        lay, _, _ = placement(self.mesh, method, layout)
        padded = -(-seq_len // lay.divisor) * lay.divisor
        P = self.length
        segs = [lay.segments(j, padded) for j in range(self.world)]
        for j, seg in enumerate(segs):                       # valid rows only: padding is at the end
            self.rows[j].append_runs([(P + r.glob, min(r.length, -(-(seq_len - r.glob) // seg.stride)), seg.stride)
                                      for r in seg.runs if r.glob < seq_len])
        queries = tuple(Segments(tuple(Run(r.local, r.glob + P, r.length) for r in seg.runs), seg.stride)
                        for seg in segs)
        mine = segs[self.index]
        valid = sum(min(r.length, -(-(seq_len - r.glob) // mine.stride)) for r in mine.runs if r.glob < seq_len)
        mode = "fill" if P == 0 else "extend"
        self.chunk = Chunk(P, seq_len, True, mode, queries[self.index], self.starts, valid,
                           method=method, layout=layout, options=dict(options), mask_mod=mask_mod, padded=padded,
                           queries=queries,
                           whole=self.world == 1 and padded == seq_len and segs[0].stride == 1
                           and len(segs[0].runs) == 1)
        return self.chunk

    def begin_decode(self, tokens: int = 1) -> Chunk:
        """Open a chunk of ``tokens`` new tokens that every rank has (decode; Note [Chunks]). Token at cache
        position p is stored on rank ``p mod W``."""
        self._check_closed()
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be a positive int, got {tokens!r}{rank_suffix()}")
        if self.length == 0:
            raise ValueError(f"the cache must hold a prompt before decoding, got an empty cache: call "
                             f"begin_prefill first{rank_suffix()}")
        P = self.length
        for p in range(P, P + tokens):
            self.rows[p % self.world].append([p])
        q = Segments((Run(0, P, tokens),), 1)
        self.chunk = Chunk(P, tokens, False, "decode", q, self.starts, tokens, queries=(q,))
        return self.chunk

    def _check_closed(self) -> None:
        if self._static is not None:
            raise RuntimeError(f"a static decode is running on this cache: close() it before the next chunk"
                               f"{rank_suffix()}")
        c = self.chunk
        if c is not None:
            missing = sorted(set(range(self.spec.layers)) - c.attended)
            raise RuntimeError(f"every layer must store and attend the open chunk before the next begins, got "
                               f"layers {missing[:8]} missing of {self.spec.layers}{rank_suffix()}")

    def _set_starts(self, starts: Any) -> None:
        rs = rank_suffix()
        if self.length or any(r.total for r in self.rows):
            raise ValueError(f"starts must come with the cache's first chunk, got them with {self.length} tokens "
                             f"cached{rs}")
        starts = tuple(starts)
        if len(starts) != self.spec.batch or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                 for s in starts):
            raise ValueError(f"starts must be {self.spec.batch} non-negative ints (one per batch row), got "
                             f"{starts}{rs}")
        self.starts = starts

    def _commit(self) -> None:
        """Every layer has attended: the chunk's tokens are cached; windows evict (Note [Sliding windows ...])."""
        c = self.chunk
        assert c is not None
        self.length = c.end
        self.chunk = None
        self._pairs.clear()
        self._evict()

    def _evict(self) -> None:
        for lay in self.layers:
            if lay.window is not None and lay.window >= 0:
                lay.evicted = [max(e, rows.first_row_at(self.length - lay.window))
                               for e, rows in zip(lay.evicted, self.rows)]

    # -- storage -------------------------------------------------------------------------------------------

    def _allocate(self, i: int, kv_heads: int, head_dim: int, value_head_dim: int, dtype: torch.dtype,
                  device: torch.device, rows: int = 0) -> None:
        """Layer i's buffers: a static cache's rows per rank and its scratch row; a dynamic cache's ``rows``
        and room to grow (``_grown``)."""
        cap = self.rank_capacity + 1 if self.rank_capacity is not None else _grown(0, rows)
        B = self.spec.batch
        lay = self.layers[i]
        lay.spare = 1 if self.static else 0
        new = torch.zeros if self.static else torch.empty    # the static step reads every row (0 * NaN = NaN)
        lay.k = new(cap, B, kv_heads, head_dim, dtype=dtype, device=device)
        lay.v = new(cap, B, kv_heads, value_head_dim, dtype=dtype, device=device)

    def _reserve(self, i: int, n: int) -> int:
        """Room for ``n`` more rows on this rank in layer ``i``; returns the buffer row to write at."""
        lay = self.layers[i]
        assert lay.k is not None and lay.v is not None
        first, stop = self.live(i)
        stop -= n                                            # the chunk's rows are already counted in rows[]
        end = stop - lay.base
        if end + n <= lay.capacity:
            return end
        keep = stop - first
        if keep + n > lay.capacity and self.static:
            raise ValueError(f"a static cache holds {lay.capacity} rows per rank (max_len={self.spec.max_len}, "
                             f"spare_rows={self.spec.spare_rows}), got {keep + n} live rows in layer {i}: give a "
                             f"larger max_len{rank_suffix()}")
        cap = lay.k.shape[0] if keep + n <= lay.capacity else _grown(lay.capacity, keep + n)
        live_k, live_v = lay.k[first - lay.base:stop - lay.base], lay.v[first - lay.base:stop - lay.base]
        if cap == lay.k.shape[0]:                            # dead rows dropped; live rows to the front
            k, v, live_k, live_v = lay.k, lay.v, live_k.clone(), live_v.clone()
        else:
            k, v = lay.k.new_empty(cap, *lay.k.shape[1:]), lay.v.new_empty(cap, *lay.v.shape[1:])
        k[:keep], v[:keep] = live_k, live_v
        lay.k, lay.v, lay.base = k, v, first
        return keep

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the open chunk's K ``(B, L, Hkv, D)`` and V ``(B, L, Hkv, Dv)`` of ``layer``: this rank's share
        (sharded: its valid rows; replicated: the tokens it owns)."""
        c = self._open(layer, "store")
        if layer in c.stored:
            raise RuntimeError(f"layer {layer} already stored the open chunk{rank_suffix()}")
        self._check_kv(layer, k, v, c)
        lay = self.layers[layer]
        if lay.k is None:
            self._allocate(layer, k.shape[2], k.shape[3], v.shape[3], k.dtype, k.device,
                           self.rows[self.index].total)
        if c.sharded:
            rows_k, rows_v = k[:, :c.valid], v[:, :c.valid]
        else:                                                # tokens i0, i0 + W, ... are this rank's
            i0 = (self.index - c.start) % self.world
            rows_k, rows_v = k[:, i0::self.world], v[:, i0::self.world]
        at = self._reserve(layer, rows_k.shape[1])
        assert lay.k is not None and lay.v is not None
        lay.k[at:at + rows_k.shape[1]] = rows_k.transpose(0, 1)
        lay.v[at:at + rows_v.shape[1]] = rows_v.transpose(0, 1)
        c.stored[layer] = (k, v)

    def _open(self, layer: int, what: str) -> Chunk:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.spec.layers:
            raise ValueError(f"layer must be an int in [0, {self.spec.layers}), got {layer!r}{rank_suffix()}")
        if self.chunk is None:
            raise RuntimeError(f"{what} needs an open chunk: call begin_prefill or begin_decode first{rank_suffix()}")
        return self.chunk

    def _check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, c: Chunk) -> None:
        L = c.rows.length
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4D tensor (batch, tokens, kv_heads, head_dim), got "
                                 f"{getattr(t, 'shape', type(t).__name__)}{rank_suffix()}")
            if t.shape[0] != self.spec.batch or t.shape[1] != L:
                raise ValueError(f"{name} must have batch {self.spec.batch} and {L} tokens (this rank's rows of the "
                                 f"chunk), got shape {tuple(t.shape)}{rank_suffix()}")
        if k.shape[2] != v.shape[2] or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"k and v must share kv heads, dtype and device, got {tuple(k.shape)} {k.dtype} "
                             f"{k.device} and {tuple(v.shape)} {v.dtype} {v.device}{rank_suffix()}")
        lay, spec = self.layers[layer], self.spec
        want = (spec.kv_heads, spec.head_dim, spec.value_head_dim or spec.head_dim, spec.dtype)
        if lay.k is not None and lay.v is not None:
            want = (lay.k.shape[2], lay.k.shape[3], lay.v.shape[3], lay.k.dtype)
        got = (k.shape[2], k.shape[3], v.shape[3], k.dtype)
        if any(w is not None and w != g for w, g in zip(want, got)):
            raise ValueError(f"k, v of layer {layer} must have (kv_heads, head_dim, value_head_dim, dtype) = "
                             f"{want}, got {got}{rank_suffix()}")

    # -- planning ------------------------------------------------------------------------------------------

    def pairs(self, layer: int, window: int, chunk: int | None = None) -> Pairs:
        """Tasks of every (query owner, slice owner) pair for the open chunk at ``layer`` (cached per chunk,
        window, attention chunk size and eviction state: layers that share them share the plan)."""
        c = self.chunk
        assert c is not None
        lay = self.layers[layer]
        key = (window, chunk, tuple(lay.evicted))
        if key not in self._pairs:
            slices = [self.rows[j].segment_groups(lay.evicted[j]) for j in range(self.world)]
            rule = Rule(causal=True, window=(window, 0))
            self._pairs[key] = plan_pairs(c.queries, slices, rule, self.row_groups, c.end, chunk)
        return self._pairs[key]

    def decode_tasks(self, layer: int, window: int, chunk: int | None = None) -> tuple:
        """Per row group, the tasks of the open decode chunk's queries against this rank's live slice."""
        c = self.chunk
        assert c is not None
        first = self.layers[layer].evicted[self.index]
        key = ("decode", window, chunk, first)
        if key not in self._pairs:
            groups = self.rows[self.index].segment_groups(first)
            rule = Rule(causal=True, window=(window, 0))
            self._pairs[key] = tuple(pair_tasks(c.queries[0], groups, rule, g.bounds(c.end, chunk))
                                     for g in self.row_groups)
        return self._pairs[key]

    def static_decode(self):
        """Graph-capturable decode steps (``decode.StaticDecode``, Note [Static decode step]); a collective."""
        from .decode import StaticDecode

        rs = rank_suffix()
        self._check_closed()
        if not self.static:
            raise ValueError(f"static_decode needs a static cache (max_len=...), got a dynamic one{rs}")
        if self.length == 0 or any(lay.k is None for lay in self.layers):
            raise ValueError(f"static_decode needs a prompt in every layer first, got {self.length} tokens{rs}")
        self._static = StaticDecode(self, torch.tensor(self.starts, dtype=torch.long))
        return self._static

    @property
    def static_step(self) -> Any:
        """The running ``StaticDecode`` (between ``static_decode()`` and its ``close()``), else None."""
        return self._static

    def _close_static(self, dec: Any, n: int) -> None:
        """Record ``n`` tokens a static decode wrote (rows were written where the host logic puts them)."""
        self._static = None
        P = self.length
        for p in range(P, P + n):
            self.rows[p % self.world].append([p])
        self.length = P + n
        self._evict()

    def set_window(self, layer: int, window: int) -> None:
        """Record ``layer``'s left window (-1 = none); it must not change once tokens are cached."""
        lay = self.layers[layer]
        if lay.window is not None and lay.window != window:
            raise ValueError(f"window_size of layer {layer} must stay ({lay.window}, 0) across calls (evicted rows "
                             f"cannot come back), got ({window}, 0){rank_suffix()}")
        lay.window = window

    def mark_attended(self, layer: int) -> None:
        c = self.chunk
        assert c is not None
        c.attended.add(layer)
        if len(c.attended) == self.spec.layers:
            self._commit()


def _serves_causal_contiguous(method: str) -> bool:
    """Whether ``method`` attends causally on the contiguous layout (the API's own validation says)."""
    try:
        attention_config(method, layout="contiguous", causal=True)
    except ValueError:
        return False
    return True


def _grown(capacity: int, need: int) -> int:
    """A dynamic cache's next capacity: 1/8 above what is needed (at least 64 rows) and above the old one, so
    reallocations are geometric (amortised O(1) copies per row) while memory stays within 1.125x the rows."""
    return max(need, capacity) + max(64, max(need, capacity) // 8)


def host_gather(groups: SeqParallelGroups, value: int) -> list[int]:
    """Every rank's ``value``, by sequence-parallel index (a small collective on the group's device type; none
    on one rank, where reading its result back would stall the host on the device queue)."""
    if groups.world == 1:
        return [value]
    probe = groups.group if groups.group is not None else groups.ring
    device = "cuda" if dist.get_backend(probe) == "nccl" else "cpu"
    x = torch.tensor([value], dtype=torch.int64, device=device)
    return [int(t) for t in groups.all_gather(x)]
