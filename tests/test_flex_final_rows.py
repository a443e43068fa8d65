"""Flex's backward from a block's final rows (Note [Flex backward from the final rows] in
``seqpar.kernels.flex_backward``), on CPU: the traced graph run by the op's eager (dense) form must give the block's
share of the gradient computed densely in fp64, for blocks of a merged call (final lse above the block's own), every
mask form, grouped heads, softcap and rows that see no key. On CUDA (``gpu`` marker) the compiled graph, through
``FlexKernel.backward``, against the same dense computation."""

from __future__ import annotations

import warnings

import pytest
import torch

from seqpar.kernels import flex as flex_mod
from seqpar.kernels import flex_backward
from seqpar.masks import Band, Joined, Varlen
from seqpar.masks.forms import Modded
from seqpar.numerics import GradRows

pytest.importorskip("torch.nn.attention.flex_attention")


def _final_rows(mask, m: int, n: int, heads: int, kv_heads: int, softcap: float, seed: int,
                device: str = "cpu", dtype: torch.dtype = torch.float32):
    """A block's inputs and the final rows of a call where another block (random) joined it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, m, heads, 32, generator=g).to(device, dtype)
    k, v = (torch.randn(1, n, kv_heads, 32, generator=g).to(device, dtype) for _ in range(2))
    o_b, l_b = flex_mod.FlexKernel().forward(q, k, v, mask, 32 ** -0.5, softcap=softcap)
    o_x = torch.randn(o_b.shape, generator=g).to(device, dtype)
    l_x = torch.randn(l_b.shape, generator=g).to(device)
    l_x[:, :, : m // 4] = float("-inf")                 # rows the other block does not reach
    lse = torch.logaddexp(l_b, l_x)
    w_b = torch.exp(l_b - lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    w_x = torch.exp(l_x - lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    out = (o_b.float() * w_b + o_x.float() * w_x).to(dtype)
    do = torch.randn(out.shape, generator=g).to(device, dtype)
    return q, k, v, out, lse, do


def _dense_backward(do, q, k, v, out, lse, mask, scale: float, softcap: float, dlse=None):
    """A block's share of the gradient from the final rows, on the dense grid (fp64)."""
    m, n, H, Hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    dev = q.device
    visible = flex_mod._mask_mod(mask, m, n, dev)(0, 0, torch.arange(m, device=dev)[:, None],
                                                  torch.arange(n, device=dev)[None])
    qd, kd, vd, od, dod = (x[0].double().transpose(0, 1) for x in (q, k, v, out, do))     # (H, S, D)
    kd, vd = (x.repeat_interleave(H // Hkv, 0) for x in (kd, vd))
    raw = qd @ kd.transpose(1, 2) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    p = torch.exp(s - lse[0].double().unsqueeze(-1)).masked_fill(~visible.expand(H, m, n), 0.0).nan_to_num(0.0)
    dv = p.transpose(1, 2) @ dod
    delta = (dod * od).sum(-1, keepdim=True) - (0 if dlse is None else dlse[0].double().unsqueeze(-1))
    ds = p * (dod @ vd.transpose(1, 2) - delta)
    if softcap:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = ds @ kd * scale
    dk = ds.transpose(1, 2) @ qd * scale
    dk, dv = (x.view(Hkv, H // Hkv, n, -1).sum(1) for x in (dk, dv))
    return tuple(x.transpose(0, 1)[None] for x in (dq, dk, dv))


def _user_mod(device: str = "cpu"):
    keep = torch.tensor([1, 0, 1], device=device)

    def fn(b, h, qi, ki):
        return keep[(qi + ki) % 3] == 1
    return fn


def _masks(m: int, n: int, device: str = "cpu"):
    user = _user_mod(device)
    return {
        "band": Band(-64, 0),
        "causal-offset": Band(None, n - m),
        "joined": Joined(((0, m // 2, 0, n // 2, Band(None, 0)), (m // 2, m, 0, n, Band(-96, n - m)))),
        "varlen-window": Varlen((0, m // 2, m), (0, n // 2, n), (48, 0)),
        "modded": Modded(Band(None, n - m), user, ((0, m),), ((0, n),)),
        "empty-rows": Band(-300, -200),
    }


@pytest.mark.parametrize("name", ["band", "causal-offset", "joined", "varlen-window", "modded", "empty-rows"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_final_rows_equal_recompute(name: str, softcap: float):
    m, n = 256, 384
    mask = _masks(m, n)[name]
    q, k, v, out, lse, do = _final_rows(mask, m, n, 4, 2, softcap, seed=len(name))
    scale = 32 ** -0.5
    want = _dense_backward(do, q, k, v, out, lse, mask, scale, softcap)
    bm = flex_mod._block_mask(mask, m, n, q.device)
    with torch.no_grad():                  # as in an autograd backward: the score function's joint still has grads
        got = flex_backward.final_rows_backward(do, q, k, v, out, lse, bm,
                                                flex_mod._softcap_mod(softcap, q.device) if softcap else None, scale,
                                                {})
    assert got is not None
    for a, b, what in zip(got, want, ("dq", "dk", "dv")):
        assert a.shape == b.shape, what
        assert torch.isfinite(a).all(), what
        torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=2e-4, msg=what)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_lse_gradient_through_folded_rows(device: str):
    """With an lse gradient the kernel gets the folded rows (Note [Folding the lse gradient]): its Delta is
    ``rowsum(dO O) - dlse`` and its dV still the plain ``P^T dO``."""
    m, n = 256, 384
    mask = _masks(m, n, device)["joined"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, out, lse, do = _final_rows(mask, m, n, 4, 2, 5.0, seed=11, device=device, dtype=dtype)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(12)).to(device)
    rows = GradRows(do, out, dlse)
    do_f, out_f = rows.folded
    scale = 32 ** -0.5
    bm = flex_mod._block_mask(mask, m, n, q.device)
    options = flex_mod._options(q.device, q.shape[1]).get("kernel_options", {})
    with torch.no_grad():
        got = flex_backward.final_rows_backward(do_f, q, k, v, out_f, lse, bm, flex_mod._softcap_mod(5.0, q.device),
                                                scale, options)
    want = _dense_backward(do, q, k, v, out, lse, mask, scale, 5.0, dlse)
    for a, b, what in zip(got, want, ("dq", "dk", "dv")):
        err = (a.double() - b).abs().max() / b.abs().max()
        assert err < (1e-5 if device == "cpu" else 2e-2), (what, float(err))


def test_one_variant_per_mask_family():
    """Two bands of one shape share a variant: their bounds are inputs of the traced graph, not constants."""
    m = n = 256
    before = len(flex_backward.variants())
    for lo in (-64, -32, -100):
        mask = Band(lo, 0)
        q, k, v, out, lse, do = _final_rows(mask, m, n, 2, 2, 0.0, seed=lo)
        bm = flex_mod._block_mask(mask, m, n, q.device)
        assert flex_backward.final_rows_backward(do, q, k, v, out, lse, bm, None, 32 ** -0.5, {}) is not None
    assert len(flex_backward.variants()) - before <= 1


def test_lift_rebuilds_with_other_tensors():
    """``_lift`` finds the tensors a function closes over, through the functions it closes over."""
    inner = _user_mod()
    base = torch.tensor([5, 7])

    def outer(b, h, qi, ki):
        return inner(b, h, qi, ki) & (ki < base[0])
    found: list[torch.Tensor] = []
    rebuild, key = flex_backward._lift(outer, found)
    assert len(found) == 2 and any(t is base for t in found)
    swapped = [torch.tensor([1, 1, 1]) if t.shape == (3,) else torch.tensor([100, 0]) for t in found]
    qi, ki = torch.arange(6)[:, None], torch.arange(9)[None]
    z = torch.zeros((), dtype=torch.long)
    assert torch.equal(rebuild(tuple(found))(z, z, qi, ki), outer(z, z, qi, ki))
    assert rebuild(tuple(swapped))(z, z, qi, ki).all()
    assert flex_backward._lift(outer, [])[1] == key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["band", "causal-offset", "joined", "varlen-window", "modded", "empty-rows"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_gpu_final_rows_compiled(name: str, softcap: float):
    """The compiled graph through ``FlexKernel.backward`` (bf16 inputs, fp32 rows' maths) against the dense fp64
    gradients: within bf16's rounding of the inputs' scale."""
    m, n = 256, 384
    mask = _masks(m, n, "cuda")[name]
    q, k, v, out, lse, do = _final_rows(mask, m, n, 4, 2, softcap, seed=len(name), device="cuda",
                                        dtype=torch.bfloat16)
    scale = 32 ** -0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            got = flex_mod.FlexKernel().backward(do, q, k, v, out, lse, mask, scale, softcap=softcap)
    failed = [str(w.message) for w in caught if "final rows" in str(w.message)]
    assert not failed, failed
    want = _dense_backward(do, q, k, v, out, lse, mask, scale, softcap)
    for a, b, what in zip(got, want, ("dq", "dk", "dv")):
        assert torch.isfinite(a).all(), what
        err = (a.double() - b).abs().max() / b.abs().max().clamp(min=1e-6)
        assert err < 2e-2, (what, float(err))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_variant_keeps_no_call_tensors():
    """A kept variant holds none of the tensors of the call that built it (a 16K call's would be hundreds of MB)."""
    import gc
    import weakref

    m, n = 384, 512                                       # a shape no other test builds
    mask = Band(-100, 0)
    q, k, v, out, lse, do = _final_rows(mask, m, n, 4, 2, 0.0, seed=3, device="cuda", dtype=torch.bfloat16)
    refs = [weakref.ref(t) for t in (q, k, v, out, lse, do)]
    assert flex_mod.FlexKernel().backward(do, q, k, v, out, lse, mask, 32 ** -0.5) is not None
    del q, k, v, out, lse, do
    gc.collect()
    assert all(r() is None for r in refs)


_SHIFT = torch.tensor([0])


def _global_mod(b, h, qi, ki):
    return (ki + _SHIFT[0]) <= qi


def test_globals_are_inputs_read_at_each_call():
    """A tensor the function reads as a global is lifted like a closed-over one: one variant, and the graph gets
    whatever tensor the global names at the call (a batch's ids replaced are seen; no variant holds them)."""
    global _SHIFT
    found: list[torch.Tensor] = []
    rebuild, key = flex_backward._lift(_global_mod, found)
    assert len(found) == 1 and found[0] is _SHIFT
    old = _SHIFT
    try:
        _SHIFT = torch.tensor([2])
        again: list[torch.Tensor] = []
        assert flex_backward._lift(_global_mod, again)[1] == key and again[0] is _SHIFT
        z = torch.zeros((), dtype=torch.long)
        qi, ki = torch.arange(4)[:, None], torch.arange(4)[None]
        assert torch.equal(rebuild((torch.tensor([2]),))(z, z, qi, ki), _global_mod(z, z, qi, ki))
    finally:
        _SHIFT = old


def test_objects_key_by_value_or_refuse_tensors():
    """A callable object keys its variant by its own equality (a new equal mask finds the variant, another seed does
    not); one holding tensors is refused (its tensors would be traced in as constants), as is a function that
    builds a tensor from a literal: such calls keep the recompute."""
    from seqpar.testing.cases import HashMask

    key = flex_backward._lift(HashMask(3), [])[1]
    assert flex_backward._lift(HashMask(3), [])[1] == key
    assert flex_backward._lift(HashMask(4), [])[1] != key

    class Holds:
        def __init__(self):
            self.t = torch.tensor([1, 0])

        def __call__(self, b, h, qi, ki):
            return self.t[ki % 2] == 1
    with pytest.raises(flex_backward._Untracked):
        flex_backward._lift(Holds(), [])

    def literal(b, h, qi, ki):
        return torch.tensor([True, False, True])[ki % 3] & (ki <= qi)
    m = n = 128
    mask = Modded(Band(None, 0), literal, ((0, m),), ((0, n),))
    q, k, v, out, lse, do = _final_rows(mask, m, n, 2, 2, 0.0, seed=5)
    bm = flex_mod._block_mask(mask, m, n, q.device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # refused quietly: not a failed build
        assert flex_backward.final_rows_backward(do, q, k, v, out, lse, bm, None, 32 ** -0.5, {}) is None


def test_a_dead_objects_id_finds_nothing():
    """Values keyed by identity are held weakly: once gone, an object at the same ``id`` never matches."""
    class Plain:
        def __call__(self, b, h, qi, ki):
            return ki <= qi
    a = Plain()
    key = flex_backward._lift(a, [])[1]
    part = key[1]
    del a
    assert part.dead() and part != flex_backward._part(Plain())


