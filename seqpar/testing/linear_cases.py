"""Oracle cases for sequence-parallel linear attention (the linear analogue of ``seqpar.testing.Case``).

    case = LinearCase(method="lasp2", layout="zigzag", gate="dim", seq_len=24)
    (report,) = run_and_check(pool, [case])           # every rank: shard, forward, backward; parent: judge
    assert report.ok, report

The oracle is the token-by-token recurrence (``linear_attention_recurrent``) in fp64 on the whole sequence,
one document at a time, differentiated by autograd: out, the final state and the gradients of q, k, v, the
gates and the initial state. Padding rows carry random values (they must be ignored, not trusted to be
zero). Gradients of replicated inputs (a constant decay ``(H,)``, the initial state) are summed over ranks;
each rank puts a different share of the final-state cotangent into its loss, so their sum is tested.
Tolerances: fp64 1e-10, fp32 1e-5 (normalised max error) or, when larger, 2x a single-device fp32 run
(a constant decay's gradient is one sum over every token, dominated by cancellation: its single-device
fp32 error reaches 5e-5), bf16 2x a single-device bf16 run + 1e-6.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels.linear import linear_attention_chunked, linear_attention_recurrent

FIELDS = ("out", "final", "dq", "dk", "dv", "dg", "dh0")


@dataclass(frozen=True)
class LinearCase:
    """One distributed linear-attention call with seeded global inputs."""

    method: str = "lasp2"
    layout: str = "contiguous"
    gate: str = "none"                  # "none" | "const" (H,) | "scalar" (B, S, H) | "dim" (B, S, H, K)
    causal: bool = True
    batch: int = 1
    seq_len: int = 16                   # global length of the (padded) tensors
    heads: int = 2
    k_dim: int = 4
    v_dim: int = 3
    dtype: str = "float64"
    cu_seqlens: tuple[int, ...] | None = None
    valid_len: int | None = None
    initial_state: bool = False
    final_state: bool = False
    chunk_size: int = 4
    feature_map: str | None = None
    scale: float | None = None
    kernel: str = "auto"
    device: str = "cpu"
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def end(self) -> int:
        return self.valid_len if self.valid_len is not None else (self.cu_seqlens[-1] if self.cu_seqlens
                                                                  else self.seq_len)

    def label(self) -> str:
        parts = [self.method, self.layout, self.gate, "causal" if self.causal else "full", self.dtype,
                 f"S{self.seq_len}", f"B{self.batch}", f"C{self.chunk_size}"]
        if self.cu_seqlens is not None:
            parts.append(f"docs{list(self.cu_seqlens)}")
        if self.valid_len is not None:
            parts.append(f"valid{self.valid_len}")
        parts += [n for n, on in (("h0", self.initial_state), ("final", self.final_state)) if on]
        if self.feature_map:
            parts.append(self.feature_map)
        return " ".join(parts)

    def with_(self, **kw: Any) -> LinearCase:
        return replace(self, **kw)


def make_linear_inputs(case: LinearCase) -> dict[str, torch.Tensor | None]:
    """Global inputs and cotangents (fp32 draws cast to the case dtype; gates in (log 0.3, 0) roughly)."""
    g = torch.Generator().manual_seed(case.seed)
    B, S, H, K, V = case.batch, case.seq_len, case.heads, case.k_dim, case.v_dim
    dt = case.torch_dtype

    def draw(*shape):
        return torch.randn(*shape, generator=g)

    gate_shape = {"none": None, "const": (H,), "scalar": (B, S, H), "dim": (B, S, H, K)}[case.gate]
    return {
        "q": draw(B, S, H, K).to(dt), "k": draw(B, S, H, K).to(dt), "v": draw(B, S, H, V).to(dt),
        "g": None if gate_shape is None else F.logsigmoid(draw(*gate_shape) + 2.0).to(dt),
        "h0": draw(B, H, K, V).to(dt) if case.initial_state else None,
        "do": draw(B, S, H, V).to(dt),
        "dfinal": draw(B, H, K, V).double() if case.final_state else None,
    }


def _docs(case: LinearCase) -> list[tuple[int, int]]:
    bounds = list(case.cu_seqlens) if case.cu_seqlens is not None else [0, case.end]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def oracle(case: LinearCase, dtype: torch.dtype = torch.float64, kernel: str = "recurrent"
           ) -> dict[str, torch.Tensor | None]:
    """Whole-sequence result in ``dtype`` ("recurrent" fp64 truth, or the "chunked" single-device baseline)."""
    inp = make_linear_inputs(case)
    leaves = {n: (None if t is None else t.detach().to(dtype).requires_grad_()) for n, t in inp.items()
              if n in ("q", "k", "v", "g", "h0")}
    q, k, v, g, h0 = (leaves[n] for n in ("q", "k", "v", "g", "h0"))
    o = torch.zeros(*q.shape[:3], v.shape[-1], dtype=dtype)
    final = None
    fn = linear_attention_recurrent if kernel == "recurrent" else linear_attention_chunked
    extra = {} if kernel == "recurrent" else {"chunk_size": case.chunk_size}
    for i, (a, b) in enumerate(_docs(case)):
        gs = None if g is None else (g if g.dim() == 1 else g[:, a:b])
        if case.causal:
            o_d, final = fn(q[:, a:b], k[:, a:b], v[:, a:b], gs, scale=case.scale, feature_map=case.feature_map,
                            initial_state=h0 if i == 0 else None, **extra)
        else:
            from ..kernels.linear import apply_feature_map
            qm = apply_feature_map(q[:, a:b], case.feature_map) * (case.scale or q.shape[-1] ** -0.5)
            km = apply_feature_map(k[:, a:b], case.feature_map)
            o_d = torch.einsum("bnhk,bhkv->bnhv", qm, torch.einsum("bnhk,bnhv->bhkv", km, v[:, a:b]))
        o = torch.cat([o[:, :a], o_d.to(dtype), o[:, b:]], 1)
    loss = (o.double() * inp["do"].double()).sum()
    if case.final_state:
        loss = loss + (final.double() * inp["dfinal"]).sum()
    wrt = [(n, t) for n, t in leaves.items() if t is not None]
    grads = torch.autograd.grad(loss, [t for _, t in wrt], allow_unused=True)
    keep = case.final_state and final is not None
    res: dict[str, torch.Tensor | None] = {"out": o.detach(), "final": final.detach() if keep else None}
    for (n, t), d in zip(wrt, grads):
        res["d" + n] = torch.zeros_like(t) if d is None else d
    return res


def _weight(rank: int, world: int) -> float:
    return (rank + 1) / (world * (world + 1) / 2)


def run_linear_case(case: LinearCase, mesh: Any = None) -> dict[str, Any]:
    """Worker side: shard the global inputs, run forward and backward, return local results (CPU)."""
    import torch.distributed as dist

    import seqpar

    dev = torch.device("cuda", torch.cuda.current_device()) if case.device == "cuda" else torch.device("cpu")
    inp = {n: None if t is None else t.to(dev) for n, t in make_linear_inputs(case).items()}
    where = {"mesh": mesh, "layout": case.layout}
    rank, world = dist.get_rank(mesh), dist.get_world_size(mesh)
    q, k, v = (seqpar.shard(inp[n], **where).requires_grad_() for n in ("q", "k", "v"))
    do = seqpar.shard(inp["do"], **where)
    g = inp["g"]
    if g is not None:
        g = (g.clone() if g.dim() == 1 else seqpar.shard(g, **where)).requires_grad_()
    h0 = None if inp["h0"] is None else inp["h0"].clone().requires_grad_()
    kw = {"decay": g} if case.gate in ("const", "scalar") else ({"gates": g} if case.gate == "dim" else {})
    res = seqpar.linear_attention(q, k, v, mesh=mesh, method=case.method, layout=case.layout, causal=case.causal,
                                  scale=case.scale, feature_map=case.feature_map, initial_state=h0,
                                  output_final_state=case.final_state, cu_seqlens=case.cu_seqlens,
                                  seq_len=case.valid_len, chunk_size=case.chunk_size, kernel=case.kernel, **kw)
    o, final = res if case.final_state else (res, None)
    loss = (o.double() * do.double()).sum()
    if final is not None:
        loss = loss + (final.double() * inp["dfinal"] * _weight(rank, world)).sum()
    loss.backward()
    out = {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
           "dg": None if g is None else g.grad, "dh0": None if h0 is None else h0.grad,
           "final": None if final is None else final.detach()}
    out = {n: None if t is None else t.cpu() for n, t in out.items()}
    out["positions"] = seqpar.positions(case.seq_len, **where).cpu()
    out["dtypes"] = {n: t.dtype for n, t in out.items() if isinstance(t, torch.Tensor)}
    return out


def run_linear_cases(cases: list[LinearCase], mesh: Any = None) -> list[dict[str, Any]]:
    """Many cases in one pool call (fewer round trips)."""
    return [run_linear_case(c, mesh) for c in cases]


@dataclass
class LinearReport:
    case: LinearCase
    errors: dict[str, float] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(self.errors[f] <= self.limits[f] for f in self.errors)

    def __str__(self) -> str:
        lines = [f"{'PASS' if self.ok else 'FAIL'} {self.case.label()}"]
        lines += [f"  {f}: error {e:.2e} limit {self.limits[f]:.2e}" for f, e in self.errors.items()]
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def rel_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    scale = truth.double().abs().max().item() if truth.numel() else 0.0
    err = (got.double() - truth.double()).abs().max().item() if truth.numel() else 0.0
    return err / (scale if scale > 0 else 1.0)


def _gathered(case: LinearCase, results: list[dict[str, Any]]) -> dict[str, torch.Tensor | None]:
    pos = [r["positions"] for r in results]
    got: dict[str, torch.Tensor | None] = {}
    for f in ("out", "dq", "dk", "dv", "dg"):
        parts = [r[f] for r in results]
        if parts[0] is None:
            got[f] = None
        elif f == "dg" and case.gate == "const":
            got[f] = torch.stack(parts).sum(0)          # replicated input: each rank's share
        else:
            full = parts[0].new_zeros(parts[0].shape[0], case.seq_len, *parts[0].shape[2:])
            for p, idx in zip(parts, pos):
                full.index_copy_(1, idx, p)
            got[f] = full
    got["dh0"] = None if results[0]["dh0"] is None else torch.stack([r["dh0"] for r in results]).sum(0)
    got["final"] = results[0]["final"]
    return got


def check_linear_case(case: LinearCase, results: list[dict[str, Any]]) -> LinearReport:
    """Parent side: reassemble, compare with the fp64 recurrence (and a bf16 single-device run for bf16)."""
    rep = LinearReport(case)
    got = _gathered(case, results)
    truth = oracle(case)
    base = oracle(case, case.torch_dtype, "chunked") if case.dtype in ("bfloat16", "float16") else None
    base32 = oracle(case, torch.float32, "chunked") if case.dtype == "float32" else None
    inp = make_linear_inputs(case)
    for f, src in (("out", "q"), ("dq", "q"), ("dk", "k"), ("dv", "v"), ("dg", "g"), ("dh0", "h0")):
        if f in results[0]["dtypes"] and inp[src] is not None and results[0]["dtypes"][f] != inp[src].dtype:
            rep.problems.append(f"{f} has dtype {results[0]['dtypes'][f]}, want {inp[src].dtype}")
    if case.final_state:
        for r, res in enumerate(results):
            if not torch.equal(res["final"], results[0]["final"]):
                rep.problems.append(f"final state differs between rank 0 and rank {r}")
    for f in FIELDS:
        if truth.get(f) is None:
            continue
        if got.get(f) is None:
            rep.problems.append(f"{f} missing")
            continue
        if not torch.isfinite(got[f]).all():
            rep.problems.append(f"{f} has NaN or inf")
        rep.errors[f] = rel_error(got[f], truth[f])
        if base is not None:
            rep.limits[f] = 2.0 * rel_error(base[f], truth[f]) + 1e-6
        else:
            rep.limits[f] = {"float64": 1e-10, "float32": 1e-5}[case.dtype]
            if base32 is not None:          # cancellation-dominated sums (module docstring)
                rep.limits[f] = max(rep.limits[f], 2.0 * rel_error(base32[f], truth[f]) + 1e-6)
    return rep


def run_and_check(pool, cases: list[LinearCase], mesh: Any = None) -> list[LinearReport]:
    """Run ``cases`` on every rank of ``pool`` in one call and judge each."""
    per_rank = pool.run(run_linear_cases, cases, mesh)
    return [check_linear_case(c, [r[i] for r in per_rank]) for i, c in enumerate(cases)]


def assert_reports(reports: list[LinearReport]) -> None:
    bad = [str(r) for r in reports if not r.ok]
    assert not bad, f"{len(bad)} of {len(reports)} cases failed:\n" + "\n".join(bad)
