"""What PyTorch's attention ops serve on this GPU and torch build, measured: the facts the kernel layer declares.

    python3 benchmarks/gpu/probe_kernels.py --out DIR        (one GPU; about 3 minutes)

Sections (each prints one line per probe and appends JSON lines to DIR/probe.jsonl):
  caps     head dims (64..256, and Dqk != Dv) x {cudnn, flash, efficient, flex, cudnn ragged}: forward and
           backward, errors against an fp32 dense computation, or the exception
  fold     the lse gradient folded into (dO, O) for kernels that recompute Delta from O: accuracy (bf16)
  time     16K GQA 32/8 causal fwd+bwd per head dim and kernel (which kernel is fastest per shape)
  ragged   a 128K row of 63 packed documents: cuDNN ragged vs FA2 varlen, fwd and fwd+bwd
  host     host time per call: F.sdpa, the aten entry points, autograd.Function, torch.library custom op
  graph    CUDA-graph capture and replay of a cuDNN forward+backward
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

aten = torch.ops.aten
dev = torch.device("cuda")
OUT: Path


def emit(section: str, **rec) -> None:
    rec = {"section": section, **rec}
    print(json.dumps(rec), flush=True)
    with (OUT / "probe.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def dense(q, k, v, causal, scale, softcap=0.0):
    """fp32 reference on BHSD with bottom-right causal alignment; returns out, lse and a grad function."""
    g = q.shape[1] // k.shape[1]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    s = qf @ kf.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        sq, sk = s.shape[-2:]
        m = torch.ones(sq, sk, dtype=torch.bool, device=dev).tril(sk - sq)
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vf.repeat_interleave(g, 1)
    return o, lse, (qf, kf, vf)


def t_(x):
    return x.transpose(1, 2)


def run_caps() -> None:
    dims = [(64, 64), (80, 80), (96, 96), (128, 128), (160, 160), (192, 192), (256, 256), (192, 128), (128, 64)]
    B, H, Hkv, S = 1, 8, 2, 1024
    for dqk, dv in dims:
        for causal in (True, False):
            torch.manual_seed(0)
            q = torch.randn(B, H, S, dqk, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, Hkv, S, dqk, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, Hkv, S, dv, device=dev, dtype=torch.bfloat16)
            do = torch.randn(B, H, S, dv, device=dev, dtype=torch.bfloat16)
            sc = dqk ** -0.5
            o_r, l_r, leaves = dense(q, k, v, causal, sc)
            o_r.backward(do.float())
            want = [x.grad for x in leaves]
            for name, fn in _cap_kernels().items():
                rec = {"kernel": name, "dqk": dqk, "dv": dv, "causal": causal}
                try:
                    o, lse, bwd = fn(q, k, v, causal, sc)
                    rec.update(fwd="ok", out_err=rel(o, o_r), lse_err=rel(lse, l_r))
                except Exception as e:
                    rec.update(fwd=f"{type(e).__name__}: {str(e)[:200]}")
                    emit("caps", **rec)
                    continue
                try:
                    g = bwd(do, o, lse)
                    rec.update(bwd="ok", dq_err=rel(g[0], want[0]), dk_err=rel(g[1], want[1]),
                               dv_err=rel(g[2], want[2]))
                except Exception as e:
                    rec.update(bwd=f"{type(e).__name__}: {str(e)[:200]}")
                emit("caps", **rec)
            torch.cuda.synchronize()


def _cudnn(q, k, v, causal, sc):
    r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=sc)

    def bwd(do, o, lse):
        return aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, r[1], r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0, causal, scale=sc)
    return r[0], r[1].squeeze(-1), bwd


def _flash(q, k, v, causal, sc):
    sq, sk = q.shape[2], k.shape[2]
    o, lse, rng, unused, _ = aten._flash_attention_forward(t_(q), t_(k), t_(v), None, None, sq, sk, 0.0, causal, False,
                                                            scale=sc)

    def bwd(do, o_, lse_):
        g = aten._flash_attention_backward(t_(do), t_(q), t_(k), t_(v), o, lse, None, None, sq, sk, 0.0, causal, rng,
                                           unused, scale=sc)
        return [t_(x) for x in g]
    return t_(o), lse, bwd


def _efficient(q, k, v, causal, sc):
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o, lse, s1, s2 = aten._scaled_dot_product_efficient_attention(q, ke, ve, None, True, 0.0, causal, scale=sc)

    def bwd(do, o_, lse_):
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, ke, ve, None, o, lse, s1, s2, 0.0, [True, True, True, False], causal, scale=sc)
        return dq, dk.unflatten(1, (-1, g)).sum(2), dv.unflatten(1, (-1, g)).sum(2)
    return o, lse[..., : q.shape[2]], bwd


_FLEX = {}


def _flex(q, k, v, causal, sc, softcap=0.0):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    sq, sk = q.shape[2], k.shape[2]
    off = sk - sq
    bm = create_block_mask((lambda b, h, i, j: j <= i + off) if causal else (lambda b, h, i, j: j >= 0), None, None,
                           sq, sk, device=dev)
    score_mod = None
    if softcap:
        def score_mod(s, b, h, i, j):
            return softcap * torch.tanh(s / softcap)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = _FLEX["fn"](qg, kg, vg, block_mask=bm, scale=sc, enable_gqa=q.shape[1] != k.shape[1], return_lse=True,
                         score_mod=score_mod)

    def bwd(do, o_, lse_):
        return torch.autograd.grad(o, (qg, kg, vg), do)
    return o.detach(), lse.detach(), bwd


def _ragged(q, k, v, causal, sc):
    """cuDNN's ragged (varlen) entry: q (T, H, D) with cumulative offsets; here one sequence."""
    _, H, S, _ = q.shape
    cu = torch.tensor([0, S], dtype=torch.int32, device=dev)
    qt, kt, vt = (t_(x).reshape(S, x.shape[1], x.shape[-1]) for x in (q, k, v))
    r = aten._cudnn_attention_forward(qt, kt, vt, None, cu, cu, S, S, True, 0.0, causal, False, scale=sc)
    o = r[0]

    def bwd(do, o_, lse_):
        dot = t_(do).reshape(S, H, -1)
        g = aten._cudnn_attention_backward(dot, qt, kt, vt, o, r[1], r[6], r[7], torch.empty(0, device=dev), cu, cu,
                                           S, S, 0.0, causal, scale=sc)
        return [t_(x.reshape(1, S, x.shape[-2], x.shape[-1])) for x in g]
    lse = r[1]
    return t_(o.reshape(1, S, H, -1)), lse.reshape(1, H, S) if lse.numel() == H * S else lse, bwd


