"""GPU kernels against the fp64 oracle: forward, lse, and the block backward from a FINAL (out, lse).

Run on a CUDA machine: ``python -m pytest -m gpu tests/test_gpu_kernels.py``. Each kernel is called on a
block whose queries are a row-slice of a larger tensor (strided views, as the methods pass them), and the
backward is given the out/lse of a LARGER key set, so the test checks the contract the schedules rely on:
with the final lse, a block's gradient is exactly its share.
"""

from __future__ import annotations

import pytest
import torch

from seqpar.errors import UnsupportedInputError
from seqpar.kernels import KernelCall, select
from seqpar.masks import Band, Varlen
from seqpar.tolerances import judge

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (mask, key rows) with 128 query rows; every band is planner-trimmed, as the methods produce them, but UNTRIMMED
MASKS = {
    "full": (Band(), 192),
    "causal": (Band(None, 0), 128),
    "bottom-right": (Band(None, 64), 192),        # the last query sees all 192 keys
    "causal-offset": (Band(None, 17), 128),       # full keys [0, 17) + top-left causal (cudnn splits)
    "window": (Band(-40, 0), 128),
    "window-both": (Band(-40, 25), 128),
    "open-diagonal": (Band(0, None), 128),         # a ring's farthest window step: cuDNN reads it backwards
    "open-wide": (Band(-30, None), 160),
    "open": (Band(1, None), 128),                  # not trimmed: the last row sees no key
    "open-short": (Band(50, None), 128),           # not trimmed: rows 78 on see no key
    "varlen": (Varlen((0, 30, 30, 70, 128), (0, 50, 90, 150, 192), (-1, 0)), 192),
    "varlen-window": (Varlen((0, 60, 128), (0, 80, 192), (33, 0)), 192),
}


def _vis(mask, m, n, device):
    """Boolean ``(m, n)`` visibility of a Band or Varlen mask, built independently of the kernels."""
    if isinstance(mask, Band):
        d = torch.arange(n, device=device)[None] - torch.arange(m, device=device)[:, None]
        vis = torch.ones(m, n, dtype=torch.bool, device=device)
        if mask.lo is not None:
            vis &= d >= mask.lo
        if mask.hi is not None:
            vis &= d <= mask.hi
        return vis
    vis = torch.zeros(m, n, dtype=torch.bool, device=device)
    left, right = mask.window
    for s in range(len(mask.cu_q) - 1):
        qa, qb, ka, kb = mask.cu_q[s], mask.cu_q[s + 1], mask.cu_k[s], mask.cu_k[s + 1]
        if qa == qb or ka == kb:
            continue
        d = (torch.arange(kb - ka, device=device)[None] - torch.arange(qb - qa, device=device)[:, None]
             - ((kb - ka) - (qb - qa)))
        ok = torch.ones_like(d, dtype=torch.bool)
        if left >= 0:
            ok &= d >= -left
        if right >= 0:
            ok &= d <= right
        vis[qa:qb, ka:kb] = ok
    return vis


def _dense(q, k, v, vis, scale, dtype, upcast=True):
    """Dense attention under ``vis`` in ``dtype`` (fp64 truth, or low precision for the baseline)."""
    g = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd.repeat_interleave(g, 2)) * scale
    s = s.masked_fill(~vis, float("-inf"))
    sm = s.float() if upcast and dtype != torch.float64 else s
    lse = torch.logsumexp(sm, -1)
    p = torch.exp(sm - lse[..., None]).nan_to_num(0).to(dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd.repeat_interleave(g, 2))
    return (qd, kd, vd), out, lse


UNTRIMMED = {"open", "open-short"}
"""Bands with rows that see no key, which planning never hands a kernel (it trims them) and FA2's window cannot
hold (``bottom_right_window`` raises); cuDNN's backwards reading takes any (Note [Open bands backwards])."""
CASES = [(name, kern, dt, d) for name in MASKS for kern in ("cudnn", "flash", "flash_attn")
         for dt in (torch.bfloat16, torch.float16) for d in (64, 128)
         if not (name in UNTRIMMED and kern != "cudnn")]
