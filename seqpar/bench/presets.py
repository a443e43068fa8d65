"""Benchmark presets: the performance issue's table, long-context runs, and CPU smoke sizes.

Each preset is a frozen config; ``targets`` and ``best_peer`` are the efficiency goals and the best peer
figures measured before seqpar existed (reference/PEERS.md §12), kept beside the preset so reports can
show them. Efficiency = single-GPU cuDNN time on the full sequence / N / our time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import methods

__all__ = ["MASKS", "PRESETS", "TABLE", "MethodSpec", "Preset", "method_specs"]


@dataclass(frozen=True, kw_only=True)
class Preset:
    name: str
    """Preset name, e.g. "mha-causal-128k"."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (GQA when fewer than heads)."""
    seq_len: int
    """Global sequence length."""
    causal: bool
    head_dim: int = 128
    batch: int = 1
    dtype: str = "bfloat16"
    modes: tuple[str, ...] = ("fwd", "fwd+bwd")
    targets: dict[str, float] = field(default_factory=dict)
    """Target efficiency per mode (4 GPUs)."""
    best_peer: dict[str, float] = field(default_factory=dict)
    """Best peer efficiency per mode before seqpar (PEERS.md §12, 4x H200)."""
    limit_from: int | None = None
    """Measure the single-GPU limit at this length and scale by FLOPs (sequences too long to time on one GPU)."""
    mask: tuple | None = None
    """A named mask's spec (``seqpar.masks.from_spec``): ``mask_mod=`` of every call; the limit is flex on one GPU
    with the same mask, the FLOPs are its visible pairs', and the peers (no masks) are not run."""

    def __hash__(self) -> int:
        return hash(self.name)

    def mask_mod(self):
        """The preset's named mask, or None."""
        from ..masks import from_spec

        return None if self.mask is None else from_spec(self.mask)

    def flops(self, mode: str, seq_len: int | None = None) -> float:
        s = self.seq_len if seq_len is None else seq_len
        if self.mask is not None:
            pairs = _pairs(self.mask, self.causal, s)
        else:
            pairs = s * s * (0.5 if self.causal else 1.0)
        return 4.0 * self.batch * pairs * self.heads * self.head_dim * (1.0 if mode == "fwd" else 3.5)

    def min_mem_gib(self, world: int) -> float:
        """q, k, v, out, dout and their gradients, plus lse, per GPU: the floor of fwd+bwd memory."""
        el = 2 if self.dtype in ("bfloat16", "float16") else 4
        local = self.batch * self.seq_len // world
        q_like = 4 * local * self.heads * self.head_dim * el          # q, out, dout, dq
        kv_like = 4 * local * self.kv_heads * self.head_dim * el      # k, v, dk, dv
        return (q_like + kv_like + local * self.heads * 4) / 2**30


def _pairs(mask: tuple, causal: bool, seq_len: int) -> int:
    """Visible (query, key) pairs of a masked sequence (the block planner's count on one rank)."""
    from ..layouts import Rule, make_layout
    from ..layouts.work import work
    from ..masks import from_spec

    return work(make_layout("contiguous", 1), seq_len, Rule(causal, mask=from_spec(mask)))[0]


def _m(name: str, seq: int, causal: bool, mask: tuple, **kw) -> Preset:
    return Preset(name=name, heads=32, kv_heads=8, seq_len=seq, causal=causal, mask=mask, **kw)


def _p(name, heads, kv, seq, causal, tf, tb, pf, pb, **kw) -> Preset:
    return Preset(name=name, heads=heads, kv_heads=kv, seq_len=seq, causal=causal,
                  targets={"fwd": tf, "fwd+bwd": tb}, best_peer={"fwd": pf, "fwd+bwd": pb}, **kw)


