"""Fit the cost model's fixed costs (Note [Fixed costs] in ``profile.py``) to measured benchmark times.

    python -m seqpar.planner.fit PROBE.jsonl TABLE.jsonl LONG.jsonl --fit-file PROBE.jsonl \\
        --fit-presets mha-causal-16k,gqa-causal-16k,mha-full-16k [--out fit.md] [--json fit.json]

Everything that scales with the problem - kernel rates, link curves, overlap loss, merge passes - is
measured and stays as the profile has it. What is fitted is the time that does not scale: ``call_us``
(per call, forward and backward), ``step_us`` (per schedule step of each method, forward and backward)
and how much of it hides behind the device's work (κ, ``host_overlap_loss``). Per-collective latencies
(``latency_us``) are measured, not fitted (``measured.py``).

Note [Fixed-cost fit]
    Per pass (forward; backward), a row's predicted time is ``C + max(D, H) + κ·min(D, H)`` (Note [Step
    time] in ``model.py``): D, the device time, does not depend on the fixed costs; C is the pass's call
    cost and H = ``sum_k n_k θ_k``, ``n_k`` counting how often the pass pays step cost k (the method's
    schedule steps; head groups x ring steps for USP). D and ``n_k`` are read off the model itself
    (a prediction with every fixed cost zero, then the change for a unit cost with κ = 1), so the fit and
    the planner cannot disagree on what a cost multiplies. For each κ on a grid (0, 0.05, ..., 1), θ >= 0
    (a softplus of free parameters) minimises the mean absolute relative error ``|T(θ, κ) / T_measured -
    1|`` over the fit rows, smoothed below 2% (pseudo-Huber), by L-BFGS in float64 on the CPU from a
    few starting points (the max makes it non-convex); the κ with the smallest mean error wins. Absolute
    rather than squared error, so a few disturbed runs (a median of five, the slowest rank) pull less;
    relative, so a 2 ms row weighs as much as a 200 ms one.
    Nothing is fitted per (preset, method): one number per method and pass, shared by every shape.

    Honesty: the fit uses the rows of ``--fit-file`` and of ``--fit-presets`` only; every other row is a
    check. The report lists both sets and their errors separately.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cost.profile import DIRECTIONS, Profile, load_profile
from .search import modelled_methods
from .validate import STEADY_HELP, in_fit_set, modelled, predict_record, results, write_report

__all__ = ["Fit", "FitRow", "fit", "main", "params", "profile_with", "render", "split"]

_UNIT_US = 1000.0
_CALLS = len(DIRECTIONS)
"""``params()`` starts with the per-call costs (serial, Note [Step time] in ``model.py``), then the steps'."""
KAPPAS = tuple(i / 20 for i in range(21))
#: starting points of the θ search (softplus units: about 300, 500 and 700 µs per cost)
STARTS = (3.0, 5.0, 7.0)


def params(methods: Sequence[str] | None = None) -> tuple[str, ...]:
    """Names of the fitted costs: ``call/fwd``, ``call/bwd``, then ``step/<method>/<fwd|bwd>`` for ``methods``
    (default: every method with a cost model)."""
    methods = modelled_methods() if methods is None else methods
    return tuple(f"call/{d}" for d in DIRECTIONS) + tuple(f"step/{m}/{d}" for m in methods for d in DIRECTIONS)


def profile_with(profile: Profile, theta_us: dict[str, float], kappa: float) -> Profile:
    """``profile`` with the fixed costs ``theta_us`` (by parameter name; absent ones zero) and κ."""
    call = {d: float(theta_us.get(f"call/{d}", 0.0)) for d in DIRECTIONS}
    step = {f"{m}/{d}": float(theta_us.get(f"step/{m}/{d}", 0.0)) for m in modelled_methods() for d in DIRECTIONS}
    return profile.replace(call_us=tuple(sorted(call.items())), step_us=tuple(sorted(step.items())),
                           host_overlap_loss=kappa)