def _cap_kernels():
    return {"cudnn": _cudnn, "flash": _flash, "efficient": _efficient, "flex": _flex, "cudnn_ragged": _ragged}


def run_softcap() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 8, 1024, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1024, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    o_r, l_r, leaves = dense(q, k, v, True, 128 ** -0.5, softcap=30.0)
    o_r.backward(do.float())
    try:
        o, lse, bwd = _flex(q, k, v, True, 128 ** -0.5, softcap=30.0)
        g = bwd(do, o, lse)
        emit("softcap", kernel="flex", out_err=rel(o, o_r), lse_err=rel(lse, l_r),
             dq_err=rel(g[0], leaves[0].grad), dk_err=rel(g[1], leaves[1].grad))
    except Exception as e:
        emit("softcap", kernel="flex", error=f"{type(e).__name__}: {str(e)[:200]}")


def run_fold() -> None:
    """Backward with dlse through a kernel that recomputes Delta = rowsum(dO * O): fold dlse into (dO, O)."""
    torch.manual_seed(1)
    B, H, Hkv, S, D = 1, 8, 2, 1024, 128
    q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for zero_rows in (False, True):
        do = torch.randn_like(q)
        dlse = torch.randn(B, H, S, device=dev)
        if zero_rows:
            do[:, :, ::7] = 0
        sc = D ** -0.5
        qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
        s = qf @ kf.repeat_interleave(4, 1).transpose(-1, -2) * sc
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=dev).tril(), float("-inf"))
        lse_r = torch.logsumexp(s, -1)
        o_r = torch.softmax(s, -1) @ vf.repeat_interleave(4, 1)
        ((o_r * do.double()).sum() + (lse_r * dlse.double()).sum()).backward()
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=sc)
        o, lse = r[0], r[1]
        dof, of = do.float(), o.float()
        n2 = (dof * dof).sum(-1, keepdim=True)
        tau = torch.maximum(dlse.abs().unsqueeze(-1) * 2.0 ** -20, torch.full_like(n2, 2.0 ** -100))
        small = n2 < tau * tau
        w = torch.where(small, dof + torch.where(small, tau, 0.0) * (torch.arange(D, device=dev) == 0), dof)
        o2 = of - dlse.unsqueeze(-1) * w / (w * w).sum(-1, keepdim=True)
        g = aten._scaled_dot_product_cudnn_attention_backward(
            w.to(q.dtype), q, k, v, o2.to(q.dtype), lse, r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0, True, scale=sc)
        # the same shapes through the plain backward (no dlse) in bf16, for the error a plain run has
        gp = aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, o, lse, r[6], r[7], None, r[2], r[3], r[4], r[5], 0.0, True, scale=sc)
        qp, kp, vp = (t.detach().double().requires_grad_() for t in (q, k, v))
        sp = (qp @ kp.repeat_interleave(4, 1).transpose(-1, -2) * sc).masked_fill(
            ~torch.ones(S, S, dtype=torch.bool, device=dev).tril(), float("-inf"))
        (torch.softmax(sp, -1) @ vp.repeat_interleave(4, 1)).backward(do.double())
        emit("fold", zero_dO_rows=zero_rows, dq_err=rel(g[0], qf.grad), dk_err=rel(g[1], kf.grad),
             dv_err=rel(g[2], vf.grad), plain_dq_err=rel(gp[0], qp.grad), plain_dk_err=rel(gp[1], kp.grad),
             plain_dv_err=rel(gp[2], vp.grad))


