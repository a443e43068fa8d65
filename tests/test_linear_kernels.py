"""Local linear attention: the recurrence's convention, the chunked form against it, numerics, dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from seqpar.errors import UnsupportedInputError
from seqpar.kernels.linear import LinearCall, linear_attention_chunked, linear_attention_recurrent, select_linear

GATES = ["none", "const", "scalar", "dim"]


def _inputs(gate: str, B=2, L=13, H=3, K=5, V=4, dtype=torch.float64, seed=0, strength=2.0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, L, H, K, generator=g), torch.randn(B, L, H, K, generator=g)
    v = torch.randn(B, L, H, V, generator=g)
    shape = {"none": None, "const": (H,), "scalar": (B, L, H), "dim": (B, L, H, K)}[gate]
    lg = None if shape is None else torch.nn.functional.logsigmoid(torch.randn(*shape, generator=g) + strength)
    h0 = torch.randn(B, H, K, V, generator=g)
    return [None if t is None else t.to(dtype) for t in (q, k, v, lg, h0)]


def test_inclusive_decay_hand_example():
    """Note [Inclusive decay]: token t's own outer product is not decayed; the step-t gate decays the old state."""
    a1, a2, s0 = 0.5, 0.25, 3.0
    q = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    k = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 2, 1, 1)
    g = torch.tensor([math.log(a1), math.log(a2)], dtype=torch.float64).view(1, 2, 1)
    h0 = torch.full((1, 1, 1, 1), s0, dtype=torch.float64)
    want_o = torch.tensor([a1 * s0 + 1.0, a2 * (a1 * s0 + 1.0) + 2.0], dtype=torch.float64)
    for fn in (linear_attention_recurrent, linear_attention_chunked):
        o, S = fn(q, k, v, g, scale=1.0, initial_state=h0)
        torch.testing.assert_close(o.flatten(), want_o, rtol=0, atol=1e-14)
        torch.testing.assert_close(S.flatten(), want_o[-1:], rtol=0, atol=1e-14)


@pytest.mark.parametrize("gate", GATES)
def test_recurrence_matches_closed_form(gate):
    """o_t = sum_{j<=t} (q_t * e^{G_t - G_j})^T k_j v_j + (q_t * e^{G_t})^T S_0 with inclusive G (ALGORITHMS §10.1)."""
    q, k, v, g, h0 = _inputs(gate)
    B, L, H, K = q.shape
    G = torch.zeros(B, L, H, K, dtype=q.dtype)
    if g is not None:
        full = g.view(1, 1, H).expand(B, L, H) if g.dim() == 1 else g
        G = (full.unsqueeze(-1) if full.dim() == 3 else full).cumsum(1).expand(B, L, H, K)
    want = torch.zeros(B, L, H, v.shape[-1], dtype=q.dtype)
    for t in range(L):
        for j in range(t + 1):
            w = (q[:, t] * torch.exp(G[:, t] - G[:, j]) * k[:, j]).sum(-1)          # (B, H)
            want[:, t] += w.unsqueeze(-1) * v[:, j]
        want[:, t] += torch.einsum("bhk,bhkv->bhv", q[:, t] * torch.exp(G[:, t]), h0)
    o, _ = linear_attention_recurrent(q, k, v, g, scale=1.0, initial_state=h0)
    torch.testing.assert_close(o, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("L,C", [(1, 4), (7, 3), (16, 4), (37, 16), (13, 64), (100, 64), (100, 128)])
def test_chunked_matches_recurrent_with_gradients(gate, L, C):
    """Outputs, final state and every gradient (q, k, v, gates, initial state), any length vs chunk size.

    (100, 64) and (100, 128): tails shorter than a chunk and lengths under one chunk are computed, never
    dropped or left uninitialised (PEERS.md §5, LASP-2 defect 4).
    """
    inputs = _inputs(gate, L=L, seed=L + C)
    res = []
    for fn, kw in ((linear_attention_recurrent, {}), (linear_attention_chunked, {"chunk_size": C})):
        leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
        q, k, v, g, h0 = leaves
        o, S = fn(q, k, v, g, initial_state=h0, **kw)
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
        loss = loss + (S * torch.randn(S.shape, generator=gen, dtype=S.dtype)).sum()
        grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
        res.append([o.detach(), S.detach(), *grads])
    for want, got in zip(*res):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11 * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("gate", GATES)
def test_no_future_leak_inside_a_chunk(gate):
    """Perturbing token 70 changes no output before it, with 64-token chunks (PEERS.md §5, LASP-2 defect 2)."""
    q, k, v, g, _ = _inputs(gate, B=1, L=80, H=1, K=4, V=4)
    o, _ = linear_attention_chunked(q, k, v, g, chunk_size=64)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, 70] += 5.0
    k2[:, 70] += 5.0
    v2[:, 70] += 5.0
    g2 = g
    if g is not None and g.dim() > 1:
        g2 = g.clone()
        g2[:, 70] -= 1.0
    o2, _ = linear_attention_chunked(q2, k2, v2, g2, chunk_size=64)
    assert torch.equal(o[:, :70], o2[:, :70]), "a future token changed a past output"
    assert not torch.allclose(o[:, 70], o2[:, 70])


