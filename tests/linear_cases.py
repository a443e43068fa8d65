"""Test-only workers for the linear-attention tests (leak, overlap order, subgroups, bad input).

The oracle cases themselves ship in ``seqpar.testing.linear_cases`` (the demo uses them too).
"""

from __future__ import annotations

from typing import Any

import torch

from seqpar.testing.linear_cases import (
    FIELDS,
    LinearCase,
    LinearReport,
    assert_reports,
    check_linear_case,
    make_linear_inputs,
    oracle,
    run_and_check,
    run_linear_case,
    run_linear_cases,
)

__all__ = ["FIELDS", "LinearCase", "LinearReport", "assert_reports", "bad_input_worker", "check_linear_case",
           "leak_worker", "make_linear_inputs", "oracle", "overlap_worker", "run_and_check", "run_linear_case",
           "run_linear_cases", "subgroup_worker"]

# ------------------------------------------------------------------------------------------------ special workers


def _call(case: LinearCase, inp: dict[str, torch.Tensor | None], mesh: Any = None) -> torch.Tensor:
    import seqpar

    where = {"mesh": mesh, "layout": case.layout}
    g = inp["g"]
    if g is not None and g.dim() > 1:
        g = seqpar.shard(g, **where)
    kw = {"decay": g} if case.gate in ("const", "scalar") else ({"gates": g} if case.gate == "dim" else {})
    return seqpar.linear_attention(*(seqpar.shard(inp[n], **where) for n in ("q", "k", "v")), mesh=mesh,
                                   method=case.method, layout=case.layout, causal=case.causal,
                                   cu_seqlens=case.cu_seqlens, seq_len=case.valid_len, chunk_size=case.chunk_size,
                                   **kw)


def leak_worker(case: LinearCase, token: int) -> dict[str, torch.Tensor]:
    """Outputs for the inputs, the same inputs again (determinism) and the inputs with ``token`` perturbed."""
    import seqpar

    inp = make_linear_inputs(case)
    base, again = _call(case, inp), _call(case, inp)
    bumped = {n: (None if t is None else t.clone()) for n, t in inp.items()}
    for n in ("q", "k", "v"):
        bumped[n][:, token] += 3.0
    if bumped["g"] is not None and bumped["g"].dim() > 1:
        bumped["g"][:, token] -= 1.0
    return {"base": base, "again": again, "bumped": _call(case, bumped),
            "positions": seqpar.positions(case.seq_len, layout=case.layout)}


def overlap_worker(method: str) -> list[str]:
    """The order of posts, waits and local compute in one forward + backward (instrumented, then restored)."""
    import seqpar
    from seqpar.comm import states
    from seqpar.methods import _linear, lasp1, lasp2

    events: list[str] = []

    class LoggedPending:
        def __init__(self, inner, name):
            self.inner, self.name = inner, name

        def wait(self):
            events.append(f"{self.name}.wait")
            return self.inner.wait()

    def logged(fn, name):
        def wrapper(*a, **kw):
            events.append(name)
            res = fn(*a, **kw)
            return LoggedPending(res, name) if isinstance(res, states.Pending) else res
        return wrapper

    class LoggedExchange(lasp1.Exchange):
        def recv(self, tensor, peer):
            events.append("recv.post")
            return super().recv(tensor, peer)

        def send(self, tensor, peer):
            events.append("send.post")
            return super().send(tensor, peer)

        def wait(self):
            events.append("exchange.wait")
            return super().wait()

    saved = (lasp2.gather_states, _linear.local_forward, _linear.local_backward, lasp1.Exchange)
    lasp2.gather_states = logged(states.gather_states, "gather")
    _linear.local_forward = logged(saved[1], "local_forward")
    _linear.local_backward = logged(saved[2], "local_backward")
    lasp1.Exchange = LoggedExchange
    try:
        case = LinearCase(method=method, gate="dim", seq_len=16, final_state=method == "lasp2")
        inp = make_linear_inputs(case)
        q, k, v = (seqpar.shard(inp[n], layout="contiguous").requires_grad_() for n in ("q", "k", "v"))
        g = seqpar.shard(inp["g"], layout="contiguous")
        out = seqpar.linear_attention(q, k, v, gates=g, method=method, output_final_state=case.final_state)
        o = out[0] if case.final_state else out
        events.append("backward")
        o.sum().backward()
    finally:
        lasp2.gather_states, _linear.local_forward, _linear.local_backward, lasp1.Exchange = saved
    return events


