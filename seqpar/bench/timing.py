"""Timing as the device method says: warm-up, device events, median of several, the slowest rank.

``time_ms(fn)`` runs ``fn`` ``warmup`` times, then ``iters`` times between CUDA events (host clock on CPU),
each iteration preceded by a barrier so ranks start together, and returns the median of the slowest rank: a
call that starts on an idle GPU, host time before its first launch included.
``burst_ms(fns)`` times several functions side by side, as a training step runs them: bursts of back-to-back
calls between events, the functions interleaved round by round so clocks and neighbours drift alike for all.
``kernel_ms(fn)`` is the GPU kernel time of one call (from a profile), without the host.
``exposed_comm_ms(fn)`` profiles one call and measures how much of the communication kernels' time no
compute kernel overlapped.
``call_profile(fn)`` is what an emulated rank reports besides its time: host time of one call, GPU operations
per call and the GPU's busy time inside it.
``back_to_back_ms(fn)`` is the host time a call takes launched back to back, and the wall time a call once the
device has caught up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["SEED_FRACTION", "back_to_back_ms", "burst_ms", "call_profile", "exposed_comm_ms", "free_cached",
           "host_profile", "kernel_ms", "peak_mem_gib", "rank_median_ms", "reset_peak", "sync_warnings", "time_ms"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rank_median_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, iters: int = 5,
                   group: dist.ProcessGroup | None = None) -> float:
    """Median milliseconds per call of ``fn`` on this rank (each iteration after a barrier of ``group``)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if dist.is_initialized():
            dist.barrier(group=group)
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, iters: int = 5,
            group: dist.ProcessGroup | None = None) -> float:
    """Median milliseconds per call of ``fn``; across ranks, the slowest rank's median."""
    med = rank_median_ms(fn, device, warmup=warmup, iters=iters, group=group)
    if dist.is_initialized():
        t = torch.tensor([med], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        med = float(t.item())
    return med


def burst_ms(fns: dict[str, Callable[[], object]], device: torch.device, *, burst: int = 10, rounds: int = 7,
             warmup: int = 3, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Median milliseconds per call of each function in bursts of ``burst`` back-to-back calls, the functions
    interleaved round by round (every rank runs every function; the slowest rank's median)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if dist.is_initialized():
                dist.barrier(group=group)
            _sync(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(burst):
                    fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / burst)
            else:
                t0 = time.perf_counter()
                for _ in range(burst):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e3 / burst)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    if dist.is_initialized():
        t = torch.tensor(list(med.values()), dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        med = dict(zip(med, t.tolist()))
    return med


def kernel_ms(fn: Callable[[], object], device: torch.device, *, calls: int = 5) -> tuple[float, list[str]] | None:
    """GPU kernel milliseconds per call of ``fn`` (the sum of its kernels' durations, from a profile of ``calls``
    calls) and its kernels' names, longest first; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    per: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() > 0:
            per[ev.name] = per.get(ev.name, 0.0) + ev.time_range.elapsed_us() / 1e3 / calls
    names = sorted(per, key=per.get, reverse=True)
    return sum(per.values()), [f"{n[:80]} {per[n] * 1e3:.1f}us" for n in names[:6]]


def call_profile(fn: Callable[[], object], device: torch.device, *, calls: int = 5) -> dict[str, float]:
    """Per call of ``fn`` from an idle device: host milliseconds until it returns (Python and launches; the median
    of ``calls``), and on CUDA the GPU operations it runs (kernels, copies, memsets) and their busy time (the union
    of their intervals, from one profiled call). ``1 - busy / time`` is the fraction of a call the GPU idles."""
    fn()
    _sync(device)
    host = []
    for _ in range(calls):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    res = {"host_ms_per_call": statistics.median(host)}
    if device.type != "cuda":
        return res
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    spans = [(ev.time_range.start / 1e3, ev.time_range.end / 1e3) for ev in prof.events()
             if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.elapsed_us() > 0]
    res["gpu_ops_per_call"] = len(spans)
    res["gpu_busy_ms"] = _length(_union(spans))
    return res


SEED_FRACTION = 0.9
"""Of the free GPU memory, the part ``free_cached(seed=True)`` fills with random data (Note [Emulated data])."""


def free_cached(device: torch.device, seed: bool = False) -> None:
    """Return the caching allocator's free blocks to the driver; with ``seed``, then fill ``SEED_FRACTION`` of the
    free memory with normal samples in one block and free it into the allocator's pool (Note [Emulated data]).

    Note [Emulated data]
        A fake group moves nothing, so an emulated rank computes every step but its own on whatever its receive
        buffers held - on a fresh block, zeros. A long attention call is power-bound on an H100 and runs faster
        on such data: cuDNN at 32K tokens (GQA, causal) took 12.0-12.3 ms forward on zeros or a never-written
        buffer against 14.9 ms on random data (``benchmarks/gpu/probe_fake_data.py``), and the emulated 128K rows
        read 1.04-1.22 of the one-GPU kernel (``benchmarks/results/2026-11-26-4xh100-real-sixteenth``). Seeded,
        the blocks that later buffers are carved from hold random bf16 values (the caching allocator splits its
        free block rather than asking the driver again), so received data looks like data. Before a
        configuration is built, so peak memory and timing do not see it."""
    if device.type != "cuda":
        return
    torch.cuda.empty_cache()
    if seed:
        free, _ = torch.cuda.mem_get_info(device)
        block = torch.empty(int(free * SEED_FRACTION) // 2, dtype=torch.bfloat16, device=device)
        block.normal_()
        del block
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_gib(device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """Peak allocated GiB since the last ``reset_peak``; the largest over ranks."""
    if device.type != "cuda":
        return 0.0
    t = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_comm_ms(fn: Callable[[], object], device: torch.device) -> tuple[float, float, dict[str, float]]:
    """``(communication kernel time, the part no compute kernel overlapped, ms per kernel class)`` of one call.

    From a profiler trace of this rank's GPU kernels: NCCL kernels are communication, every other kernel is
    compute; time is the union of their intervals. The breakdown sums kernel time by class (attention,
    nccl, elementwise/merge, copy, other) to show where a method spends its time.
    """
    if device.type != "cuda":
        return 0.0, 0.0, {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    comm, comp = [], []
    classes: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.time_range.elapsed_us() <= 0:
            continue
        span = (ev.time_range.start / 1e3, ev.time_range.end / 1e3)
        (comm if "nccl" in ev.name.lower() else comp).append(span)
        cls = _kernel_class(ev.name)
        classes[cls] = classes.get(cls, 0.0) + (span[1] - span[0])
    c, k = _union(comm), _union(comp)
    return _length(c), _length(c) - _intersect(c, k), {n: round(t, 3) for n, t in sorted(classes.items())}


def _kernel_class(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if any(w in n for w in ("flash", "fmha", "cudnn", "sdpa", "attention", "cutlass", "sm90", "triton_tem")):
        return "attention"
    if "copy" in n or "memcpy" in n or "cat" in n:
        return "copy"
    if "elementwise" in n or "reduce" in n or "triton_poi" in n or "triton_red" in n:
        return "elementwise"
    return "other"


def back_to_back_ms(fn: Callable[[], object], device: torch.device, *, calls: int = 20) -> tuple[float, float]:
    """``(host, wall)`` milliseconds a call over ``calls`` calls launched back to back from a synchronised device:
    the host's time to launch them, and the time until the device has run them all."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    _sync(device)
    return host, (time.perf_counter() - t0) / calls * 1e3


def host_profile(fn: Callable[[], object], device: torch.device, *, calls: int = 20):
    """cProfile of ``calls`` calls of ``fn`` (the device synchronised around them): a ``pstats.Stats``, where the
    host's time goes by Python function."""
    import cProfile
    import pstats

    _sync(device)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    _sync(device)
    return pstats.Stats(pr)


def sync_warnings(fn: Callable[[], object]) -> list[str]:
    """The messages ``torch.cuda.set_sync_debug_mode("warn")`` gives while ``fn()`` runs: one per synchronizing CUDA
    call (and PyTorch's note that the mode is a prototype)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message) for w in seen]