def test_token_sees_itself_and_its_chunk_neighbours():
    """Not only the inter-chunk term (PEERS.md §5, LASP-2 defect 1): o_t moves with v_t and v_{t-1} in its chunk."""
    q, k, v, _, _ = _inputs("none", B=1, L=64, H=1)
    o, _ = linear_attention_chunked(q, k, v, chunk_size=64)
    for j in (40, 39):
        v2 = v.clone()
        v2[:, j] += 1.0
        o2, _ = linear_attention_chunked(q, k, v2, chunk_size=64)
        assert not torch.allclose(o[:, 40], o2[:, 40]), f"o_40 does not depend on v_{j}"


@pytest.mark.parametrize("gate", ["scalar", "dim"])
def test_strong_decay_never_overflows(gate):
    """G reaches -7680 inside a chunk: exp(-G) would overflow; only non-positive differences are exponentiated."""
    q, k, v, _, h0 = _inputs(gate, B=1, L=256, H=2, K=4, V=4, dtype=torch.float32)
    shape = (1, 256, 2) if gate == "scalar" else (1, 256, 2, 4)
    g = torch.full(shape, -30.0)
    o, S = linear_attention_chunked(q, k, v, g, chunk_size=64, initial_state=h0)
    o_ref, S_ref = linear_attention_recurrent(q, k, v, g, initial_state=h0)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-5, atol=1e-5)


def test_low_precision_inputs_keep_fp32_state():
    q, k, v, g, h0 = _inputs("dim", L=40, dtype=torch.bfloat16)
    o, S = linear_attention_chunked(q, k, v, g, chunk_size=16, initial_state=h0)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    o64, S64 = linear_attention_recurrent(*(t.double() for t in (q, k, v, g)), initial_state=h0.double())
    assert (o.double() - o64).abs().max() <= 1e-2 * o64.abs().max()
    assert (S.double() - S64).abs().max() <= 1e-5 * S64.abs().max()


def test_feature_maps():
    q, k, v, g, _ = _inputs("scalar")
    for name, fn in (("elu1", lambda x: torch.nn.functional.elu(x) + 1), ("relu", torch.relu)):
        o, _ = linear_attention_chunked(q, k, v, g, feature_map=name, chunk_size=4, scale=0.5)
        want, _ = linear_attention_recurrent(fn(q) * 0.5, fn(k), v, g, scale=1.0)
        torch.testing.assert_close(o, want, rtol=0, atol=1e-12)
    o, _ = linear_attention_chunked(q, k, v, g, feature_map=torch.sigmoid, chunk_size=4)
    want, _ = linear_attention_recurrent(q, k, v, g, feature_map=torch.sigmoid)
    torch.testing.assert_close(o, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        linear_attention_chunked(q, k, v, feature_map="softmax")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        linear_attention_chunked(q, k, v, chunk_size=0)


def test_kernel_selection_is_explicit():
    assert select_linear("auto", LinearCall("cpu", torch.float32, "dim")).name == "chunked"
    with pytest.raises(UnsupportedInputError, match="CUDA only"):
        select_linear("fla", LinearCall("cpu", torch.bfloat16, "scalar"))
    with pytest.raises(UnsupportedInputError, match="dtype must be fp16, bf16 or fp32"):
        select_linear("fla", LinearCall("cuda", torch.float64, "none"))
    try:
        import fla  # noqa: F401
    except Exception:
        with pytest.raises(UnsupportedInputError, match=r"fla-core is not (installed|importable)"):
            select_linear("fla", LinearCall("cuda", torch.bfloat16, "dim"))
        assert select_linear("auto", LinearCall("cuda", torch.bfloat16, "dim")).name == "chunked"
    with pytest.raises(ValueError, match="kernel must be one of"):
        select_linear("triton", LinearCall("cpu", torch.float32, "none"))


def test_no_host_synchronisation_in_linear_paths():
    """GPU-ready: no .item(), .tolist(), .cpu() or synchronize() in the kernels, comm and methods of LASP."""
    import pathlib

    import seqpar

    root = pathlib.Path(seqpar.__file__).parent
    files = ["kernels/linear.py", "comm/states.py", "methods/_linear.py", "methods/lasp2.py", "methods/lasp1.py"]
    for f in files:
        src = (root / f).read_text()
        for bad in (".item(", ".tolist(", ".cpu(", "synchronize("):
            assert bad not in src, f"{f} calls {bad}"