@dataclass(frozen=True)
class FitRow:
    """One benchmark row: what it measured, its device time per pass, how often each pass pays each cost."""

    source: str
    preset: str
    mode: str
    world: int
    method: str
    measured_ms: float
    device_ms: tuple[float, ...]
    """D of each pass the row times: (forward,) or (forward, backward)."""
    counts: tuple[tuple[float, ...], ...]
    """Per pass, times it pays each parameter (``params()`` order)."""
    in_fit: bool

    def predicted_ms(self, theta_us: Sequence[float], kappa: float) -> float:
        total = 0.0
        for d, n in zip(self.device_ms, self.counts):
            call = sum(c * t for c, t in zip(n[:_CALLS], theta_us[:_CALLS])) * 1e-3
            h = sum(c * t for c, t in zip(n[_CALLS:], theta_us[_CALLS:])) * 1e-3
            total += call + max(d, h) + kappa * min(d, h)
        return total


def _passes(rec: dict[str, Any], profile: Profile) -> tuple[float, ...]:
    pr = predict_record(rec, profile)
    return (pr.fwd_ms,) if rec["mode"] == "fwd" else (pr.fwd_ms, pr.fwd_bwd_ms - pr.fwd_ms)


def _row(rec: dict[str, Any], source: str, profile: Profile, names: Sequence[str], in_fit: bool) -> FitRow:
    device = _passes(rec, profile_with(profile, {}, 1.0))
    unit = [_passes(rec, profile_with(profile, {k: _UNIT_US}, 1.0)) for k in names]
    counts = tuple(tuple(round((u[i] - device[i]) / (_UNIT_US * 1e-3), 6) for u in unit) for i in range(len(device)))
    return FitRow(source, str(rec.get("preset", "")), str(rec["mode"]), int(rec["world_size"]), str(rec["method"]),
                  float(rec["time_ms"]), device, counts, in_fit)


def split(paths: Sequence[str | Path], fit_files: Sequence[str | Path], fit_presets: Sequence[str],
          steady: bool = False) -> list[tuple[str, dict[str, Any], bool]]:
    """``(file name, record, in the fit set)`` for every modelled record of ``paths`` (``steady``: back-to-back
    times, ``validate.results``)."""
    return [(Path(path).name, rec, in_fit_set(path, rec, fit_files, fit_presets))
            for path in paths for rec in results(path, steady) if modelled(rec)]


def _tensors(rows: Sequence[FitRow]):
    """``(D (R, 2), counts (R, 2, K), pass mask (R, 2), measured (R,))`` as float64 tensors."""
    import torch

    k = len(rows[0].counts[0])
    D = torch.zeros(len(rows), 2, dtype=torch.float64)
    N = torch.zeros(len(rows), 2, k, dtype=torch.float64)
    mask = torch.zeros(len(rows), 2, dtype=torch.float64)
    for i, r in enumerate(rows):
        for j, (d, c) in enumerate(zip(r.device_ms, r.counts)):
            D[i, j], mask[i, j] = d, 1.0
            N[i, j] = torch.tensor(c, dtype=torch.float64)
    return D, N, mask, torch.tensor([r.measured_ms for r in rows], dtype=torch.float64)


