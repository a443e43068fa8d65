"""Oracle test cases: describe a call, run it on every rank, compare with the dense oracle.

    case = Case(method="ring", layout="zigzag", causal=True, seq_len=64, heads=4, kv_heads=2)
    results = pool.run(run_case, case)          # on every rank: shard, attention, backward
    report = check_case(case, results)          # in the parent: unshard, oracle, tolerances
    assert report.ok, report

Workers return their local out, lse, dq, dk, dv and the global positions of their rows, so the parent
reassembles the global tensors without knowing the method's layout. Tolerances are in ``seqpar.tolerances``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..layouts import BALANCED_LAYOUTS
from ..tolerances import FIELDS, Verdict, judge
from .oracle import dense_attention

__all__ = ["Case", "HashMask", "Report", "check_case", "make_inputs", "make_sinks", "run_case", "run_cases"]


@dataclass(frozen=True)
class HashMask:
    """A seeded pseudo-random ``mask_mod`` (picklable, vmap-friendly): cell (q, k) is visible when a hash of it
    falls under ``keep`` (0..1). ``period`` > 0 repeats it in blocks, so whole blocks come out empty or full."""

    seed: int
    keep: float = 0.5
    period: int = 0

    def __call__(self, b, h, q_idx, kv_idx):
        qb, kb = (q_idx, kv_idx) if self.period <= 0 else (q_idx // self.period, kv_idx // self.period)
        x = (qb * 7919 + kb * 104729 + self.seed * 15485863) % 1000003
        return (x * 2654435761 % 4294967296) < int(self.keep * 4294967296)


@dataclass(frozen=True)
class Case:
    """One distributed attention call with seeded global inputs."""

    method: str = "ring"
    layout: str = "zigzag"
    causal: bool = True
    batch: int = 1
    seq_len: int = 64
    """Global length of the (padded) tensors."""
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "float32"
    window: tuple[int, int] = (-1, -1)
    cu_seqlens: tuple[int, ...] | None = None
    valid_len: int | None = None
    """Valid global length (``seq_len=`` of attention) when the end is padding."""
    kernel: str = "reference"
    options: tuple[tuple[str, Any], ...] = ()
    ulysses: int | None = None
    """Ulysses degree for 2D methods (mesh built with ``make_mesh``)."""
    placement: str = "contiguous"
    scale: float | None = None
    lse_grad: bool = False
    """Backpropagate through lse as well as out."""
    deterministic: bool = False
    device: str = "cpu"
    seed: int = 0
    value_dim: int | None = None
    """V's head dim when it differs from q/k's (MLA)."""
    sinks: bool = False
    """Per-head sink logits ``(H,)`` (gpt-oss), with their gradient checked."""
    softcap: float = 0.0
    mask: Any = None
    """``mask_mod=``: a named mask of ``seqpar.masks`` or a picklable function such as ``HashMask``."""
    balance: str | None = None
    """``balance=`` ("causal": balanced places by causal work whatever the mask; shards made without the mask)."""
    graphs: bool | None = None
    """``graphs=`` (CUDA graphs of the planned call; None: auto)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def label(self) -> str:
        parts = [self.method, self.layout, "causal" if self.causal else "full", f"H{self.heads}/{self.kv_heads}",
                 self.dtype, f"S{self.seq_len}", f"B{self.batch}"]
        if self.window != (-1, -1):
            parts.append(f"win{self.window}")
        if self.cu_seqlens is not None:
            parts.append(f"docs{len(self.cu_seqlens) - 1}")
        if self.valid_len is not None:
            parts.append(f"valid{self.valid_len}")
        if self.ulysses is not None:
            parts.append(f"U{self.ulysses}{self.placement[0]}")
        if self.value_dim is not None:
            parts.append(f"Dv{self.value_dim}")
        if self.sinks:
            parts.append("sinks")
        if self.softcap:
            parts.append(f"softcap{self.softcap}")
        if self.mask is not None:
            parts.append(f"mask{self.mask.spec() if hasattr(self.mask, 'spec') else self.mask}")
        if self.balance is not None:
            parts.append(f"balance={self.balance}")
        parts += [f"{k}={v}" for k, v in self.options]
        return " ".join(parts)

    def with_(self, **kw: Any) -> Case:
        return replace(self, **kw)


