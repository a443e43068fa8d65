"""Benchmark suites that mean something at any world size, W = 1 included: ``--preset overhead|heads|packed``.

Every row times seqpar beside the single-GPU PyTorch kernel on the same work, in the same run:

overhead  per-call cost: ring, ulysses and allgather on ``S`` tokens per GPU (1K, 4K, 16K; GQA 32/8, head dim
          128, bf16, causal) against cuDNN SDPA on S tokens, forward and forward+backward: per call in bursts
          of back-to-back calls (as a model's layers run; the functions interleaved), per call from an idle
          GPU, the GPU kernel time of a call, and the host time of one steady-state forward call (the Python
          and launch time, measured without synchronising while the GPU drains a backlog). Targets: within
          max(3%, 20 us) of SDPA back to back; host time <= 60 us.
heads     head shapes: D in {64, 80, 96, 128, 192, 256} and (Dqk, Dv) = (192, 128), each with and without a
          gradient through lse, 16K tokens per GPU (GQA 32/8, bf16, causal), forward+backward, against the
          fastest of PyTorch's fused kernels on the same shape (F.sdpa with cuDNN or FA2), interleaved bursts,
          with each call's GPU kernel time and kernels. Target: <= 1.05x.
packed    packed training: rows of 128K and 1M tokens (``seqpar.layouts.packing``: lognormal and long-tail, fixed
          seeds) on zigzag and balanced layouts against the single-GPU varlen kernel (FA2 varlen) on the whole
          row divided by W; per-rank work max/mean; peak memory; the peers' varlen paths with ``--peers``.

Records are the benchmark's JSON lines (``preset``, ``method``, ``mode``, ``time_ms``, ``limit_ms``, ...) plus
suite fields (``host_us``, ``ratio``, ``work_max_over_mean``); a packed row's also carry ``packed``, ``row``,
``documents``, the shape (``heads``, ``kv_heads``, ``head_dim``, ``causal``) and what regenerates the row
(``distribution``, ``packing_seed``, ``packing_multiple``); its limit's, ``head_groups``.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import symmetric
from ..layouts import Rule, make_layout
from ..layouts.packing import DISTRIBUTIONS, SEED, packed_row
from ..layouts.work import work
from ..runtime import call as _call
from .timing import burst_ms, free_cached, kernel_ms, peak_mem_gib, reset_peak, time_ms

__all__ = ["SUITES", "forget_groups", "host_us", "run_heads", "run_overhead", "run_packed"]

aten = torch.ops.aten


def host_us(fn: Callable[[], object], n: int = 50) -> float:
    """Host microseconds per call of ``fn``: loops of ``n`` calls with no synchronisation inside (the GPU queue
    absorbs the launches; ``n`` stays far below the queue's depth so launches never wait for the GPU), the
    median of 7 loops, each started on a drained GPU."""
    for _ in range(20):
        fn()
    _sync()
    out = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        _sync()
    return sorted(out)[3]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _scaled(bench: Any, n: int) -> int:
    """``n`` tokens, or n / 64 with ``--small`` (a CPU smoke run of the suite's code)."""
    return n // 64 if bench.args.small else n


def _randn(shape, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, device=device, dtype=dtype, generator=g)


def _sdpa(q, k, v, backend):
    """F.sdpa with one backend on BSHD tensors (transposed views, as models call it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(backend if q.is_cuda else SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def _modes(fwd, bwd_out, inputs, grads):
    def fb():
        outs = bwd_out()
        return torch.autograd.grad(outs, inputs, grads)
    return {"fwd": lambda: _nograd(fwd), "fwd+bwd": fb}


def _nograd(fn):
    with torch.no_grad():
        return fn()


def run_overhead(bench: Any) -> None:
    """``--preset overhead`` (module docstring)."""

    _self_groups()
    for S in (1024, 4096, 16384):
        _overhead_at(bench, _scaled(bench, S))
        _empty_cache(bench)


def _overhead_at(bench: Any, S: int) -> None:
    from torch.nn.attention import SDPBackend

    import seqpar

    dev, W = bench.device, bench.world
    B, H, Hkv, D = 1, 32, 8, 128
    q, k, v = (_randn((B, S, h, D), dev, torch.bfloat16, i) for i, h in enumerate((H, Hkv, Hkv)))
    do = _randn((B, S, H, D), dev, torch.bfloat16, 9)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    preset = f"overhead-{S // 1024}k"
    runs = {"sdpa": _modes(lambda: _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION),
                           lambda: _sdpa(qg, kg, vg, SDPBackend.CUDNN_ATTENTION), (qg, kg, vg), do)}
    for method in OVERHEAD_METHODS:
        kw = {"method": method, "causal": True}
        runs[method] = _modes(lambda kw=kw: seqpar.attention(q, k, v, **kw),
                              lambda kw=kw: seqpar.attention(qg, kg, vg, **kw), (qg, kg, vg), do)
    host = {name: host_us(r["fwd"]) for name, r in runs.items()}
    for mode in ("fwd", "fwd+bwd"):
        fns = {name: r[mode] for name, r in runs.items()}
        steady = burst_ms(fns, dev)                               # back-to-back, as layers run in a step
        cold = {name: time_ms(fn, dev, warmup=3, iters=20) for name, fn in fns.items()}   # from an idle GPU
        for name, fn in fns.items():
            gpu = kernel_ms(fn, dev)
            t, limit = steady[name], steady["sdpa"]
            rec = {"preset": preset, "method": "sdpa:cudnn-1gpu" if name == "sdpa" else name, "mode": mode,
                   "world_size": 1 if name == "sdpa" else W, "seq_len": S if name == "sdpa" else S * W,
                   "time_ms": t, "cold_ms": cold[name], "host_us": host[name] if mode == "fwd" else None,
                   "gpu_ms": None if gpu is None else gpu[0], "kernels": None if gpu is None else gpu[1]}
            if name != "sdpa":
                rec.update(limit_ms=limit, ratio=t / limit, within_target=t <= max(limit * 1.03, limit + 0.020),
                           host_within_target=None if mode != "fwd" else host[name] <= 60.0)
            bench.write(rec)
            gpu_note = "" if gpu is None else f", kernels {gpu[0]:.3f} ms"
            host_note = f", host {host[name]:.1f} us" if mode == "fwd" else ""
            bench.log(f"{preset} {name} {mode}: {t:.3f} ms per call back to back ({t / limit:.3f}x SDPA), "
                      f"{cold[name]:.3f} ms from idle{gpu_note}{host_note}")


OVERHEAD_METHODS = ("ring", "ulysses", "allgather")


HEAD_SHAPES = ((64, 64), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))


def run_heads(bench: Any) -> None:
    """``--preset heads`` (module docstring)."""

    _self_groups()
    for dqk, dv in HEAD_SHAPES:
        _heads_at(bench, dqk, dv)
        _empty_cache(bench)


def _heads_at(bench: Any, dqk: int, dv: int) -> None:
    from torch.nn.attention import SDPBackend

    import seqpar

    dev, W = bench.device, bench.world
    S, B, H, Hkv = _scaled(bench, 16384), 1, 32, 8
    preset = f"heads-{dqk}" + (f"-v{dv}" if dv != dqk else "")
    q, k = _randn((B, S, H, dqk), dev, torch.bfloat16, 1), _randn((B, S, Hkv, dqk), dev, torch.bfloat16, 2)
    v, do = _randn((B, S, Hkv, dv), dev, torch.bfloat16, 3), _randn((B, S, H, dv), dev, torch.bfloat16, 4)
    dlse = _randn((B, H, S), dev, torch.float32, 5)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fns: dict[str, Callable[[], object]] = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def sd(backend=backend):
            return torch.autograd.grad(_sdpa(qg, kg, vg, backend), (qg, kg, vg), do)
        err = None
        try:
            sd()
        except Exception as e:                    # a backend that does not serve the shape
            err = f"{type(e).__name__}: {str(e)[:100]}"
        if bench._agree(err is None):
            fns[f"sdpa:{name}-1gpu"] = sd
        else:
            bench.log(f"{preset} sdpa:{name}: {err or 'failed on another rank'}")

    def ring(lse_grad: bool):
        if lse_grad:
            out, lse = seqpar.attention(qg, kg, vg, method="ring", return_lse=True)
            return torch.autograd.grad((out, lse), (qg, kg, vg), (do, dlse))
        return torch.autograd.grad(seqpar.attention(qg, kg, vg, method="ring"), (qg, kg, vg), do)
    fns["ring"] = functools.partial(ring, False)
    fns["ring+lse_grad"] = functools.partial(ring, True)
    reset_peak(dev)
    times = burst_ms(fns, dev, burst=2, rounds=5, warmup=2)       # interleaved: clocks drift alike for all
    peak = peak_mem_gib(dev)
    base = {name: t for name, t in times.items() if name.startswith("sdpa:")}
    fastest = min(base, key=base.get)
    best = base[fastest]
    for name, t in times.items():
        gpu = kernel_ms(fns[name], dev, calls=2)
        rec = {"preset": preset, "method": name, "mode": "fwd+bwd", "world_size": 1 if name in base else W,
               "seq_len": S if name in base else S * W, "head_dim": dqk, "value_dim": dv, "time_ms": t,
               "gpu_ms": None if gpu is None else gpu[0], "kernels": None if gpu is None else gpu[1]}
        if name not in base:
            rec.update(limit_ms=best, fastest_pytorch=fastest, ratio=t / best, within_target=t <= 1.05 * best,
                       peak_mem_gib=peak)
        bench.write(rec)
        bench.log(f"{preset} {name}: {t:.2f} ms ({t / best:.3f}x {fastest})"
                  + ("" if gpu is None else f", kernels {gpu[0]:.2f} ms: {'; '.join(gpu[1][:3])}"))


def run_packed(bench: Any) -> None:
    """``--preset packed`` (module docstring)."""

    _self_groups()
    for total in (32768, 131072) if bench.emulated else (131072, 1 << 20):
        for dist_name in DISTRIBUTIONS:
            _packed_at(bench, _scaled(bench, total), dist_name)


def _wanted(arg: str) -> list[str]:
    """The names a comma-separated ``--methods`` / ``--modes`` keeps (empty: all)."""
    return [m for m in arg.split(",") if m]


def _mode(mode: str, call: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          do: torch.Tensor) -> Callable[[], object]:
    """The timed function of one packed row's ``mode``, holding only that mode's tensors (no copies): at 1M
    tokens on one GPU, both modes' inputs at once would not fit beside the backward's."""
    if mode == "fwd":
        del do
        return lambda: _nograd(lambda: call(q, k, v))
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(call(*leaves), leaves, do)


PACKED_CONFIGS = (("ring", "zigzag"), ("ring", "balanced"), ("ring", "balanced_whole"), ("allgather", "zigzag"),
                  ("allgather", "balanced"), ("allgather", "balanced_whole"), ("ulysses", "contiguous"),
                  ("auto", "contiguous"), ("auto", "balanced"), ("auto", "balanced_whole"))
"""The packed suite's rows: each method on the layouts it takes packed, and ``method="auto"`` on each layout a
caller would shard a packed batch by, its record naming what auto ran (Note [Auto rows])."""


def packed_configs() -> list[tuple[str, str, tuple[tuple[str, Any], ...]]]:
    """``PACKED_CONFIGS`` as ``(method, layout, options)``; where the default group could move hops on copy engines
    (NCCL on CUDA: Note [Copy-engine ring] in ``seqpar.comm.symmetric``), the balanced rings that way too."""
    out = [(m, lay, ()) for m, lay in PACKED_CONFIGS]
    if symmetric.usable():
        out += [("ring", lay, (("transport", "copy_engine"),)) for lay in ("balanced", "balanced_whole")]
    return out


def _packed_at(bench: Any, total: int, dist_name: str) -> None:
    import seqpar

    dev, W = bench.device, bench.world
    H, Hkv, D = 32, 8, 128
    cu = packed_row(total, dist_name, seed=SEED, multiple=2 * W)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    preset = f"packed-{total // 1024}k-{dist_name}"
    limit = _varlen_limit(bench, total, cu, H, Hkv, D)
    # what a record needs to be read back alone: the shape, and the row (``packed_row`` regenerates it exactly)
    shape = {"heads": H, "kv_heads": Hkv, "head_dim": D, "causal": True, "distribution": dist_name,
             "packing_seed": SEED, "packing_multiple": 2 * W}
    keep = _wanted(bench.args.methods)
    for method, layout, options in packed_configs():
        label = "/".join([method, layout, *(f"{k}{v}" for k, v in options)])
        if keep and method not in keep and f"{method}/{layout}" not in keep and label not in keep:
            continue
        where = {"method": method, "layout": layout, "cu_seqlens": cu}
        imbalance = 1.0                                 # Ulysses: every rank sees every token of its heads
        if method != "ulysses":
            per_rank = work(make_layout(layout, W, cu), total, Rule(True), cu)
            imbalance = max(per_rank) * W / max(sum(per_rank), 1)
        if bench.emulated:                              # time the busiest rank (Note [Emulated world])
            bench.emulate_as(0 if method == "ulysses" else bench.busiest(make_layout(layout, W, cu), total, True, cu))
        extra = {"work_max_over_mean": imbalance, "documents": len(cu) - 1, "packed": True, "row": preset,
                 "seq_len": total, **shape}

        def build(mode: str, where=where, extra=extra, options=options):
            full = [_randn((1, total, h, D), dev, torch.bfloat16, i) for i, h in enumerate((H, Hkv, Hkv, H))]
            q, k, v, do = (seqpar.shard(t, **where) for t in full)
            del full
            kw = {"method": where["method"], "layout": where["layout"], "cu_seqlens": cu_t,
                  "check_ranks": W == 1 and bench.check_ranks, **dict(options)}
            fn = _mode(mode, lambda q, k, v: seqpar.attention(q, k, v, **kw), q, k, v, do)
            return bench.watch_auto(fn, extra) if where["method"] == "auto" else fn
        _time_rows(bench, preset, label, build, limit, extra)
    if bench.args.peers:
        for label, factory in _peer_varlen(bench, total, cu, H, Hkv, D).items():
            if keep and label not in keep:
                continue
            if bench.emulated:                          # its busiest rank: llama3 cuts the row contiguously
                lay = "doc_zigzag" if "zigzag" in label else "contiguous"
                bench.emulate_as(bench.busiest(make_layout(lay, W, cu), total, True, cu))
            _time_rows(bench, preset, label, factory, limit, {"documents": len(cu) - 1, "packed": True, "row": preset,
                                                              "seq_len": total, **shape})


LIMIT_HEAD_GROUPS = (1, 2, 4, 8)
"""Head groups the single-GPU varlen limit may be timed in when the whole call does not fit (Note [The limit in head
groups])."""
LIMIT_MEMORY_FRACTION = 0.9
"""Of the GPU's free memory, what the limit's call may be estimated to take (``limit_bytes``)."""


def limit_bytes(total: int, H: int, Hkv: int, D: int) -> int:
    """Bytes FA2's varlen forward+backward holds on ``total`` tokens in bf16 (Note [The limit in head groups]): q, dO,
    out, dQ and GQA's expanded dK and dV per query head, K, V, dK and dV per KV head, and the fp32 dQ accumulator."""
    return total * D * (2 * (6 * H + 4 * Hkv) + 4 * H)


def limit_head_groups(total: int, H: int, Hkv: int, D: int, free_bytes: int | None) -> int:
    """The least head group count of ``LIMIT_HEAD_GROUPS`` (dividing both head counts) whose call fits
    ``LIMIT_MEMORY_FRACTION`` of ``free_bytes`` (None: no bound, one group); raises MemoryError where none does."""
    if free_bytes is None:
        return 1
    tries = [g for g in LIMIT_HEAD_GROUPS if H % g == 0 and Hkv % g == 0]
    for g in tries:
        if limit_bytes(total, H // g, Hkv // g, D) <= LIMIT_MEMORY_FRACTION * free_bytes:
            return g
    need = limit_bytes(total, H, Hkv, D) / 2**30
    raise MemoryError(f"the single-GPU varlen limit on {total} tokens needs {need:.1f} GiB in one call and no head "
                      f"group of {tries} fits {free_bytes / 2**30:.1f} GiB free")


def _varlen_limit(bench: Any, total: int, cu: tuple[int, ...], H: int, Hkv: int, D: int) -> dict[str, float]:
    """The single-GPU FA2 varlen kernel on the whole row (rank 0 times it, every rank gets it), per mode.

    Note [The limit in head groups]
        FA2's varlen backward on a 1M-token row with 32 / 8 heads of 128 needs about 77 GB with its inputs
        (``limit_bytes``), so on an 80 GB GPU the packed suite's 1M row stopped at its own yardstick (four H100s,
        2026-11-26 and 2026-11-27). Heads are independent and every head of a row costs the same, so the limit is
        the same call on H / g query and Hkv / g KV heads, run g times back to back, for the least g of
        ``LIMIT_HEAD_GROUPS`` whose estimate fits the free memory: one GPU doing the row's whole work, one head
        group at a time. Records name g (``head_groups``). g is chosen by the estimate, not by catching an
        out-of-memory error: a first version tried the whole call and retried on OOM, which on one H100 (pool
        seeded) ran 16 heads after 32 ran out, but on four H100s (a real group) left the context broken - an
        illegal memory access reported at the next ``empty_cache`` - so no call is launched that may not fit."""
    res: dict[str, float] = {}
    groups = 1
    if bench.measures_limit:
        # the earlier rows' plans hold graph pools: FA2's varlen backward at 1M tokens needs most of an 80 GB GPU
        # (it ran out of memory after the 128K rows on 4 H100s, 2026-11-26)
        _call.cache_clear()
        _empty_cache(bench)
        free = torch.cuda.mem_get_info(bench.device)[0] if bench.device.type == "cuda" else None
        groups = limit_head_groups(total, H, Hkv, D, free)
        res = _time_limit(bench, total, cu, H // groups, Hkv // groups, D, groups)
        _empty_cache(bench)
    res = res if bench.emulated else _broadcast(res, bench.device)   # emulated: measured here (no peers)
    for mode, t in res.items():
        bench.write({"preset": f"packed-{total // 1024}k", "method": "limit:fa2-varlen-1gpu", "mode": mode,
                     "world_size": 1, "seq_len": total, "time_ms": t, "documents": len(cu) - 1,
                     "head_groups": groups})
    return res


def _time_limit(bench: Any, total: int, cu: tuple[int, ...], H: int, Hkv: int, D: int, groups: int
                ) -> dict[str, float]:
    """Per mode, the ms of ``groups`` back-to-back varlen calls on the row with H query and Hkv KV heads."""
    dev = bench.device
    q, k, v, do = (_randn((total, h, D), dev, torch.bfloat16, i) for i, h in enumerate((H, Hkv, Hkv, H)))
    cu_d = torch.tensor(cu, dtype=torch.int32, device=dev)
    mx = max(b - a for a, b in itertools.pairwise(cu))
    tot = cu[-1]
    q, k, v, do = q[:tot], k[:tot], v[:tot], do[:tot]

    def fwd():
        return aten._flash_attention_forward(q, k, v, cu_d, cu_d, mx, mx, 0.0, True, False)

    def fb():
        o, lse, rng, unused, _ = fwd()
        return aten._flash_attention_backward(do, q, k, v, o, lse, cu_d, cu_d, mx, mx, 0.0, True, rng, unused)
    if dev.type != "cuda":                 # a CPU smoke run: the reference kernel's varlen path
        fwd, fb = _reference_varlen(q, k, v, do, cu)
    want = _wanted(bench.args.modes)
    res = {}
    for mode, fn in (("fwd", fwd), ("fwd+bwd", fb)):
        if not want or mode in want:
            def run(fn=fn):
                for _ in range(groups):
                    fn()
            res[mode] = time_ms(run, dev, warmup=2, iters=5, group=_self_group())
    return res


def _reference_varlen(q, k, v, do, cu):
    from ..kernels import KERNELS
    from ..masks import Varlen

    mask, ref = Varlen(cu, cu, (-1, 0)), KERNELS["reference"]
    q4, k4, v4, do4 = (t.unsqueeze(0) for t in (q, k, v, do))

    def fwd():
        return ref.forward(q4, k4, v4, mask, q.shape[-1] ** -0.5)

    def fb():
        o, lse = fwd()
        return ref.backward(do4, q4, k4, v4, o, lse, mask, q.shape[-1] ** -0.5)
    return fwd, fb


def _peer_varlen(bench: Any, total: int, cu: tuple[int, ...], H: int, Hkv: int, D: int) -> dict[str, Callable]:
    """ring-flash-attn's varlen paths on the same row: zigzag varlen (per-document zigzag) and llama3."""
    from .runners import _rfa

    dev, W = bench.device, bench.world           # the rank is read when a runner is built (emulation moves it)
    out: dict[str, Callable] = {}

    def inputs(layout: str):
        """This rank's rows (T, H, D) of the row in ring-flash-attn's sharding of ``layout``."""
        full = [_randn((total, h, D), dev, torch.bfloat16, i) for i, h in enumerate((H, Hkv, Hkv, H))]
        idx = make_layout(layout, W, cu).positions(bench.rank, total, dev)
        return [t.index_select(0, idx) for t in full]

    def zigzag(mode: str):
        rfa = _rfa()
        q, k, v, do = inputs("doc_zigzag")
        local = torch.tensor(cu, dtype=torch.int32, device=dev) // W
        mx = max(b - a for a, b in itertools.pairwise(cu)) // W

        def call(q, k, v):
            return rfa.zigzag_ring_flash_attn_varlen_func(q, k, v, local, mx, causal=True)
        return _mode(mode, call, q, k, v, do)

    def llama3(mode: str):
        rfa = _rfa()
        q, k, v, do = inputs("contiguous")
        cq, ck, mq, mk, sl = rfa.llama3_flash_attn_prepare_cu_seqlens(
            torch.tensor(cu, dtype=torch.int32, device=dev), True, bench.rank, W)

        def call(q, k, v):
            return rfa.llama3_flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, heads_k_stride=1, local_k_slice=sl,
                                                     causal=True)
        return _mode(mode, call, q, k, v, do)
    out["peer:ring-flash-attn/zigzag-varlen"] = zigzag
    out["peer:ring-flash-attn/llama3-varlen"] = llama3
    return out


_SELF: list = []


def _self_groups() -> None:
    """One group per rank holding that rank alone (collective: every rank calls it at a suite's start), so rank 0
    can time the single-GPU limit with barriers of its own."""
    if dist.is_initialized() and dist.get_world_size() > 1 and not _SELF:
        _SELF.extend(dist.new_group([r]) for r in range(dist.get_world_size()))


def forget_groups() -> None:
    """Drop the one-rank groups (the process group they were made on is gone)."""
    _SELF.clear()


def _empty_cache(bench: Any) -> None:
    """Release what the last row cached; emulated, seed the pool (Note [Emulated data] in ``timing``)."""
    free_cached(bench.device, seed=bench.emulated)


def _self_group():
    return _SELF[dist.get_rank()] if _SELF else None


def _time_rows(bench: Any, preset: str, label: str, build: Callable[[str], Callable], limit: dict[str, float],
               extra: dict) -> None:
    """Per mode: build the timed function on every rank (``build(mode)``), time it (the slowest rank's median),
    record it against ``limit``, and free it before the next mode."""
    W = bench.world
    want = _wanted(bench.args.modes)
    for mode in limit:
        if want and mode not in want:
            continue
        reset_peak(bench.device)
        t = None
        try:
            fn, err = build(mode), None
        except Exception as e:                  # recorded, never fatal: a peer that cannot run this row
            fn, err = None, f"{type(e).__name__}: {str(e)[:300]}"
        emulation: dict = {}
        if bench._agree(err is None):           # every rank built it: time it (collectives inside)
            try:
                t = time_ms(fn, bench.device, warmup=bench.args.warmup, iters=5)
                emulation = {**bench.emulation(extra.get("seq_len", 0), t, limit[mode] / W, fn),
                             **bench.steady(fn, t, limit[mode] / W)}
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:300]}"
        fn = None
        _empty_cache(bench)
        if not bench._agree(err is None):
            bench.write({"preset": preset, "method": label, "mode": mode, "world_size": W,
                         "error": err or "failed on another rank", **extra})
            continue
        lim = limit[mode] / W
        bench.write({"preset": preset, "method": label, "mode": mode, "world_size": W, "time_ms": t,
                     "limit_ms": lim, "efficiency": lim / t, "peak_mem_gib": peak_mem_gib(bench.device), **extra,
                     **emulation})
        bench.log(f"{preset} {label} {mode}: {t:.2f} ms, efficiency {lim / t:.3f} vs 1-GPU varlen")


def _broadcast(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Rank 0's dict of floats on every rank (the limit is timed on one GPU)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    obj = [values]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


SUITES = {"overhead": run_overhead, "heads": run_heads, "packed": run_packed}