PRESETS: dict[str, Preset] = {p.name: p for p in [
    _p("mha-causal-128k", 32, 32, 131072, True, 0.97, 0.96, 0.94, 0.92),
    _p("mha-causal-16k", 32, 32, 16384, True, 0.70, 0.75, 0.36, 0.41),
    _p("gqa-causal-128k", 32, 8, 131072, True, 0.985, 0.96, 0.979, 0.945),
    _p("gqa-causal-16k", 32, 8, 16384, True, 0.70, 0.75, 0.34, 0.51),
    _p("mha-full-64k", 32, 32, 65536, False, 0.96, 0.96, 0.85, 0.88),
    _p("mha-full-16k", 32, 32, 16384, False, 0.75, 0.80, 0.46, 0.63),
    # communication-bound: 2K tokens per GPU on 4 GPUs (where pass-Q and TASP schedules are meant to pay)
    Preset(name="mha-causal-8k", heads=32, kv_heads=32, seq_len=8192, causal=True),
    # short chunks (issue 23) at real W = 2 and 4: 2K and 4K tokens per GPU, GQA like gqa-causal-16k
    Preset(name="gqa-causal-8k", heads=32, kv_heads=8, seq_len=8192, causal=True),
    Preset(name="gqa-causal-4k", heads=32, kv_heads=8, seq_len=4096, causal=True),
    Preset(name="gqa-causal-1m", heads=32, kv_heads=8, seq_len=1 << 20, causal=True, modes=("fwd+bwd",),
           targets={"fwd+bwd": 0.99}, best_peer={"fwd+bwd": 0.99}, limit_from=262144),
    Preset(name="gqa-causal-4m", heads=32, kv_heads=8, seq_len=1 << 22, causal=True, modes=("fwd+bwd",),
           targets={"fwd+bwd": 0.97}, limit_from=262144),
    # masks (issue 25): GQA 32/8, the models' named masks; the RL row is one 16K prompt with 8 responses of 2K
    _m("mask-shared-prefix-32k", 32768, False, ("tree", (0, 16384, *range(18432, 32769, 2048)), (-1,) + (0,) * 8)),
    _m("mask-chunked-128k", 131072, True, ("chunked", 8192)),
    _m("mask-chunked-16k", 16384, True, ("chunked", 8192)),
    _m("mask-spans-16k", 16384, False, ("spans", tuple((i * 1024 + 64, i * 1024 + 320) for i in range(16)), -1)),
    _m("mask-prefix-lm-16k", 16384, False, ("spans", ((0, 4096),), -1)),
    _m("mask-block-causal-16k", 16384, False, ("block_causal", 512)),
    _m("mask-sink-window-16k", 16384, False, ("sink_window", 4095, 4)),
    _m("mask-sink-window-128k", 131072, False, ("sink_window", 4095, 4)),
    # CPU smoke sizes (gloo): exercise the whole pipeline in seconds
    Preset(name="tiny-causal", heads=4, kv_heads=2, seq_len=512, causal=True, head_dim=32, dtype="float32"),
    Preset(name="tiny-full", heads=4, kv_heads=4, seq_len=512, causal=False, head_dim=32, dtype="float32"),
    Preset(name="tiny-mask", heads=4, kv_heads=2, seq_len=512, causal=False, head_dim=32, dtype="float32",
           mask=("tree", (0, 256, 320, 384, 448, 512), (-1, 0, 0, 0, 0))),
]}

#: the presets `--preset table` runs: the performance issue's table
TABLE = ("mha-causal-128k", "mha-causal-16k", "gqa-causal-128k", "gqa-causal-16k", "mha-full-64k", "mha-full-16k")
#: the presets `--preset masks` runs
MASKS = tuple(name for name in PRESETS if name.startswith("mask-"))


@dataclass(frozen=True)
class MethodSpec:
    """One seqpar configuration to time: method, layout, options, Ulysses degree (2D methods)."""

    method: str
    layout: str
    options: tuple[tuple[str, object], ...] = ()
    ulysses: int | None = None

    @property
    def label(self) -> str:
        """The record's name: method, Ulysses degree, layout (unless the method has only one), options; "auto/<layout>"
        for ``method="auto"`` (its records name the pick: Note [Auto rows] in ``seqpar.bench``)."""
        if self.method == "auto":
            return f"auto/{self.layout}"
        parts = [self.method]
        if self.ulysses is not None:
            parts.append(f"u{self.ulysses}")
        if len(methods.get(self.method).layouts) > 1:
            parts.append(self.layout)
        parts += [f"{k}{v}" for k, v in self.options]
        return "/".join(parts)

    @classmethod
    def parse(cls, label: str, world: int) -> MethodSpec:
        """The configuration ``label`` names on ``world`` ranks, read as the planner's validation reads records
        (``seqpar.planner.validate.parse_method``), e.g. ``ulysses/head_chunks2/transportcopy_engine``: so
        ``--methods`` may time configurations ``bench_specs`` does not list.

        Raises:
            ValueError: a part it cannot read, or a label that does not read back the same.
        """
        from ..planner.validate import parse_method

        c = parse_method(label, world)
        spec = cls(c.method, c.layout, c.options, c.ulysses if methods.get(c.method).mesh_dims == 2 else None)
        if spec.label != label:
            raise ValueError(f"--methods {label!r} reads back as {spec.label!r}: name its options in that order")
        return spec


def method_specs(preset: Preset, world: int, available: list[str]) -> list[MethodSpec]:
    """The seqpar configurations worth timing for ``preset`` on ``world`` ranks: every method of ``available``
    that declares ``bench_specs``, in registry order."""
    specs = []
    for name in methods.available():
        m = methods.get(name)
        if name in available and m.bench_specs is not None:
            specs += [MethodSpec(name, lay, tuple(opts), u) for lay, opts, u in m.bench_specs(preset, world)]
    return specs