CASES += [(name, "efficient", torch.float32, d) for name in MASKS for d in (64, 128)]
# flex compiles a kernel per (mask family, dtype, shape): keep its grid small
CASES += [(name, "flex", dt, 64) for name in MASKS for dt in (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("mask_name,kernel,dtype,head_dim", CASES)
def test_kernel_block_forward_and_backward(mask_name, kernel, dtype, head_dim):
    torch.manual_seed(0)
    mask, N = MASKS[mask_name]
    B, H, Hkv, M, X = 2, 8, 2, 128, 48
    big_q = torch.randn(B, M + 32, H, head_dim, device="cuda", dtype=dtype)
    q = big_q[:, 16:16 + M]                                   # a strided row-slice, as the schedules pass it
    k, v = (torch.randn(B, N, Hkv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn(B, M, H, head_dim, device="cuda", dtype=dtype)
    scale = head_dim ** -0.5
    try:
        kern = select(kernel, KernelCall.of(q, k, mask))
    except UnsupportedInputError as e:
        pytest.skip(f"{kernel} declines: {e.reasons}")
    vis = _vis(mask, M, N, "cuda")
    dt = str(dtype).removeprefix("torch.")

    # forward: against fp64, with the same-dtype single-device computation as the yardstick
    out, lse = kern.forward(q, k, v, mask, scale)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, M) and out.shape == q.shape
    _, t_out, t_lse = _dense(q, k, v, vis, scale, torch.float64)
    _, b_out, b_lse = _dense(q, k, v, vis, scale, dtype, upcast=False)
    low = dtype != torch.float32
    for name, got, want, base in (("out", out, t_out, b_out), ("lse", lse, t_lse, b_lse)):
        verdict = judge(name, got.double(), want, base.double() if low else None, dt)
        assert verdict.ok, f"{name}: {verdict}"

    # backward given the FINAL out/lse over a larger key set (the block's keys + X keys every query sees)
    kx, vx = (torch.randn(B, X, Hkv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    vis_all = torch.cat([vis, torch.ones(M, X, dtype=torch.bool, device="cuda")], 1)
    (qd, kd, vd), f_out, f_lse = _dense(q, torch.cat([k, kx], 1), torch.cat([v, vx], 1), vis_all, scale,
                                        torch.float64)
    # the block's share: dq restricted to the block's keys, dk/dv of the block's keys
    (qs, ks, vs), _, _ = _dense(q, k, v, vis, scale, torch.float64)
    g = kern.backward(do, q, k, v, f_out.to(dtype), f_lse.float(), mask, scale)
    share = _share(qs.detach(), ks.detach(), vs.detach(), do.double(), f_out.detach(), f_lse.detach(), vis, scale)
    _, dk_all, dv_all = torch.autograd.grad(f_out, (qd, kd, vd), do.double())
    torch.testing.assert_close(share[1], dk_all[:, :N])      # the share is what the whole gradient says
    torch.testing.assert_close(share[2], dv_all[:, :N])
    tol = 2e-2 if low else 2e-3
    for name, got, want in zip(("dq", "dk", "dv"), g, share):
        assert got.shape == want.shape and torch.isfinite(got).all(), name
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, f"{name}: error {err:.2e} against the block's share (tolerance {tol})"


def _share(q, k, v, do, out, lse, vis, scale):
    """The block's gradient given the final out/lse (ALGORITHMS §1.4), fp64."""
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    p = torch.exp(s - lse[..., None]).masked_fill(~vis, 0.0)
    delta = (do * out).sum(-1).transpose(1, 2)
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, vr) - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q).unflatten(2, (k.shape[2], g)).sum(3) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do).unflatten(2, (k.shape[2], g)).sum(3)
    return dq, dk, dv


def test_long_causal_forward_in_halves_matches_one_call():
    """Note [Long causal calls in halves]: a square causal block of ``HALVES_ROWS`` rows on cuDNN runs as three
    calls on two streams, merged to the one call's out and lse within bf16's rounding."""
    from seqpar.kernels import combine
    from seqpar.kernels.executor import HALVES_ROWS, TaskRunner
    from seqpar.layouts.blocks import Task

    S = HALVES_ROWS
    torch.manual_seed(0)
    q = torch.randn(1, S, 2, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, S, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runner, task = TaskRunner("auto", 0.125), Task(0, S, 0, S, Band(None, 0))
    assert runner.kernel_for(q, k, task).name == "cudnn"
    each = runner.forward_each((task,), q, k, v)
    assert [t.rows * t.cols for t, _ in each] == [S * S // 4] * 3
    out, lse = combine.merge_parts([(t.q, *r) for t, r in each], tuple(q.shape), q.dtype)
    one = runner.forward(q, k, v, task)
    assert (lse - one.lse).abs().max().item() < 1e-3
    assert (out.float() - one.out.float()).abs().max().item() < 2e-2
    short = Task(0, S // 2, 0, S // 2, Band(None, 0))
    assert [t for t, _ in runner.forward_each((short,), q[:, :S // 2], k[:, :S // 2], v[:, :S // 2])] == [short]
