"""Worker functions for the Ulysses / USP / module tests (run on every rank by ``ProcessPool``).

Module-level so spawned workers can import them by name. Each returns plain data; the tests assert.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import seqpar
from seqpar.testing import Case, make_inputs, run_case
from seqpar.testing import cases as _cases

_MESHES: dict[tuple, Any] = {}


def _cached_mesh(key: tuple, build):
    if key not in _MESHES:                  # mesh creation is collective: every rank builds the same ones
        _MESHES[key] = build()
    return _MESHES[key]


# --- bad input: the error every rank raises -----------------------------------------------------------------

def call_error(spec: dict[str, Any]) -> tuple[str, str] | None:
    """Make the call ``spec`` describes; return ``(type name, message)`` of what it raised, or None."""
    spec = dict(spec)
    kind = spec.pop("kind", "attention")
    try:
        if kind == "make_mesh":
            seqpar.make_mesh(**spec)
            return None
        mesh = _mesh_for(spec.pop("mesh", None))
        if kind == "module":
            attn = seqpar.SequenceParallelAttention(mesh, **spec.pop("ctor"))
            q, k, v = _tensors(spec.pop("shape"))
            attn(q, k, v, **spec)
            return None
        q, k, v = _tensors(spec.pop("shape"))
        seqpar.attention(q, k, v, mesh=mesh, **spec)
    except Exception as e:  # the point: report whatever was raised
        return type(e).__name__, str(e)
    return None


def _mesh_for(desc):
    if desc is None:
        return None
    if desc == "1d":
        return _cached_mesh(("1d",), lambda: torch.distributed.device_mesh.init_device_mesh(
            "cpu", (dist.get_world_size(),), mesh_dim_names=("sp",)))
    ulysses, placement = desc
    return _cached_mesh(("2d", ulysses, placement),
                        lambda: seqpar.make_mesh(ulysses=ulysses, placement=placement, device_type="cpu"))


def _tensors(shape: tuple[int, int, int, int, int]):
    B, L, H, Hkv, D = shape
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, L, H, D, generator=g), torch.randn(B, L, Hkv, D, generator=g),
            torch.randn(B, L, Hkv, D, generator=g))


# --- groups -------------------------------------------------------------------------------------------------

def mesh_facts(ulysses: int, placement: str) -> dict[str, Any]:
    """The ranks of this rank's Ulysses and ring groups and its SP index, from ``make_mesh``."""
    from seqpar.groups import SeqParallelGroups

    mesh = _mesh_for((ulysses, placement))
    g = SeqParallelGroups.resolve(mesh, 2)
    return {"ulysses": dist.get_process_group_ranks(g.ulysses), "ring": dist.get_process_group_ranks(g.ring),
            "index": g.index, "world": g.world}


# --- oracle cases with a different mesh, or with code paths forbidden --------------------------------------