def make_inputs(case: Case) -> tuple[torch.Tensor, ...]:
    """Global ``q, k, v, do, dlse`` (fp32 draws cast to the case dtype), identical on every rank."""
    g = torch.Generator().manual_seed(case.seed)
    B, S, H, Hkv, D = case.batch, case.seq_len, case.heads, case.kv_heads, case.head_dim
    Dv = D if case.value_dim is None else case.value_dim
    draw = [torch.randn(B, S, h, d, generator=g) for h, d in ((H, D), (Hkv, D), (Hkv, Dv), (H, Dv))]
    dlse = torch.randn(B, H, S, generator=g)
    return (*[t.to(case.torch_dtype) for t in draw], dlse)


def make_sinks(case: Case) -> torch.Tensor | None:
    """The case's global sink logits ``(H,)`` in its dtype, or None."""
    if not case.sinks:
        return None
    return torch.randn(case.heads, generator=torch.Generator().manual_seed(case.seed + 1)).to(case.torch_dtype)


_MESHES: dict[tuple[int, str], Any] = {}


def _mesh(case: Case):
    if case.ulysses is None:
        return None
    import seqpar

    key = (case.ulysses, case.placement)
    if key not in _MESHES:                        # mesh creation is collective: cache per worker
        _MESHES[key] = seqpar.make_mesh(ulysses=case.ulysses, placement=case.placement,
                                        device_type="cuda" if case.device == "cuda" else "cpu")
    return _MESHES[key]


