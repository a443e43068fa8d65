"""Worker functions for the reliability tests (run on every rank by ``ProcessPool``).

Module-level so spawned workers import them by name. Each returns plain data; the tests assert.
Fault injection lives here, never in the library: a test kernel ``"faulty"`` (softmax) / ``"faulty"``
linear kernel is registered in the worker process only, wrapping the reference kernel and raising on one
rank at its s-th call.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import seqpar
from seqpar.testing import Case, make_inputs, run_case

_MESHES: dict[tuple, Any] = {}


def _mesh(ulysses: int | None):
    if ulysses is None:
        return None
    if ulysses not in _MESHES:              # mesh creation is collective: every rank builds the same ones
        _MESHES[ulysses] = seqpar.make_mesh(ulysses=ulysses, device_type="cpu")
    return _MESHES[ulysses]


# --- agreement: calls that differ across ranks ----------------------------------------------------------------

def _tensors(shapes: dict[str, Any], dtypes: dict[str, str], grad: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in shapes.items():
        if shape is None:
            out[name] = None
            continue
        t = torch.randn(*shape, generator=g).to(getattr(torch, dtypes.get(name, "float32")))
        out[name] = t.requires_grad_(grad and t.is_floating_point())
    return out


def call_spec(spec: dict[str, Any]) -> tuple[str, str] | None:
    """Make the call ``spec`` describes (``per_rank`` overrides on some ranks); ``(type, message)`` or None.

    spec keys: kind ("attention" | "linear_attention" | "verify"), shapes, dtypes, kwargs, grad (bool),
    ulysses (2D mesh degree), per_rank {rank: {shapes/dtypes/kwargs/grad overrides}}.
    """
    rank = dist.get_rank()
    over = spec.get("per_rank", {}).get(rank, {})
    shapes = {**spec.get("shapes", {}), **over.get("shapes", {})}
    dtypes = {**spec.get("dtypes", {}), **over.get("dtypes", {})}
    kwargs = {**spec.get("kwargs", {}), **over.get("kwargs", {})}
    grad = over.get("grad", spec.get("grad", True))
    kwargs.setdefault("mesh", _mesh(spec.get("ulysses")))
    t = _tensors(shapes, dtypes, grad)
    kind = spec.get("kind", "attention")
    try:
        if kind == "verify":
            q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
            seqpar.verify(q, k, v, t.pop("out", None), **kwargs)
        else:
            res = getattr(seqpar, kind)(t.pop("q"), t.pop("k"), t.pop("v"), **{**t, **kwargs})
            res = res[0] if isinstance(res, tuple) else res
            if res.requires_grad:
                res.float().sum().backward()
    except Exception as e:   # the test inspects the type and message of whatever was raised
        return type(e).__name__, str(e)
    return None


def call_specs(specs: list[dict[str, Any]]) -> list[tuple[str, str] | None]:
    """Many specs in one pool call (each rank's outcomes, in order)."""
    return [call_spec(s) for s in specs]


def count_collectives(spec: dict[str, Any], calls: int) -> dict[str, int]:
    """Run the spec ``calls`` times counting the agreement collectives (all_reduce / all_gather_object)."""
    counts = {"all_reduce": 0, "all_gather_object": 0}

    def counted(name):
        real = getattr(dist, name)

        def wrapper(*a, **kw):
            counts[name] += 1
            return real(*a, **kw)
        return wrapper

    with mock.patch.object(dist, "all_reduce", counted("all_reduce")), \
            mock.patch.object(dist, "all_gather_object", counted("all_gather_object")):
        for _ in range(calls):
            assert call_spec(spec) is None
    return counts


def round_cost(calls: int, warmup: int = 20) -> float:
    """Microseconds per agreement round on the default group (a repeated, agreeing signature)."""
    from seqpar import agreement

    items = (("q shape", (1, 1024, 8, 64)), ("method", "ring"), ("cu_seqlens", tuple(range(0, 4097, 64))))
    for _ in range(warmup):
        agreement.check(items, None)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        agreement.check(items, None)
    return (time.perf_counter() - t0) / calls * 1e6


# --- fault injection --------------------------------------------------------------------------------------------

class Injected(RuntimeError):
    """The fault a test injects."""


def _faulty_softmax_kernel(bad_rank: int, at_call: int, phase: str):
    from seqpar.kernels.base import KERNELS, Kernel

    ref = KERNELS["reference"]

    class Faulty(Kernel):
        name = "faulty"

        def __init__(self):
            self.calls = 0

        def not_supported_reasons(self, call):
            return ref.not_supported_reasons(call)

        def _tick(self, now: str) -> None:
            if now == phase:
                self.calls += 1
                if dist.get_rank() == bad_rank and self.calls == at_call:
                    raise Injected(f"injected {phase} fault on rank {bad_rank} at kernel call {at_call}")

        def forward(self, *a, **kw):
            self._tick("forward")
            return ref.forward(*a, **kw)

        def backward(self, *a, **kw):
            self._tick("backward")
            return ref.backward(*a, **kw)

    return Faulty()


def _faulty_linear_kernel(bad_rank: int, at_call: int, phase: str):
    from seqpar.kernels.linear import LINEAR_KERNELS, LinearKernel

    ref = LINEAR_KERNELS["chunked"]

    class FaultyLinear(LinearKernel):
        name = "faulty"

        def __init__(self):
            self.calls = 0

        def not_supported_reasons(self, call):
            return []

        def run(self, q, k, v, g, h0, chunk_size):
            # forward runs at zero grad mode; backward recomputes under autograd (enable_grad)
            now = "backward" if torch.is_grad_enabled() and q.requires_grad else "forward"
            if now == phase:
                self.calls += 1
                if dist.get_rank() == bad_rank and self.calls == at_call:
                    raise Injected(f"injected {phase} fault on rank {bad_rank} at kernel call {at_call}")
            return ref.run(q, k, v, g, h0, chunk_size)

    return FaultyLinear()


def _fresh_group(spec: dict[str, Any], timeout: float):
    """A new group (or 2D mesh) with a short timeout: a fault poisons only it, never the pool's default group."""
    short = timedelta(seconds=timeout)
    if spec.get("ulysses") is None:
        return dist.new_group(list(range(dist.get_world_size())), timeout=short)
    # make_mesh creates one group per mesh row / column with the default timeout: make that the short one
    with mock.patch.object(dist.distributed_c10d, "_get_default_timeout", lambda *a, **kw: short):
        return seqpar.make_mesh(ulysses=spec["ulysses"], device_type="cpu")


def _clear_selection() -> None:
    """Kernel selection is cached by name: forget the test kernel before and after each case."""
    from seqpar.kernels.base import select
    from seqpar.kernels.linear import select_linear

    select.cache_clear()
    select_linear.cache_clear()


def fault_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one call (forward and backward) with a fault injected on one rank; report what each rank saw.

    spec: method, kind ("softmax" | "linear"), layout, ulysses (2D degree or None), options, bad_rank (-1: no
    fault, a dry run counting kernel calls), at_call, phase ("forward" | "backward"), timeout (seconds, of
    the fresh group the call runs on), abort (every rank that raises aborts the group: the fail-fast recipe,
    which cascades - a peer of an aborted rank sees the closed connection, raises and aborts in turn).
    Every rank returns ``{"error": "Type: message" | None, "elapsed": seconds from the call to its end,
    "calls": kernel calls counted in ``phase``}``.
    """
    group = _fresh_group(spec, spec["timeout"])
    rank, W = dist.get_rank(), dist.get_world_size()
    softmax = spec["kind"] == "softmax"
    if softmax:
        from seqpar.kernels import base
        kern = _faulty_softmax_kernel(spec["bad_rank"], spec["at_call"], spec["phase"])
        registry = mock.patch.dict(base.KERNELS, {"faulty": kern})
    else:
        from seqpar.kernels import linear
        kern = _faulty_linear_kernel(spec["bad_rank"], spec["at_call"], spec["phase"])
        registry = mock.patch.dict(linear.LINEAR_KERNELS, {"faulty": kern})
    g = torch.Generator().manual_seed(1)
    L = spec.get("seq_len", 16) // W
    heads = (4, 2, 2, 8) if softmax else (2, 2, 2, 4)          # q heads, kv heads, ..., head dim
    q = torch.randn(1, L, heads[0], heads[3], generator=g).requires_grad_()
    k, v = (torch.randn(1, L, heads[1], heads[3], generator=g).requires_grad_() for _ in range(2))
    t0 = time.monotonic()
    error = None
    with registry:
        _clear_selection()
        try:
            if softmax:
                out = seqpar.attention(q, k, v, mesh=group, method=spec["method"], layout=spec["layout"],
                                       kernel="faulty", causal=True, **dict(spec.get("options", ())))
            else:
                out = seqpar.linear_attention(q, k, v, mesh=group, method=spec["method"], layout=spec["layout"],
                                              kernel="faulty")
            out.float().sum().backward()
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:300]}"
            if spec.get("abort"):     # the fail-fast recipe of the docs: any rank that fails aborts the group
                for pg in ([group] if isinstance(group, dist.ProcessGroup) else
                           [group.get_group(d) for d in range(group.ndim)]):
                    dist.distributed_c10d._abort_process_group(pg)
        _clear_selection()
    return {"rank": rank, "error": error, "elapsed": time.monotonic() - t0, "calls": kern.calls}


# --- determinism ------------------------------------------------------------------------------------------------

def run_cases_raw(cases: list[Case]) -> list[dict[str, Any]]:
    """``run_case`` for each case, results as they come back (the tests compare them bitwise)."""
    out = []
    for c in cases:
        r = run_case(c)
        r.pop("times")
        out.append(r)
    return out


# --- verify mode ------------------------------------------------------------------------------------------------

def verify_worker(case: Case, corrupt: dict[str, Any] | None = None, verify_kw: dict[str, Any] | None = None,
                  call_kw: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``case`` with ``verify=True``, then ``seqpar.verify`` on its (optionally corrupted) result.

    corrupt: {"field": "out" | "lse", "rank": r, "scale": s} adds ``s`` to every element of that rank's field.
    verify_kw: extra ``seqpar.verify`` arguments (heads, rows, tolerance, or a different causal to fake a bug).
    Returns each step's outcome: None or ``(type, message)``, and the report's worst ratio when it passed.
    """
    from seqpar.testing.cases import _mesh as case_mesh

    mesh = case_mesh(case)
    q, k, v, _, _ = make_inputs(case)
    where = {"mesh": mesh, "method": case.method, "layout": case.layout}
    ql, kl, vl = (seqpar.shard(t, **where) for t in (q, k, v))
    call = {"causal": case.causal, "window_size": case.window, "cu_seqlens": case.cu_seqlens,
            "seq_len": case.valid_len, "softmax_scale": case.scale, **dict(case.options)}
    out: dict[str, Any] = {}
    try:
        res = seqpar.attention(ql, kl, vl, kernel=case.kernel, return_lse=True, verify=True, **where, **call,
                               **(call_kw or {}))
        out["attention"] = None
    except Exception as e:
        out["attention"] = (type(e).__name__, str(e))
        return out
    o, lse = res.out.clone(), res.lse.clone()
    if corrupt and corrupt.get("rank", dist.get_rank()) == dist.get_rank():
        t = o if corrupt["field"] == "out" else lse
        t.add_(corrupt["scale"])
    try:
        report = seqpar.verify(ql, kl, vl, o, lse, **where, **{**call, **(verify_kw or {})})
        out["verify"] = None
        out["worst"] = report.worst
        out["heads"] = report.heads
        out["rows"] = report.rows
    except Exception as e:
        out["verify"] = (type(e).__name__, str(e))
    return out


def run_linear_raw(cases: list[Any], deterministic: bool = True) -> list[dict[str, Any]]:
    """Linear cases (``linear_cases.LinearCase``) with ``deterministic``: local out and gradients, unjudged."""
    from linear_cases import make_linear_inputs

    res = []
    for case in cases:
        inp = make_linear_inputs(case)
        where = {"layout": case.layout}
        q, k, v = (seqpar.shard(inp[n], **where).requires_grad_() for n in ("q", "k", "v"))
        g = inp["g"]
        if g is not None:
            g = (g.clone() if g.dim() == 1 else seqpar.shard(g, **where)).requires_grad_()
        kw = {"decay": g} if case.gate in ("const", "scalar") else ({"gates": g} if case.gate == "dim" else {})
        o = seqpar.linear_attention(q, k, v, method=case.method, layout=case.layout, causal=case.causal,
                                    cu_seqlens=case.cu_seqlens, seq_len=case.valid_len, chunk_size=case.chunk_size,
                                    deterministic=deterministic, **kw)
        (o.double() * seqpar.shard(inp["do"], **where).double()).sum().backward()
        res.append({"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                    "dg": None if g is None else g.grad})
    return res


# --- numerical drift --------------------------------------------------------------------------------------------

def run_cases_list(cases: list[Case], lossy_merge: bool = False) -> list[dict[str, Any]]:
    """``run_case`` for each case. ``lossy_merge`` simulates the peers' drift defect (ring-flash-attn #42):
    the running output is rounded to bf16 after every merge, so error grows with the number of blocks."""
    if not lossy_merge:
        return [run_case(c) for c in cases]
    from seqpar.kernels import merge

    real, real_init = merge.merge_, merge.Accumulator.__init__

    def lossy(acc_out, acc_lse, out, lse):
        real(acc_out, acc_lse, out, lse)
        acc_out.copy_(acc_out.to(torch.bfloat16))

    def step_by_step(self, *args, defer=False, **kwargs):     # the merge after every block, as the peers do
        real_init(self, *args, defer=False, **kwargs)

    with mock.patch.object(merge, "merge_", lossy), mock.patch.object(merge.Accumulator, "__init__", step_by_step):
        return [run_case(c) for c in cases]
