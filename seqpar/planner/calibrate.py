"""Measure this host - kernel throughput, link bandwidth, latency, overlap loss, HBM - into a Profile.

    torchrun --nproc-per-node 4 -m seqpar.calibrate --out h200.json        # GPUs, NCCL (~1 minute)
    torchrun --nproc-per-node 2 -m seqpar.calibrate --device cpu           # CPU, gloo
    python -m seqpar.calibrate --device cpu --spawn 2                      # CPU without torchrun

Every rank measures the same list of things in the same order; the numbers are reduced with MAX across
ranks (the slowest rank sets a step's pace), so every rank ends with the identical profile and rank 0
writes it. Kernels are measured through ``seqpar.kernels.select`` - the kernels the methods run - on
square full and causal calls; links with the calls the methods make (``seqpar.comm.ring.Exchange`` for
P2P rings and all-pairs rounds, ``all_to_all_single``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``).

Derived quantities:
- ``alpha_us``: one P2P ring step of 4 KiB (launch + synchronisation).
- ``launch_us``: one kernel call on a tiny block.
- ``merge_passes``: a call's merge as the runtime runs it (``combine.merge_parts`` of 4 partials, Note [One merge
  per call]) per merged step (3 of the 4), in fp32 passes over a step's rows (Note [Merge share] in ``measured``).
- overlap loss δ: ``(T(kernel || transfer) - max(T_kernel, T_transfer)) / min(...)``, for P2P and a2a.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..comm import symmetric
from ..comm.ring import Exchange, Ring
from ..cost.profile import PATTERNS, Curve, KernelRate, LinkRate, Profile
from ..errors import UnsupportedInputError
from ..kernels import KernelCall, combine, select
from ..masks import Band

__all__ = ["Settings", "main", "measure", "settings_for"]

KiB, MiB = 1 << 10, 1 << 20
_MASKS = {"full": Band(), "causal": Band(None, 0)}
_MERGE_PARTS = 4          # partials merged per timed call (the model charges all but the first: Note [Merge share])
# torch >= 2.13 renames the tensor collectives (same signatures); older releases only have the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Settings:
    """What to measure. ``settings_for(device)`` gives the defaults (GPU: under a minute)."""

    device: str
    dtype: str
    heads: int
    head_dim: int
    tokens: tuple[int, ...]
    kernels: tuple[str, ...]
    link_bytes: tuple[int, ...]
    warmup: int = 2
    reps: int = 5
    name: str = ""
    note: str = ""
    """Appended to the profile's ``source`` (e.g. what else was running)."""


def settings_for(device: str, quick: bool = False) -> Settings:
    """Default measurement plan for "cuda" (bf16, 32 heads, D=128) or "cpu" (fp32, tiny)."""
    if device == "cuda":
        tokens = (2048, 8192) if quick else (1024, 2048, 4096, 8192, 16384, 32768)
        sizes = (4 * MiB, 64 * MiB) if quick else (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 512 * MiB)
        return Settings("cuda", "bfloat16", 32, 128, tokens, ("cudnn", "flash"), sizes)
    tokens = (64, 128) if quick else (128, 256, 512, 1024)
    sizes = (16 * KiB, 256 * KiB) if quick else (16 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
    return Settings("cpu", "float32", 4, 32, tokens, ("reference",), sizes, warmup=1, reps=3 if quick else 5)


class _Clock:
    """Median wall time of a callable, device-synchronised."""

    def __init__(self, device: str, warmup: int, reps: int):
        self.cuda = device == "cuda"
        self.warmup, self.reps = warmup, reps

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], object], group_sync: bool = False) -> float:
        times = []
        for i in range(self.warmup + self.reps):
            if group_sync:
                dist.barrier()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i >= self.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _kernel_times(s: Settings, clock: _Clock, dev: torch.device) -> dict[str, float]:
    """``{"kernel/mask/dir/tokens": ms}`` for every kernel that serves; absent kernels are skipped."""
    dt = getattr(torch, s.dtype)
    out: dict[str, float] = {}
    for name in s.kernels:
        for mask_name, mask in _MASKS.items():
            call = KernelCall(dev.type, dt, s.head_dim, s.heads, s.heads, mask_name)
            try:
                kern = select(name, call)
            except UnsupportedInputError:
                continue
            for n in s.tokens:
                fwd, bwd = _time_kernel(kern, s, n, mask, dev, clock)
                out[f"{name}/{mask_name}/fwd/{n}"], out[f"{name}/{mask_name}/bwd/{n}"] = fwd, bwd
    return out


