"""Worker functions for the head-group pipeline tests (run on every rank by ``ProcessPool``).

Module-level so spawned workers can import them by name. Each returns plain data; the tests assert.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import seqpar
from seqpar.testing import Case, make_inputs
from seqpar.testing import cases as _cases


def _forbidden(*_: Any, **__: Any):
    raise AssertionError("this code path must not run")


class _Traced:
    """A posted collective whose ``wait()`` is logged."""

    def __init__(self, work: Any, ident: int, log: list[str]):
        self._work, self._id, self._log = work, ident, log

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._log.append(f"W{self._id}")
        return self._work.wait(*args, **kwargs)


def trace_pipeline(case: Case) -> dict[str, Any]:
    """Run ``case`` forward and backward logging, in order, each all-to-all post ("P<n>", n counting posts),
    each wait ("W<n>") and each engine call ("C"), with every host-sync and side-stream entry point made to
    fail meanwhile (``Tensor.item``/``tolist``, ``torch.cuda.synchronize``, ``torch.cuda.Stream``/``stream``).

    Returns ``{"fwd": [...], "bwd": [...], "grads": all of dq, dk, dv present}``.
    """
    from seqpar.methods import _ulysses

    log: list[str] = []
    counter = [0]
    post = dist.all_to_all_single

    def traced_post(*args: Any, **kwargs: Any) -> _Traced:
        n = counter[0]
        counter[0] += 1
        log.append(f"P{n}")
        return _Traced(post(*args, **kwargs), n, log)

    def traced(fn):
        def call(*args: Any, **kwargs: Any):
            log.append("C")
            return fn(*args, **kwargs)
        return call

    engines = [e for e in (_ulysses.LocalEngine, _maybe_ring_engine()) if e is not None]
    mesh = _cases._mesh(case)
    q, k, v, do, _ = make_inputs(case)
    where = {"mesh": mesh, "method": case.method, "layout": case.layout}
    ql, kl, vl = (seqpar.shard(t, **where).requires_grad_() for t in (q, k, v))
    dol = seqpar.shard(do, **where)
    syncs = [(torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.cuda, "synchronize"), (torch.cuda, "Stream"),
             (torch.cuda, "stream")]
    patches = [mock.patch.object(dist, "all_to_all_single", traced_post)]
    patches += [mock.patch.object(obj, name, _forbidden) for obj, name in syncs]
    patches += [mock.patch.object(e, m, traced(getattr(e, m))) for e in engines for m in ("forward", "backward")]
    for p in patches:
        p.start()
    try:
        # check_ranks=False: the agreement round reads one small all-reduce back on purpose (docs/RELIABILITY.md)
        out = seqpar.attention(ql, kl, vl, causal=case.causal, kernel=case.kernel, check_ranks=False, **where,
                               **dict(case.options))
        fwd = list(log)
        log.clear()
        counter[0] = 0
        out.backward(dol)
        bwd = list(log)
    finally:
        for p in reversed(patches):
            p.stop()
    return {"fwd": fwd, "bwd": bwd, "grads": all(t.grad is not None for t in (ql, kl, vl))}


def _maybe_ring_engine():
    from seqpar.methods import usp

    return getattr(usp, "_RingInner", None)