def run_case(case: Case) -> dict[str, Any]:
    """Worker side: shard the global inputs, run forward and backward, return local results (CPU)."""
    import seqpar

    dev = torch.device(case.device if case.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    mesh = _mesh(case)
    q, k, v, do, dlse = (t.to(dev) for t in make_inputs(case))
    sinks = make_sinks(case)
    if sinks is not None:
        sinks = sinks.to(dev).requires_grad_()
    where = {"mesh": mesh, "method": case.method, "layout": case.layout}
    docs = {"cu_seqlens": case.cu_seqlens}         # document layouts place tokens from them (others ignore them)
    if case.mask is not None and case.layout in BALANCED_LAYOUTS and case.balance is None:   # by the mask's work
        docs.update(causal=case.causal, mask_mod=case.mask)
    ql, kl, vl = (seqpar.shard(t, **where, **docs).requires_grad_() for t in (q, k, v))
    dol = seqpar.shard(do, **where, **docs)
    dlsel = seqpar.shard(dlse, dim=2, **where, **docs)
    given = {name: t.detach().clone() for name, t in (("q", ql), ("k", kl), ("v", vl), ("dO", dol))}
    t0 = time.perf_counter()
    res = seqpar.attention(ql, kl, vl, causal=case.causal, window_size=case.window, cu_seqlens=case.cu_seqlens,
                           seq_len=case.valid_len, kernel=case.kernel, softmax_scale=case.scale, return_lse=True,
                           deterministic=case.deterministic, sinks=sinks, softcap=case.softcap, **where,
                           mask_mod=case.mask, balance=case.balance, graphs=case.graphs, **dict(case.options))
    t1 = time.perf_counter()
    loss = (res.out.float() * dol.float()).sum()
    if case.lse_grad:
        loss = loss + (torch.where(torch.isfinite(res.lse), res.lse, 0.0) * dlsel).sum()
    loss.backward()
    t2 = time.perf_counter()
    for name, t in (("q", ql), ("k", kl), ("v", vl), ("dO", dol)):   # a method sends, never receives into, them
        if not torch.equal(t.detach(), given[name]):
            raise AssertionError(f"method={case.method!r} wrote into the caller's {name}")
    out = {"out": res.out, "lse": res.lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    local = {k_: t.detach().cpu() for k_, t in out.items()}
    local["positions"] = seqpar.positions(case.seq_len, **where, **docs).cpu()
    local["times"] = (t1 - t0, t2 - t1)
    if sinks is not None:                          # this rank's rows' share; the sum over ranks is the gradient
        local["dsinks"] = sinks.grad.detach().cpu()
    return local



def case_error(case: Case) -> tuple[str, str]:
    """Worker side: run ``case`` expecting a validation error; its ``(type name, message)``, or ``("", "")``."""
    try:
        run_case(case)
    except (ValueError, TypeError, NotImplementedError) as e:
        return type(e).__name__, str(e)
    return "", ""

def _unshard(parts: list[torch.Tensor], positions: list[torch.Tensor], seq_len: int, dim: int) -> torch.Tensor:
    shape = list(parts[0].shape)
    shape[dim] = seq_len
    full = parts[0].new_zeros(shape)
    for p, pos in zip(parts, positions):
        full.index_copy_(dim, pos, p)
    return full


@dataclass
class Report:
    """Errors of one case against the oracle, per field, and the verdict."""

    case: Case
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    times: tuple[float, float] = (0.0, 0.0)

    @property
    def ok(self) -> bool:
        return not self.problems and all(v.ok for v in self.verdicts.values())

    def max_error(self, fields: tuple[str, ...]) -> float:
        return max((self.verdicts[f].error for f in fields if f in self.verdicts), default=0.0)

    def __str__(self) -> str:
        lines = [f"{'PASS' if self.ok else 'FAIL'} {self.case.label()}"]
        lines += [f"  {name}: {v}" for name, v in self.verdicts.items()]
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def check_case(case: Case, results: list[dict[str, Any]]) -> Report:
    """Parent side: reassemble the global results and judge them against the dense oracle."""
    report = Report(case, times=max(r["times"] for r in results))
    pos = [r["positions"] for r in results]
    q, k, v, do, dlse = make_inputs(case)
    sinks = make_sinks(case)
    got = {f: _unshard([r[f] for r in results], pos, case.seq_len, 2 if f == "lse" else 1) for f in FIELDS}
    want_dtype = {"out": q.dtype, "dq": q.dtype, "dk": k.dtype, "dv": v.dtype}
    for f, dt in want_dtype.items():
        if got[f].dtype != dt:
            report.problems.append(f"{f} has dtype {got[f].dtype}, want the input dtype {dt}")
    lse_dt = torch.float64 if case.dtype == "float64" else torch.float32
    if got["lse"].dtype != lse_dt:
        report.problems.append(f"lse has dtype {got['lse'].dtype}, want {lse_dt}")
    truth, base = _oracle(case, q, k, v, do, dlse, sinks)
    for f in FIELDS:
        report.verdicts[f] = judge(f, got[f], truth[f], None if base is None else base[f], case.dtype)
    if sinks is not None:
        if sinks.dtype != results[0]["dsinks"].dtype:
            report.problems.append(f"dsinks has dtype {results[0]['dsinks'].dtype}, want {sinks.dtype}")
        v = judge("dsinks", sum(r["dsinks"].double() for r in results), truth["dsinks"],
                  None if base is None else base["dsinks"], case.dtype,
                  scale=truth["dsinks_terms"].abs().max().item())      # a sum: its terms' scale (tolerances)
        if base is not None:      # each rank's share comes back rounded to the sinks' dtype (autograd's rule for a
            v = Verdict(v.error, v.limit + len(results) * torch.finfo(sinks.dtype).eps / 2, v.baseline, v.note)
        report.verdicts["dsinks"] = v          # replicated parameter): W roundings where one device has one
    return report


_ORACLES: dict[Case, tuple[dict, dict | None]] = {}
"""The last ``_oracle`` results, by the case with every field that does not change the global computation reset: a
test that judges several methods, transports or graphed calls of one case computes its dense fp64 answer once."""


def _oracle(case: Case, q, k, v, do, dlse, sinks) -> tuple[dict, dict | None]:
    """The dense fp64 answer of ``case`` and, in bf16/fp16, the single device's in the case dtype (the baseline)."""
    key = replace(case, method="", layout="", kernel="", options=(), ulysses=None, placement="", deterministic=False,
                  device="", balance=None, graphs=None)
    try:
        hash(key)
    except TypeError:                            # a mask_mod that cannot be hashed: computed every time
        key = None
    if key is not None and key in _ORACLES:
        return _ORACLES[key]
    kw = {"causal": case.causal, "window": case.window, "cu_seqlens": case.cu_seqlens,
          "valid_len": case.valid_len, "scale": case.scale, "softcap": case.softcap, "sinks": sinks,
          "mask_mod": case.mask}
    truth = dense_attention(q, k, v, do, dtype=torch.float64, dlse=dlse if case.lse_grad else None, **kw)
    base = None
    if case.dtype in ("bfloat16", "float16"):
        base = dense_attention(q, k, v, do, dtype=case.torch_dtype, upcast_softmax=False, **kw)
    if key is not None:
        _ORACLES.clear()                         # one case kept: the oracles of large cases are large
        _ORACLES[key] = (truth, base)
    return truth, base


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Worker side: ``run_case`` of each case in turn (one pool call for many cases)."""
    return [run_case(c) for c in cases]