Post = Callable[[], Callable[[], object]]


def _time_kernel(kern, s: Settings, n: int, mask: Band, dev: torch.device, clock: _Clock) -> tuple[float, float]:
    """(forward ms, backward ms) of one square call of n tokens."""
    dt = getattr(torch, s.dtype)
    q, k, v, do = (torch.randn(1, n, s.heads, s.head_dim, device=dev, dtype=dt) for _ in range(4))
    scale = s.head_dim ** -0.5
    res = kern.forward(q, k, v, mask, scale)
    o = res.out.to(dt)
    fwd = clock.ms(lambda: kern.forward(q, k, v, mask, scale))
    bwd = clock.ms(lambda: kern.backward(do, q, k, v, o, res.lse, mask, scale))
    return fwd, bwd


def _link_post(pattern: str, nbytes: int, group: dist.ProcessGroup | None, dev: torch.device) -> Post:
    """A function that posts one ``pattern`` transfer of ``nbytes`` per rank and returns its wait."""
    W = dist.get_world_size(group)
    n = max(1, nbytes // 4)
    ring = Ring(group)
    if pattern == "p2p":
        a, b = torch.empty(n, device=dev), torch.empty(n, device=dev)
        return lambda: ring.send_recv(a, b).commit().wait
    if pattern == "p2p_copy":              # copy engines (Note [Copy-engine ring]): NCCL groups on CUDA only
        if dev.type != "cuda" or not symmetric.usable(group):
            return _unsupported("copy engines need CUDA tensors on an NCCL group")
        copy = Ring(group, "copy_engine")
        a = torch.empty(n, device=dev)
        b = copy.buffers([((n,), torch.float32)], dev, "calibrate")[0]
        return lambda: copy.send_recv(a, b).commit().wait
    if pattern == "p2p_bidir":
        a, b, c, d = (torch.empty(max(1, n // 2), device=dev) for _ in range(4))
        return lambda: ring.send_recv(c, d, hops=-1, exchange=ring.send_recv(a, b)).commit().wait
    per = max(1, n // (W - 1))
    if pattern == "a2a":
        a, b = torch.empty(per * W, device=dev), torch.empty(per * W, device=dev)
        return lambda: dist.all_to_all_single(b, a, group=group, async_op=True).wait
    if pattern == "allgather":
        a, b = torch.empty(per, device=dev), torch.empty(per * W, device=dev)
        return lambda: _ALL_GATHER(b, a, group=group, async_op=True).wait
    if pattern == "reduce_scatter":
        a, b = torch.empty(per * W, device=dev), torch.empty(per, device=dev)
        return lambda: _REDUCE_SCATTER(b, a, group=group, async_op=True).wait
    if pattern == "allpairs":
        sends = [torch.empty(per, device=dev) for _ in range(W)]
        recvs = [torch.empty(per, device=dev) for _ in range(W)]

        def allpairs() -> Callable[[], object]:
            ex = Exchange(group)
            for d in range(1, W):
                ex.send(sends[d], ring.peer(d)).recv(recvs[d], ring.peer(-d))
            return ex.commit().wait
        return allpairs
    raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")


def _unsupported(why: str) -> Post:
    """A post this backend cannot make: it raises when called (``_supported`` reads that as absent)."""
    def post() -> Callable[[], object]:
        raise NotImplementedError(why)
    return post


def _supported(post: Post) -> bool:
    try:
        post()()
        return True
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def _link_times(s: Settings, clock: _Clock, dev: torch.device) -> dict[str, float]:
    out: dict[str, float] = {}
    for pattern in PATTERNS:
        for nbytes in s.link_bytes:
            post = _link_post(pattern, nbytes, None, dev)
            if not _supported(post):        # a collective this backend lacks (the same on every rank)
                break
            out[f"{pattern}/{nbytes}"] = clock.ms(lambda p=post: p()(), group_sync=True)
    small = _link_post("p2p", 4 * KiB, None, dev)
    out["alpha"] = clock.ms(lambda: small()(), group_sync=True)
    return out


def _extras(s: Settings, clock: _Clock, dev: torch.device, kern_name: str) -> dict[str, float]:
    dt = getattr(torch, s.dtype)
    out: dict[str, float] = {}
    big = torch.empty(_copy_elems(s.device), device=dev)
    dst = torch.empty_like(big)
    out["copy"] = clock.ms(lambda: dst.copy_(big))
    n = s.tokens[-1]
    shape = (1, n, s.heads, s.head_dim)
    parts = [(slice(0, n), torch.randn(shape, device=dev).to(dt), torch.randn(1, s.heads, n, device=dev))
             for _ in range(_MERGE_PARTS)]
    out["merge"] = clock.ms(lambda: combine.merge_parts(parts, shape, dt))
    call = KernelCall(dev.type, dt, s.head_dim, s.heads, s.heads, "causal")
    kern = select(kern_name, call)
    tiny = torch.randn(1, 128, 1, s.head_dim, device=dev, dtype=dt)
    out["launch"] = clock.ms(lambda: kern.forward(tiny, tiny, tiny, _MASKS["causal"], 1.0))
    m = s.tokens[len(s.tokens) // 2]
    q = torch.randn(1, m, s.heads, s.head_dim, device=dev, dtype=dt)
    for pattern in ("p2p", "a2a"):
        post = _link_post(pattern, s.link_bytes[-1], None, dev)
        t_k = clock.ms(lambda: kern.forward(q, q, q, _MASKS["causal"], 1.0))
        t_c = clock.ms(lambda p=post: p()(), group_sync=True)
        t_both = clock.ms(lambda p=post: _together(p, lambda: kern.forward(q, q, q, _MASKS["causal"], 1.0)),
                          group_sync=True)
        out[f"overlap/{pattern}"] = max(0.0, t_both - max(t_k, t_c)) / max(1e-9, min(t_k, t_c))
    return out


def _copy_elems(device: str) -> int:
    return ((256 if device == "cuda" else 16) * MiB) // 4


def _together(post: Post, kernel: Callable[[], object]) -> None:
    """The transfer in flight while the kernel runs: post, compute, then wait."""
    wait = post()
    kernel()
    wait()


def _reduce_max(values: dict[str, float], dev: torch.device) -> dict[str, float]:
    """The same keys on every rank (sorted); each value the max over ranks."""
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=dev)
    n = torch.tensor([len(keys)], device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    if int(n.item()) != len(keys):
        raise RuntimeError(f"calibration measured {len(keys)} items on rank {dist.get_rank()} but {int(n.item())} "
                           "on another rank; ranks must be identical devices")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def measure(s: Settings) -> Profile:
    """Run the measurements on every rank of the default group; returns the identical profile everywhere."""
    if not dist.is_initialized():
        raise RuntimeError("calibration needs an initialised process group (torchrun, or --spawn N)")
    if dist.get_world_size() < 2:
        raise ValueError(f"calibration needs at least 2 ranks to measure links, got {dist.get_world_size()}")
    dev = torch.device("cuda", torch.cuda.current_device()) if s.device == "cuda" else torch.device("cpu")
    clock = _Clock(s.device, s.warmup, s.reps)
    vals = _kernel_times(s, clock, dev)
    if not vals:
        raise UnsupportedInputError(f"no kernel of {list(s.kernels)} serves {s.device} {s.dtype} "
                                    f"head_dim={s.head_dim}", {})
    default = select("auto", KernelCall(dev.type, getattr(torch, s.dtype), s.head_dim, s.heads, s.heads,
                                        "causal")).name
    measured = sorted({k.split("/")[0] for k in vals})
    vals.update(_link_times(s, clock, dev))
    vals.update(_extras(s, clock, dev, default if default in measured else measured[0]))
    vals = _reduce_max(vals, dev)
    return _profile(s, vals, default if default in measured else measured[0], dev)


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a slow CPU rate is 1e-4 TFLOP/s: fixed decimals would round it to 0)."""
    return float(f"{x:.4g}")


def _profile(s: Settings, v: dict[str, float], default: str, dev: torch.device) -> Profile:
    world = dist.get_world_size()
    rates = []
    for key in sorted({k.rsplit("/", 1)[0] for k in v if k.count("/") == 3}):
        kernel, mask, direction = key.split("/")
        pts = []
        for n in s.tokens:
            if f"{key}/{n}" in v:
                pairs = n * (n + 1) / 2 if mask == "causal" else n * n
                flops = 4.0 * pairs * s.heads * s.head_dim * (2.5 if direction == "bwd" else 1.0)
                pts.append((n, _sig(flops / (v[f"{key}/{n}"] * 1e-3) / 1e12)))
        rates.append(KernelRate(kernel, mask, direction, Curve.of(pts)))
    links = []
    for pattern in PATTERNS:
        pts = [(m, _sig(m / (v[f"{pattern}/{m}"] * 1e-3) / 1e9)) for m in s.link_bytes if f"{pattern}/{m}" in v]
        if pts:
            links.append(LinkRate(pattern, Curve.of(pts)))
    copy_bytes = _copy_elems(s.device) * 4
    hbm = 2 * copy_bytes / (v["copy"] * 1e-3) / 1e9
    acc_bytes = s.tokens[-1] * s.heads * s.head_dim * 4
    passes = v["merge"] * 1e-3 * hbm * 1e9 / ((_MERGE_PARTS - 1) * acc_bytes)
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(dev)
        gpu, mem, node = props.name, props.total_memory / 2**30, torch.cuda.device_count()
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        inter = f"NCCL {nccl}"
    else:
        gpu, node, nccl, inter = platform.processor() or platform.machine(), 1024, "", "gloo"
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world
    host = socket.gethostname()
    return Profile(
        name=s.name or f"{host}-{s.device}", device=s.device, gpu=gpu, gpus_per_node=node, interconnect=inter,
        dtype=s.dtype, head_dim=s.head_dim, default_kernel=default, kernels=tuple(rates), links=tuple(links),
        alpha_us=round(v["alpha"] * 1e3, 2), launch_us=round(v["launch"] * 1e3, 2), hbm_gbps=round(hbm, 1),
        merge_passes=round(passes, 2),
        overlap_loss=tuple(sorted((p, round(min(1.0, v[f"overlap/{p}"]), 3)) for p in ("p2p", "a2a"))),
        memory_gib=round(mem, 1),
        source=f"measured by python -m seqpar.calibrate on {world} ranks of {host}" + (f"; {s.note}" if s.note else ""),
        meta=(("command", "python -m seqpar.calibrate " + shlex.join(sys.argv[1:])), ("host", host),
              ("nccl", nccl), ("settings", str(asdict(s))), ("torch", torch.__version__),
              ("world", str(world))))


def _spawned(s: Settings) -> dict:
    return measure(s).to_dict()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m seqpar.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="profile JSON to write (default: seqpar_profile_<host>_<device>.json)")
    ap.add_argument("--name", default="", help="profile name (default: <host>-<device>)")
    ap.add_argument("--spawn", type=int, default=0, help="start N local ranks instead of running under torchrun")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and sizes (a smoke test)")
    ap.add_argument("--note", default="", help="a remark stored in the profile's source")
    args = ap.parse_args(argv)
    s = settings_for(args.device, args.quick)
    s = Settings(**{**asdict(s), "name": args.name, "note": args.note})
    out = args.out or f"seqpar_profile_{socket.gethostname()}_{args.device}.json"
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.spawn:
        from ..pool import ProcessPool

        with ProcessPool(args.spawn, backend=backend, timeout=900) as pool:
            prof = Profile.from_dict(pool.run(_spawned, s)[0])
    elif "WORLD_SIZE" in os.environ:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            prof = measure(s)
        finally:
            rank = dist.get_rank()
            dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        ap.error("run under torchrun (torchrun --nproc-per-node N -m seqpar.calibrate) or pass --spawn N")
    prof.save(out)
    print(f"wrote {out}: {prof.name}, default kernel {prof.default_kernel}, alpha {prof.alpha_us} us, "
          f"HBM {prof.hbm_gbps} GB/s, links {[lk.pattern for lk in prof.links]}")
    return 0