def _fit_theta(rows: Sequence[FitRow], kappa: float, scale: float = 0.02) -> tuple[float, list[float]]:
    """(mean |relative error|, θ in µs) for a fixed κ (Note [Fixed-cost fit])."""
    import torch

    D, N, mask, y = _tensors(rows)

    def predicted(theta: torch.Tensor) -> torch.Tensor:
        call = (N[:, :, :_CALLS] @ theta[:_CALLS]) * 1e-3
        H = (N[:, :, _CALLS:] @ theta[_CALLS:]) * 1e-3
        return ((call + torch.maximum(D, H) + kappa * torch.minimum(D, H)) * mask).sum(1)

    best: tuple[float, list[float]] | None = None
    for start in STARTS:                          # the objective is not convex: a few starts, keep the best
        u = torch.full((N.shape[2],), start, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([u], max_iter=500, line_search_fn="strong_wolfe", tolerance_grad=1e-12,
                                tolerance_change=1e-14)

        def closure(u=u, opt=opt) -> torch.Tensor:
            opt.zero_grad()
            r = predicted(_positive(u)) / y - 1
            loss = (torch.sqrt(1 + (r / scale) ** 2) - 1).mean()   # smooth |r|: pseudo-Huber at 2%
            loss.backward()
            return loss

        opt.step(closure)
        theta = _positive(u).detach()
        err = float((predicted(theta) / y - 1).abs().mean())
        if best is None or err < best[0] - 1e-12:
            best = (err, theta.tolist())
    assert best is not None
    return best


def _positive(u):
    """θ >= 0 in µs from free parameters (softplus, 100 µs per unit)."""
    import torch

    return torch.nn.functional.softplus(u) * 100.0


@dataclass(frozen=True)
class Fit:
    """Fitted fixed costs (µs, by parameter name), κ, and every row with its prediction under them."""

    theta_us: dict[str, float]
    kappa: float
    rows: tuple[FitRow, ...]
    names: tuple[str, ...]

    def predicted_ms(self, row: FitRow) -> float:
        return row.predicted_ms([self.theta_us.get(k, 0.0) for k in self.names], self.kappa)

    def error(self, row: FitRow) -> float:
        return self.predicted_ms(row) / row.measured_ms - 1

    def summary(self, in_fit: bool, tol: float = 0.15) -> str:
        mine = [r for r in self.rows if r.in_fit == in_fit]
        label = "fit" if in_fit else "check"
        if not mine:
            return f"{label}: no rows"
        errs = [abs(self.error(r)) for r in mine]
        return (f"{label}: {sum(e <= tol for e in errs)}/{len(mine)} rows within {tol:.0%}, mean |error| "
                f"{sum(errs) / len(errs):.1%}, worst {max(errs):.1%}")


def fit(records: Sequence[tuple[str, dict[str, Any], bool]], profile: Profile | str = "h200-nvswitch",
        kappas: Sequence[float] = KAPPAS) -> Fit:
    """Fit ``call_us``, ``step_us`` and κ on the records marked for the fit (Note [Fixed-cost fit])."""
    prof = load_profile(profile)
    names = params()
    rows = tuple(_row(rec, src, prof, names, in_fit) for src, rec, in_fit in records)
    train = [r for r in rows if r.in_fit]
    if not train:
        raise ValueError("the fit needs at least one row in the fit set (--fit-file / --fit-presets)")
    used = [i for i in range(len(names)) if any(n[i] for r in train for n in r.counts)]
    best: tuple[float, float, list[float]] | None = None
    for kappa in kappas:
        err, theta = _fit_theta(train, kappa)
        if best is None or err < best[0] - 1e-9:
            best = (err, kappa, theta)
    assert best is not None
    _, kappa, theta = best
    return Fit({names[i]: round(theta[i], 1) for i in used}, kappa, rows, names)


def render(f: Fit, tol: float = 0.15) -> str:
    """Markdown: fitted costs, then every row (fit or check) with its error."""
    out = ["| parameter | fitted |", "|---|---|"]
    out += [f"| {k} | {v:.1f} µs |" for k, v in f.theta_us.items()]
    out += [f"| host_overlap_loss (κ) | {f.kappa:.2f} |", "",
            "| set | file | preset | mode | W | method | measured ms | device ms | fitted ms | error |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(f.rows, key=lambda r: (not r.in_fit, r.source, r.preset, r.method, r.mode)):
        e = f.error(r)
        out.append(f"| {'fit' if r.in_fit else 'check'} | {r.source} | {r.preset} | {r.mode} | {r.world} | "
                   f"{r.method} | {r.measured_ms:.3f} | {sum(r.device_ms):.3f} | {f.predicted_ms(r):.3f} | "
                   f"{e:+.1%}{'' if abs(e) <= tol else ' **over**'} |")
    out += ["", f.summary(True, tol), f.summary(False, tol)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m seqpar.planner.fit", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="benchmark JSON lines files (every row is fitted or checked)")
    ap.add_argument("--fit-file", action="append", default=[], help="a file whose rows all go into the fit")
    ap.add_argument("--fit-presets", default="", help="comma-separated presets whose rows go into the fit")
    ap.add_argument("--profile", default="h200-nvswitch", help="the profile whose measured curves stay fixed")
    ap.add_argument("--steady", action="store_true", help=STEADY_HELP)
    ap.add_argument("--out", default=None, help="write the markdown report here (the command line first)")
    ap.add_argument("--json", default=None, help="write the fitted costs (µs) and κ as JSON here")
    args = ap.parse_args(list(argv) if argv is not None else None)
    presets = [p for p in args.fit_presets.split(",") if p]
    f = fit(split(args.results, args.fit_file, presets, args.steady), args.profile)
    text = render(f)
    print(text)
    if args.out:
        write_report(args.out, "seqpar.planner.fit", argv, text)
    if args.json:
        Path(args.json).write_text(json.dumps({"theta_us": f.theta_us, "kappa": f.kappa}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