def bench(fn, warmup=2, iters=5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def run_time() -> None:
    B, H, Hkv, S = 1, 32, 8, 16384
    for dqk, dv in [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)]:
        torch.manual_seed(0)
        q = torch.randn(B, H, S, dqk, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, dqk, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, S, dv, device=dev, dtype=torch.bfloat16)
        do = torch.randn(B, H, S, dv, device=dev, dtype=torch.bfloat16)
        sc = dqk ** -0.5
        kernels = {"cudnn": _cudnn, "flash": _flash}
        if (dqk, dv) in ((96, 96), (192, 128)):
            kernels["flex"] = _flex
        for name, fn in kernels.items():
            rec = {"kernel": name, "dqk": dqk, "dv": dv, "S": S}
            try:
                rec["fwd_ms"] = bench(lambda fn=fn, q=q, k=k, v=v, sc=sc: fn(q, k, v, True, sc))

                def fb(fn=fn, q=q, k=k, v=v, do=do, sc=sc):
                    o, lse, bwd = fn(q, k, v, True, sc)
                    bwd(do, o, lse)
                rec["fwd_bwd_ms"] = bench(fb)
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit("time", **rec)
        # SDPA as a user calls it (enable_gqa), whatever backend it picks
        try:
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

            def sdpa_fb(qg=qg, kg=kg, vg=vg, do=do):
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
                o.backward(do)
            emit("time", kernel="F.sdpa", dqk=dqk, dv=dv, S=S, fwd_bwd_ms=bench(sdpa_fb))
        except Exception as e:
            emit("time", kernel="F.sdpa", dqk=dqk, dv=dv, S=S, error=f"{type(e).__name__}: {str(e)[:200]}")
        torch.cuda.empty_cache()