def run_case_on_submesh(case: Case) -> tuple[int, dict[str, Any]]:
    """``run_case`` on the "sp" axis of a (dp=2, sp=W/2) mesh; each dp replica draws its own inputs."""
    W = dist.get_world_size()
    mesh = _cached_mesh(("dp", W), lambda: torch.distributed.device_mesh.init_device_mesh(
        "cpu", (2, W // 2), mesh_dim_names=("dp", "sp")))
    dp, sp = mesh.get_local_rank("dp"), mesh["sp"]
    with mock.patch.object(_cases, "_mesh", lambda c: sp):
        return dp, run_case(case.with_(seed=case.seed + dp))


def _forbidden(*_: Any, **__: Any):
    raise AssertionError("this code path must not run")


def run_case_without_ring_engine(case: Case) -> dict[str, Any]:
    """``run_case`` with the pass-KV ring engine and ``Ring`` made to fail (USP with ring degree 1)."""
    from seqpar.methods import _passkv, usp

    with mock.patch.object(_passkv.PassKV, "forward", _forbidden), \
            mock.patch.object(_passkv.PassKV, "backward", _forbidden), mock.patch.object(usp, "Ring", _forbidden):
        return run_case(case)


def run_case_without_all_to_all(case: Case) -> dict[str, Any]:
    """``run_case`` with ``all_to_all_single`` made to fail (USP with Ulysses degree 1)."""
    with mock.patch.object(dist, "all_to_all_single", _forbidden):
        return run_case(case)


# --- all-to-all primitives ----------------------------------------------------------------------------------

def a2a_check(spec: tuple[int, int, int, int, int, str]) -> dict[str, float]:
    """Errors of the packed and single-tensor all-to-alls over the whole group against explicit slicing,
    and of their backward against the adjoint identity ``sum_r <A x, y> = sum_r <x, A^T y>``."""
    from seqpar.comm import all_to_all as a2a

    B, L, H, Hkv, D, dtype = spec
    dt = getattr(torch, dtype)
    U, r = dist.get_world_size(), dist.get_rank()
    S, hq, G = U * L, H // U, H // Hkv
    g = torch.Generator().manual_seed(1)
    qg, kg, vg = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64).to(dt) for h in (H, Hkv, Hkv))
    rows = slice(r * L, (r + 1) * L)
    q, k, v = (t[:, rows].to(dt).requires_grad_() for t in (qg, kg, vg))
    q_h, k_h, v_h = a2a.qkv_seq_to_heads(q, k, v)
    kv_slot = sorted({h // G for h in range(r * hq, (r + 1) * hq)})     # exactly the KV heads my q heads use
    err = {"q_h": _maxdiff(q_h, qg[:, :, r * hq:(r + 1) * hq]), "k_h": _maxdiff(k_h, kg[:, :, kv_slot]),
           "v_h": _maxdiff(v_h, vg[:, :, kv_slot])}
    ys = [torch.randn(t.shape, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64).to(dt)
          for t in (q_h, k_h, v_h)]
    sum((t * y).sum() for t, y in zip((q_h, k_h, v_h), ys)).backward()
    err["grad_dtype"] = float(any(t.grad.dtype != dt for t in (q, k, v)))
    err["adjoint_qkv"] = _adjoint_gap([(t, y) for t, y in zip((q_h, k_h, v_h), ys)],
                                      [(t, t.grad) for t in (q, k, v)])
    lse = qg.sum(-1).transpose(1, 2)[:, :, rows].contiguous().requires_grad_()    # (B, H, L)
    lse_h = a2a.seq_to_heads(lse, seq_dim=2, head_dim=1)
    err["lse_h"] = _maxdiff(lse_h, qg.sum(-1).transpose(1, 2)[:, r * hq:(r + 1) * hq])
    back = a2a.heads_to_seq(lse_h, seq_dim=2, head_dim=1)
    err["lse_roundtrip"] = _maxdiff(back, lse)
    y = torch.randn(lse_h.shape, generator=torch.Generator().manual_seed(20 + r), dtype=torch.float64).to(dt)
    (lse_h * y).sum().backward()
    err["adjoint_lse"] = _adjoint_gap([(lse_h, y)], [(lse, lse.grad)])
    return err


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _adjoint_gap(ay: list, xg: list) -> float:
    """|sum_r <A x, y> - sum_r <x, A^T y>| relative to sum_r <|A x|, |y|> (all-reduced over the group)."""
    d = torch.tensor([sum((a.detach().double() * y.double()).sum() for a, y in ay).item(),
                      sum((x.detach().double() * gx.double()).sum() for x, gx in xg).item(),
                      sum((a.detach().double() * y.double()).abs().sum() for a, y in ay).item()],
                     dtype=torch.float64)
    dist.all_reduce(d)
    return abs(d[0].item() - d[1].item()) / max(d[2].item(), 1e-30)


# --- nn.Module wrappers -------------------------------------------------------------------------------------

def run_module_case(case: Case, kind: str) -> dict[str, Any]:
    """Like ``run_case`` but through ``SequenceParallelAttention`` (``kind``: "plain", "qkv" or "kv")."""
    cls = {"plain": seqpar.SequenceParallelAttention, "qkv": seqpar.SequenceParallelAttentionQKVPacked,
           "kv": seqpar.SequenceParallelAttentionKVPacked}[kind]
    attn = cls(_cases._mesh(case), method=case.method, layout=case.layout, causal=case.causal, kernel=case.kernel,
               softmax_scale=case.scale, window_size=case.window, **dict(case.options))
    q, k, v, do, dlse = make_inputs(case)
    per_call = {"cu_seqlens": case.cu_seqlens, "seq_len": case.valid_len, "return_lse": True}
    if kind == "qkv":
        qkv = attn.shard(torch.stack((q, k, v), dim=2)).requires_grad_()
        res = attn(qkv, **per_call)
    elif kind == "kv":
        ql, kv = attn.shard(q).requires_grad_(), attn.shard(torch.stack((k, v), dim=2)).requires_grad_()
        res = attn(ql, kv, **per_call)
    else:
        ql, kl, vl = (attn.shard(t).requires_grad_() for t in (q, k, v))
        res = attn(ql, kl, vl, **per_call)
    loss = (res.out.float() * attn.shard(do).float()).sum()
    if case.lse_grad:
        loss = loss + (torch.where(torch.isfinite(res.lse), res.lse, 0.0) * attn.shard(dlse, dim=2)).sum()
    loss.backward()
    if kind == "qkv":
        dq, dk, dv = qkv.grad.unbind(2)
    elif kind == "kv":
        dq, (dk, dv) = ql.grad, kv.grad.unbind(2)
    else:
        dq, dk, dv = ql.grad, kl.grad, vl.grad
    out = {"out": res.out, "lse": res.lse, "dq": dq, "dk": dk, "dv": dv}
    local = {k_: t.detach().cpu() for k_, t in out.items()}
    local["positions"] = attn.positions(case.seq_len)
    local["times"] = (0.0, 0.0)
    local["repr"] = repr(attn)
    return local


def _rope(x_BSHD: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    D = x_BSHD.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=x_BSHD.dtype) / D))
    ang = pos.to(x_BSHD.dtype)[:, None] * inv[None, :]                      # (S, D/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = x_BSHD[..., 0::2], x_BSHD[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class TinyBlock(torch.nn.Module):
    """qkv projection -> RoPE at the given positions -> attention -> output projection."""

    def __init__(self, attn: torch.nn.Module, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim, dtype=torch.float64)
        self.proj = torch.nn.Linear(heads * head_dim, dim, dtype=torch.float64)
        self.attn = attn

    def forward(self, x_BSE: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSE.shape
        qkv = self.qkv(x_BSE).view(B, S, 3, self.heads, self.head_dim)
        q, k = _rope(qkv[:, :, 0], pos), _rope(qkv[:, :, 1], pos)
        out = self.attn(torch.stack((q, k, qkv[:, :, 2]), dim=2))
        return self.proj(out.flatten(2))


class _DenseCausal(torch.nn.Module):
    """Plain causal softmax attention on the whole sequence (autograd end to end)."""

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.unbind(2)
        S, D = q.shape[1], q.shape[-1]
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def tiny_model_check(spec: tuple[str, str, int | None, str]) -> dict[str, float]:
    """A TinyBlock run sequence-parallel (module placement, RoPE at ``attn.positions``) against the same
    block on the whole sequence: output rows and all-reduced parameter gradients (fp64)."""
    method, layout, ulysses, placement = spec
    S, E, H, D = 16, 12, 4, 8
    mesh = None if ulysses is None else _mesh_for((ulysses, placement))
    attn = seqpar.SequenceParallelAttentionQKVPacked(mesh, method=method, layout=layout, causal=True)
    torch.manual_seed(0)
    sp, dense = TinyBlock(attn, E, H, D), TinyBlock(_DenseCausal(), E, H, D)
    dense.load_state_dict(sp.state_dict())
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(2, S, E, generator=g, dtype=torch.float64), torch.randn(2, S, E, generator=g,
                                                                                   dtype=torch.float64)
    pos = attn.positions(S)
    y = sp(attn.shard(x), pos)
    (y * attn.shard(dy)).sum().backward()
    y_ref = dense(x, torch.arange(S))
    (y_ref * dy).sum().backward()
    err = {"out": _maxdiff(y, y_ref[:, pos]) / y_ref.abs().max().item()}
    for (name, p), p_ref in zip(sp.named_parameters(), dense.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)                          # data-parallel style sum over the SP ranks
        err[name] = _maxdiff(grad, p_ref.grad) / p_ref.grad.abs().max().item()
    return err


def run_case_short_paths(short: bool, case: Case) -> dict[str, Any]:
    """``run_case`` with every short-chunk path forced on or off (``run_calls``, one call)."""
    return run_calls(short, case, 1)[0]


def run_calls(short: bool, case: Case, calls: int) -> list[dict[str, Any]]:
    """``calls`` calls of ``case`` on one planned call (a plan's first call runs eagerly; with ``graphs=True`` its
    second is captured and its third replays), every short-chunk path forced on or off: the pass-KV backward's
    partials home (``HOME_BYTES``, Note [Partials home] in ``seqpar.methods._passkv``; off: running sums) and TASP's
    gathered passes (``GATHER_MAX_ROWS``). Planned calls are dropped first: an engine decides what it can when it is
    planned."""
    from seqpar.runtime import call as _call

    _call.cache_clear()
    with mock.patch("seqpar.methods._passkv.HOME_BYTES", 1 << 62 if short else 0), \
            mock.patch("seqpar.methods._tasp.GATHER_MAX_ROWS", 1 << 30 if short else 0):
        return [run_case(case) for _ in range(calls)]