def subgroup_worker(cases: list[LinearCase]) -> tuple[int, list[dict[str, Any]]]:
    """Run ``cases`` on strided subgroups {0, 2, ...} and {1, 3, ...}; returns (group id, results)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(i, world, 2))) for i in range(2)]     # collective: every rank, same order
    mine = groups[rank % 2]
    return rank % 2, [run_linear_case(c, mine) for c in cases]


def bad_input_worker() -> dict[str, tuple[str, str]]:
    """The exception type and message of each bad call (single rank)."""
    import seqpar

    B, L, H, K, V = 1, 8, 2, 4, 3
    q, k, v = torch.randn(B, L, H, K), torch.randn(B, L, H, K), torch.randn(B, L, H, V)
    calls = {
        "gqa": lambda: seqpar.linear_attention(q, k[:, :, :1], v[:, :, :1]),
        "both_gates": lambda: seqpar.linear_attention(q, k, v, decay=-torch.ones(H), gates=-torch.ones(B, L, H, K)),
        "decay_shape": lambda: seqpar.linear_attention(q, k, v, decay=-torch.ones(B, L)),
        "gates_shape": lambda: seqpar.linear_attention(q, k, v, gates=-torch.ones(B, L, H)),
        "noncausal_decay": lambda: seqpar.linear_attention(q, k, v, decay=-torch.ones(H), causal=False),
        "noncausal_state": lambda: seqpar.linear_attention(q, k, v, causal=False, output_final_state=True),
        "h0_docs": lambda: seqpar.linear_attention(q, k, v, initial_state=torch.zeros(B, H, K, V),
                                                   cu_seqlens=[0, 3, 8]),
        "h0_shape": lambda: seqpar.linear_attention(q, k, v, initial_state=torch.zeros(B, H, V, K)),
        "lasp1_zigzag": lambda: seqpar.linear_attention(q, k, v, method="lasp1", layout="zigzag"),
        "lasp1_final": lambda: seqpar.linear_attention(q, k, v, method="lasp1", output_final_state=True),
        "lasp1_noncausal": lambda: seqpar.linear_attention(q, k, v, method="lasp1", causal=False),
        "method": lambda: seqpar.linear_attention(q, k, v, method="ring"),
        "stripe": lambda: seqpar.linear_attention(q, k, v, layout="stripe"),
        "kernel_cpu": lambda: seqpar.linear_attention(q, k, v, kernel="fla"),
        "kernel_name": lambda: seqpar.linear_attention(q, k, v, kernel="flash"),
        "zigzag_odd": lambda: seqpar.linear_attention(q[:, :7], k[:, :7], v[:, :7], layout="zigzag"),
        "chunk": lambda: seqpar.linear_attention(q, k, v, chunk_size=0),
        "feature_map": lambda: seqpar.linear_attention(q, k, v, feature_map="softmax"),
        "scale": lambda: seqpar.linear_attention(q, k, v, scale=-1.0),
        "dtype_mix": lambda: seqpar.linear_attention(q, k.double(), v),
        "seq_len": lambda: seqpar.linear_attention(q, k, v, seq_len=10 ** 6),
        "cu_end": lambda: seqpar.linear_attention(q, k, v, cu_seqlens=[0, 3, 7]),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ("no error", "")
        except Exception as e:  # collected for the parent to judge
            out[name] = (type(e).__name__, str(e))
    return out