def _docs(total: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.LogNormal(0.0, 1.0).sample((n,)) if seed < 0 else torch.rand(n, generator=g) + 0.05
    lens = (w / w.sum() * total).long().clamp_min(1)
    lens[-1] += total - int(lens.sum())
    return [0, *torch.cumsum(lens, 0).tolist()]


def run_ragged() -> None:
    H, Hkv, D, T = 32, 8, 128, 131072
    cu_l = _docs(T, 63, 3)
    cu = torch.tensor(cu_l, dtype=torch.int32, device=dev)
    mx = max(b - a for a, b in itertools.pairwise(cu_l))
    torch.manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, Hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    sc = D ** -0.5

    def fa2():
        return aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=sc)

    def fa2_fb():
        o, lse, rng, unused, _ = fa2()
        aten._flash_attention_backward(do, q, k, v, o, lse, cu, cu, mx, mx, 0.0, True, rng, unused, scale=sc)

    def cud():
        return aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, True, 0.0, True, False, scale=sc)

    def cud_fb():
        r = cud()
        aten._cudnn_attention_backward(do, q, k, v, r[0], r[1], r[6], r[7], torch.empty(0, device=dev), cu, cu, mx,
                                       mx, 0.0, True, scale=sc)
    for name, f, fb in (("flash_varlen", fa2, fa2_fb), ("cudnn_ragged", cud, cud_fb)):
        rec = {"kernel": name, "T": T, "docs": len(cu_l) - 1}
        try:
            o = f()[0]
            o_ref = fa2()[0]
            rec["out_vs_fa2"] = rel(o, o_ref)
            rec["fwd_ms"] = bench(f)
            rec["fwd_bwd_ms"] = bench(fb)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        emit("ragged", **rec)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=None)
        return r[0]

    @staticmethod
    def backward(ctx, g):
        return g, None, None


@torch.library.custom_op("probe::attn", mutates_args=())
def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=None)
    return r[0], r[1]


@_op.register_fake
def _(q, k, v):
    return torch.empty_like(q), q.new_empty((*q.shape[:3], 1), dtype=torch.float32)


def run_host() -> None:
    torch.manual_seed(0)
    B, H, S, D = 1, 32, 1024, 128
    q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, 8, S, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ke, ve = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    calls = {
        "F.sdpa(enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "F.sdpa(MHA)": lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True),
        "aten cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False),
        "aten flash": lambda: aten._flash_attention_forward(t_(q), t_(k), t_(v), None, None, S, S, 0.0, True, False),
        "autograd.Function(aten cudnn)": lambda: _Fn.apply(q, k, v),
        "custom_op(aten cudnn)": lambda: _op(q, k, v),
        "empty tensor": lambda: torch.empty(16, device=dev),
    }
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        emit("host", call=name, host_us=(t1 - t0) / n * 1e6, wall_us=(t2 - t0) / n * 1e6)


def run_graph() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 32, 4096, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 4096, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)

    def step():
        o, lse, bwd = _cudnn(q, k, v, True, 128 ** -0.5)
        return bwd(do, o, lse)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = step()
        g.replay()
        torch.cuda.synchronize()
        eager = step()
        emit("graph", ok=True, replay_vs_eager=max(rel(a, b) for a, b in zip(outs, eager)))
    except Exception as e:
        emit("graph", ok=False, error=f"{type(e).__name__}: {str(e)[:300]}", tb=traceback.format_exc()[-500:])


def main() -> None:
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="caps,softcap,fold,host,graph,ragged,time")
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    emit("env", torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
         gpu=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability())
    for sec in args.sections.split(","):
        t0 = time.time()
        try:
            globals()[f"run_{sec}"]()
        except Exception as e:
            emit(sec, fatal=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"# section {sec}: {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
