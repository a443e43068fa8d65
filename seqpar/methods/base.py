"""What a method declares, and the registry every reader uses.

Each method module ends with one ``METHOD = Method(...)``: its name, the layouts it accepts (and which of them
serve causal masks), its mesh dimensions, its options with defaults, the features it serves, where its tokens
live (``placement``), the engine it builds for a planned call, its cost model and the configurations the
planner, the benchmark and the demo should try. Nothing else in seqpar keeps a list of methods: the API
validates against these declarations, ``method="auto"`` and ``seqpar.plan`` enumerate ``candidates``, drop
those ``why_not`` refuses and predict the rest with ``cost``, ``python -m seqpar.bench`` times
``bench_specs`` and the demo runs ``demo_cases``.
Adding a method is its module (ending in ``METHOD = Method(...)``, listed in ``BUILTIN``) and its tests;
``register`` adds one from anywhere (tests register a toy method this way).

Note [Engines]
    A planned call (``seqpar.runtime.call``) builds the method's engine once per call signature: schedules,
    kernel choices per kind of block, buffer shapes and the communication plan live in it, so a steady-state
    call only launches kernels and communication. The contract:

        engine.forward(q, k, v) -> (out, lse) or (out, lse, saved)       out (B, L, H, Dv), lse (B, H, L)
        engine.backward(b: BackwardInputs) -> (dq, dk, dv)

    ``out``/``lse`` are the merged rows before attention sinks (the runtime applies sinks, Note [Attention
    sinks] in ``seqpar.numerics``). ``saved`` (engines with ``saves = True``) replaces the default saved
    ``(q, k, v)``; such an engine's backward reads only dO and the lse gradient of the final rows (its saved
    tensors hold the rest: a graphed backward copies no ``out`` in for it). Backward gets the FINAL rows (sinks
    included) as ``seqpar.numerics.GradRows``; whether a gradient
    reaches lse is the agreed fact ``b.lse_grad`` (``return_lse``), never this rank's local observation, so
    every rank exchanges the same messages (a rank whose lse got no gradient sends zeros).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch

from ..config import AttentionConfig
from ..errors import rank_suffix
from ..groups import SeqParallelGroups
from ..layouts import Layout, Rule, make_layout
from ..numerics import GradRows

__all__ = ["BUILTIN", "FEATURES", "LONG_CONTEXT", "BackwardInputs", "Call", "Engine", "Method", "available",
           "causal_layouts", "get", "register", "ring_placement", "unregister"]

#: every feature a method may declare; the API refuses a call that uses one its method does not declare
FEATURES = ("window", "varlen", "padding", "lse_grad", "value_dim", "sinks", "softcap", "document_layouts", "mask")

#: the built-in methods, by module (imported on first use, so importing seqpar stays cheap)
BUILTIN = ("ring", "allgather", "ulysses", "usp", "tokenring", "tasp", "double_ring")

#: benchmark presets at least this long time only each method's memory-bounded configurations (``bench_specs``)
LONG_CONTEXT = 1 << 20


@dataclass(frozen=True)
class Call:
    """Everything a method's engine is built from: fixed by the call signature.

    Attributes:
        q_shape, k_shape, v_shape: local shapes ``(B, L, H, D)``, ``(B, L, Hkv, D)``, ``(B, L, Hkv, Dv)``.
        dtype, device: of q, k and v.
        cfg: the validated options.
        groups: the process groups.
        layout, index: this rank's placement (``Method.placement``).
        grad: a backward will follow (inputs require grad).
        lse_grad: lse is returned, so a gradient may reach it (agreed on every rank).
    """

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    cfg: AttentionConfig
    groups: SeqParallelGroups
    layout: Layout
    index: int
    grad: bool
    lse_grad: bool

    @property
    def seq_len(self) -> int:
        """The global (padded) length: local rows times ranks."""
        return self.q_shape[1] * self.groups.world

    @property
    def packed(self) -> bool:
        """Several documents: a packed batch, whose plan serves one step (Note [Graphed batches] in
        ``seqpar.runtime.graphs``)."""
        docs = self.cfg.cu_seqlens
        return docs is not None and len(docs) > 2

    @property
    def shapes_vary(self) -> bool:
        """Its blocks' shapes come from the batch (Note [Plans per shape] in ``seqpar.kernels.base``): several
        documents, or a valid length short of the global length by the layout's divisor or more (padding to a
        longest sequence, lengths without bound). One document over the whole sequence (a balanced layout's
        ``(0, S)``) keeps the shapes of the signature, and so does padding up to the layout's divisor
        (``shard(pad=True)``, a method's own sub-chunks): a padded length then has fewer valid lengths than the
        divisor, so per-shape plans stay bounded."""
        valid = self.cfg.valid_len
        return self.packed or (valid is not None and self.seq_len - valid >= self.layout.divisor)

    @property
    def head_dim(self) -> int:
        return self.q_shape[-1]

    @property
    def value_dim(self) -> int:
        return self.v_shape[-1]

    @property
    def scale(self) -> float:
        return self.cfg.scale(self.head_dim)


@dataclass
class BackwardInputs:
    """What an engine's backward gets (Note [Engines]).

    Attributes:
        rows: the final local rows (``do``, ``out`` with sinks applied, the lse gradient if any).
        lse: the final lse ``(B, H, L)``.
        q, k, v: the local inputs (None for engines that save their own tensors).
        saved: the engine's own saved tensors (``saves = True``), else ().
        sinks: the sink logits ``(H,)`` or None.
        lse_grad: whether lse gradients are part of this call's messages (``return_lse``, agreed).
    """

    rows: GradRows
    lse: torch.Tensor
    q: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    saved: tuple[torch.Tensor, ...]
    sinks: torch.Tensor | None
    lse_grad: bool

    @property
    def dlse(self) -> torch.Tensor | None:
        """The lse gradient as the messages carry it: zeros where this rank's lse got none (when agreed)."""
        d = self.rows.dlse
        if d is None and self.lse_grad:
            return torch.zeros_like(self.lse)
        return d


class Engine(Protocol):
    """A method's planned schedule (Note [Engines])."""

    saves: bool

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def backward(self, b: BackwardInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _no_check(call: Call) -> None:
    return None


def ring_placement(layout: str, groups: SeqParallelGroups, documents: tuple[int, ...] | None = None,
                   rule: Rule | None = None) -> tuple[Layout, int]:
    """Tokens follow ``layout`` over the whole group; this rank holds piece ``groups.index`` (``rule``: what
    ``balanced`` balances, ``AttentionConfig.balance_rule``)."""
    return make_layout(layout, groups.world, documents, rule), groups.index


@dataclass(frozen=True, kw_only=True, eq=False)
class Method:
    """A sequence-parallel method's declaration (module docstring).

    Equality and hashing are by identity: the planner's caches key on the declarations they ranked, so a
    method registered again under the same name is a new key.
    """

    name: str
    """The ``method=`` string."""
    summary: str
    """One line: what moves (README status table, demo, plan output)."""
    layouts: tuple[str, ...]
    """Layouts it accepts; ``layout=None`` means zigzag where listed, else the first."""
    causal_layouts: tuple[str, ...] | None = None
    """The layouts that serve causal masks, when not all of ``layouts`` do."""
    packed_layout: str | None = None
    """The layout of a packed batch whose caller names none (``document_layout``); None: ``balanced`` where
    accepted."""
    mesh_dims: int = 1
    """1 (a group or 1D mesh) or 2 (a ("ulysses", "ring") mesh)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Method options and their defaults; any other option is an error."""
    features: frozenset[str] = frozenset()
    """The subset of ``FEATURES`` it serves."""
    placement: Callable[..., tuple[Layout, int]] = ring_placement
    """``(layout name, groups, documents, balance rule) -> (Layout, index)``: where this rank's tokens live. It
    reads only ``groups.world``, ``groups.index``, ``groups.ulysses_size`` and ``groups.ring_size`` (the planner
    places tokens without process groups)."""
    check: Callable[[Call], None] = _no_check
    """Method rules (options, head counts) checked before any collective; raise with the reason."""
    engine: Callable[[Call], Engine]
    """Builds the planned engine for one call signature."""
    cost: Callable[..., Any] | None = None
    """``(Problem, Candidate, Machine) -> Prediction``: the planner's model, written with
    ``seqpar.cost.model`` (None: the planner cannot rank it, and ``method="auto"`` never picks it)."""
    modelled_transports: tuple[str, ...] = ("nccl",)
    """The ``transport`` option's values ``cost`` predicts (a method that takes the option): a configuration on
    another is not ranked, so ``method="auto"`` never picks it, and ``seqpar.planner.validate`` does not predict
    its records."""
    candidates: Callable[..., list] | None = None
    """``(Problem, Topology, layouts, ulysses) -> [Candidate]``: the configurations worth predicting on the
    given layouts (already filtered to the caller's layout, to those serving the mask, and to document
    layouts only for packed problems); ``ulysses`` is the fixed degree of a 2D mesh or None. None: one
    candidate per layout with default options (2D methods: every Ulysses degree 1 < U < W dividing W)."""
    why_not: Callable[..., list] | None = None
    """``(Problem, Candidate) -> [reason]``: the rules a configuration breaks on a problem (head counts,
    option values), empty when it can run - ``check``'s counterpart for the planner, which also checks
    features, options and the layout's length rules itself."""
    bench_specs: Callable[..., list] | None = None
    """``(Preset, world) -> [(layout, options, ulysses)]``: configurations ``python -m seqpar.bench`` times
    (``ulysses`` None for 1D methods)."""
    demo_cases: Callable[..., list] | None = None
    """``(world, seq_len, documents) -> [dict of seqpar.testing.Case fields]``: rows of ``python -m seqpar
    demo`` (``documents``: packed ``cu_seqlens`` over ``seq_len`` a row may use)."""
    slowest_rank: Callable[..., int] | None = None
    """``(layout name, world, seq_len, rule) -> rank``: the rank an emulated world times (Note [Emulated world] in
    ``seqpar.bench``) when the method's ranks differ in cost where the layout gives them the same work; None: the
    rank with the most work."""
    saved_meta: Callable[..., list] | None = None
    """For engines that save their own tensors: ``(q_shape, k_shape, v_shape, dtype, groups, options) ->
    [(shape, dtype)]`` - shape arithmetic only (symbolic under torch.compile)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        unknown = sorted(set(self.features) - set(FEATURES))
        if unknown:
            raise ValueError(f"features must be a subset of {list(FEATURES)}, got {unknown}")
        if self.mesh_dims not in (1, 2):
            raise ValueError(f"mesh_dims must be 1 or 2, got {self.mesh_dims!r}")
        if self.packed_layout is not None and self.packed_layout not in self.layouts:
            raise ValueError(f"packed_layout must be one of the layouts {list(self.layouts)}, got "
                             f"{self.packed_layout!r}")

    @property
    def serves_causal(self) -> tuple[str, ...]:
        return self.layouts if self.causal_layouts is None else self.causal_layouts

    def default_layout(self) -> str:
        """``layout=None``: zigzag (causally balanced) where accepted, else the first layout."""
        return "zigzag" if "zigzag" in self.layouts else self.layouts[0]

    def document_layout(self) -> str | None:
        """The layout for a packed batch when none is named: ``packed_layout``, else ``balanced`` where accepted,
        else None (the method's default)."""
        if self.packed_layout is not None:
            return self.packed_layout
        return "balanced" if "balanced" in self.layouts else None


_REGISTRY: dict[str, Method] = {}


def _load_builtins() -> None:
    for name in BUILTIN:
        if name not in _REGISTRY:
            _REGISTRY[name] = importlib.import_module(f"seqpar.methods.{name}").METHOD


def register(method: Method) -> Method:
    """Make ``method`` available to ``seqpar.attention``, the planner, the benchmark and the demo."""
    if not isinstance(method, Method):
        raise TypeError(f"method must be a seqpar.methods.Method, got {type(method).__name__}")
    _load_builtins()
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a registered method (built-in methods come back on next use)."""
    _REGISTRY.pop(name, None)


def available() -> list[str]:
    """Names ``seqpar.attention(method=...)`` accepts."""
    _load_builtins()
    return list(_REGISTRY)


def get(name: str) -> Method:
    """The declaration of ``name``; ValueError listing the valid names otherwise."""
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"method must be one of {available()}, got {name!r}{rank_suffix()}")
    return _REGISTRY[name]


def causal_layouts(method: Method) -> tuple[str, ...]:
    """The layouts of ``method`` that serve causal=True."""
    return method.serves_causal
