"""The cluster simulator: every method's predicted efficiency and memory on a described topology.

    rows = simulate(gpus=[8, 64, 1024], seq_lens=[1 << 20], heads=32, kv_heads=8, topology="nvswitch")
    print(table(rows)); plot(rows, "sim.png")

For each (GPU count, sequence length) it ranks every registered method with a cost model (``search.plan``;
lengths a layout cannot split are assumed padded) and keeps each method's best
configuration. Efficiency is the single-GPU kernel time on the whole problem divided by W times the
predicted time (the benchmark's definition), so 100% means perfect scaling of the local kernel. It can
exceed 100% a little: a distributed causal pass runs mostly unmasked blocks, which the kernels execute at a
higher rate than the single-GPU causal call (cuDNN: ~630 vs ~560 TFLOP/s on H200).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .search import modelled_methods, plan

__all__ = ["SimRow", "plot", "simulate", "table"]


@dataclass(frozen=True)
class SimRow:
    """One method's best configuration at one (gpus, seq_len) point, or why it cannot run."""

    gpus: int
    seq_len: int
    method: str
    label: str
    time_ms: float | None
    efficiency: float | None
    peak_mem_gib: float | None
    exposed_ms: float | None
    best: bool
    note: str


def simulate(*, gpus: Sequence[int], seq_lens: Sequence[int], methods: Sequence[str] | str = "all",
             mode: str = "fwd+bwd", **problem: Any) -> list[SimRow]:
    """Rows for every method at every (gpus, seq_len); ``problem`` goes to ``plan`` (heads, topology, ...)."""
    rows: list[SimRow] = []
    names = tuple(modelled_methods()) if methods in ("all", "available") else tuple(methods)
    for W in gpus:
        for S in seq_lens:
            r = plan(seq_len=S, world=W, mode=mode, methods=names, pad=True, **problem)
            best = r.best
            for name in names:
                mine = [e for e in r.entries if e.candidate.method == name]
                if not mine:
                    rows.append(SimRow(W, S, name, name, None, None, None, None, False, "no configuration at this W"))
                    continue
                e = mine[0]
                if e.ok:
                    assert e.prediction is not None
                    rows.append(SimRow(W, S, name, e.label, e.time_ms, e.efficiency, e.peak_mem_gib,
                                       e.prediction.exposed_ms(mode), e is best, "; ".join(e.prediction.notes[:1])))
                else:
                    rows.append(SimRow(W, S, name, e.label, None, None, None, None, False, "; ".join(e.why_not)))
    return rows


def table(rows: Sequence[SimRow]) -> str:
    """A plain-text table, one line per (gpus, seq_len, method); '*' marks the fastest."""
    out = [f"{'gpus':>6} {'seq_len':>9}   {'method (best config)':<30} {'time ms':>11} {'eff':>7} {'mem GiB':>8} "
           f"{'exposed':>9}  note"]
    for r in rows:
        if r.time_ms is None:
            out.append(f"{r.gpus:>6} {r.seq_len:>9}   {r.label:<30} {'-':>11} {'-':>7} {'-':>8} {'-':>9}  {r.note}")
        else:
            out.append(f"{r.gpus:>6} {r.seq_len:>9} {'*' if r.best else ' '} {r.label:<30} {r.time_ms:>11.3f} "
                       f"{r.efficiency:>7.1%} {r.peak_mem_gib:>8.2f} {r.exposed_ms:>9.3f}  {r.note}")
    return "\n".join(out)


def to_records(rows: Sequence[SimRow]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def plot(rows: Sequence[SimRow], path: str | Path, title: str = "") -> str:
    """Efficiency (and memory) per method against GPUs, or against length when one GPU count is given.

    matplotlib is optional (the "bench" extra): without it nothing is drawn and the returned message
    says so.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed (pip install 'seqpar[bench]'); no plot written to {path}"
    by_gpus = len({r.gpus for r in rows}) > 1
    xs_key = "gpus" if by_gpus else "seq_len"
    groups = sorted({r.seq_len for r in rows}) if by_gpus else sorted({r.gpus for r in rows})
    fig, axes = plt.subplots(2, len(groups), figsize=(5 * len(groups), 7), squeeze=False)
    for col, g in enumerate(groups):
        sel = [r for r in rows if (r.seq_len if by_gpus else r.gpus) == g]
        for method in dict.fromkeys(r.method for r in sel):
            pts = [(getattr(r, xs_key), r.efficiency, r.peak_mem_gib) for r in sel
                   if r.method == method and r.efficiency is not None]
            if pts:
                axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
                axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=method)
        for ax, ylab in ((axes[0][col], "efficiency"), (axes[1][col], "peak memory (GiB)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xs_key)
            ax.set_ylabel(ylab)
            ax.grid(alpha=0.3)
        axes[0][col].set_title(f"{'seq_len' if by_gpus else 'gpus'} = {g}")
        axes[0][col].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
