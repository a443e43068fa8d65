"""``torchrun --nproc-per-node N -m seqpar.bench --preset table [--peers] [--scaling]``
``python -m seqpar.bench --emulate-world W --preset gqa-causal-16k`` (one process: rank r of W, Note [Emulated world])

For each preset, in one run: the single-GPU cuDNN kernel on the full sequence divided by N (the limit),
every seqpar method, and (``--peers``) ring-flash-attn, yunchang and PyTorch's context parallel through
``.peers/``. Timing: warm-up, CUDA events, median of several, the slowest rank; peak GPU memory per rank;
with ``--profile`` the exposed communication of each seqpar method from a profiler trace. A time is one call
from an idle GPU, every rank entering it at once after a barrier; with ``--steady`` a real group's records also
carry calls issued back to back, as a training step's layers issue them (``steady_ms``, ``steady_efficiency``;
the peers alike), where the ranks' skew at the call's first transfer is paid once per burst rather than once
per call. Records are appended as JSON lines as they are measured (a killed run keeps what it measured), then a
table and a PNG plot are written next to them.

Note [Emulated world]
    ``--emulate-world W`` runs ONE process as rank r of a W-rank group on torch's fake process group: every
    collective and transfer returns at once and moves nothing, everything else is real - the host work, the
    kernels at the true per-rank shapes, the merges, the stream waits, the memory. So the rank's time is what
    its compute path costs, an upper bound on what W real GPUs reach (fake W = 1 equals NCCL W = 1 within 3%).
    r is the busiest rank of each configuration (``--emulate-rank busiest``, from ``layouts.work``: for a
    layout that is not balanced rank 0 may be idle half the time); the group is re-created when r changes.
    Each record adds ``emulated_world``, ``emulated_rank``, ``tokens_per_rank``, ``compute_efficiency`` (the
    efficiency above, communication free), the host time of one call from an idle GPU, the GPU operations
    per call and the fraction of a call the GPU idles (``timing.call_profile``). Beside the time of a call from
    an idle GPU (host time before its first launch included), each record carries the steady state of calls
    issued back to back, as a training step's layers issue them (``timing.burst_ms``: three bursts of up to 10
    calls, fewer for calls of more than ``STEADY_BUDGET_MS`` / 30):
    ``steady_ms``, ``steady_compute_efficiency`` (or ``steady_predicted_efficiency``) and
    ``steady_gpu_idle_fraction`` = 1 - GPU busy time of one call / ``steady_ms``: near 0 when the host issues
    a call faster than the GPU runs it (the call is not host-bound), the host's excess when not. The limit is
    the one-GPU kernel's cold time either way. What it cannot see: NCCL's
    own use of SMs and memory bandwidth beside the kernels, link contention and latency, stragglers (no
    other rank exists), and any wait on a peer; values are garbage (nothing arrives), so nothing is checked -
    and a long call on never-written buffers runs faster than on data (power-bound: up to ~20% at 16K+ tokens
    per rank on an H100, ``benchmarks/gpu/probe_fake_data.py``; none at short chunks), so the caching allocator's
    pool is seeded with random data before each configuration (Note [Emulated data] in ``timing``).
    ``--link PROFILE`` gives seqpar's transfers the planner's time for their bytes (Note [Modelled link] in
    ``seqpar.comm.link``): the records then carry ``link`` and ``predicted_efficiency`` (a prediction of W
    GPUs) instead of ``compute_efficiency``.
"""


from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from .. import methods
from ..planner.search import AUTO_CHOICE
from ..planner.validate import is_auto
from .presets import MASKS, PRESETS, TABLE, MethodSpec, Preset, method_specs
from .report import console_table, load, plot, readme_table, steady_rows, suite_table
from .runners import limit_runner, ours_runner, peer_runners
from .suites import SUITES
from .timing import burst_ms, call_profile, exposed_comm_ms, free_cached, peak_mem_gib, reset_peak, time_ms

STEADY_BUDGET_MS = 200.0
"""About how long an emulated record's steady-state bursts take (at 128K tokens a call is 0.1 s, and at 2K per rank
well under a millisecond: only short calls can be host-bound)."""


GRAPHS = {"auto": None, "on": True, "off": False}
"""``--graphs``: the ``graphs=`` argument each seqpar configuration is called with (Note [Graphed calls])."""


def _args(argv):
    ap = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m seqpar.bench", description=__doc__)
    ap.add_argument("--preset", action="append", default=[],
                    help=f"preset name, 'table' (the performance table), 'all', a suite ({', '.join(SUITES)}, "
                         f"'inference': seqpar.bench.inference's small model); known presets: {', '.join(PRESETS)}")
    ap.add_argument("--peers", action="store_true", help="also time the peers (needs .peers/ on PYTHONPATH)")
    ap.add_argument("--methods", default="", help="comma-separated labels or method names to keep (default all)")
    ap.add_argument("--modes", default="", help="restrict modes, e.g. fwd+bwd")
    ap.add_argument("--scaling", action="store_true", help="strong (128K) and weak (32K/GPU) scaling on 1, 2, N GPUs")
    ap.add_argument("--profile", action="store_true", help="measure exposed communication of seqpar methods")
    ap.add_argument("--steady", action="store_true",
                    help="real groups: also time calls issued back to back, as a training step's layers issue them "
                         "(steady_ms, steady_efficiency; emulated runs always record them)")
    ap.add_argument("--warmup", type=int, default=6,
                    help="untimed calls first (auto graphs: warm-up, two timed eager, capture, two timed replays)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop starting new configurations after this")
    ap.add_argument("--out", default="benchmarks/results", help="directory for the JSONL, table and plot")
    ap.add_argument("--tag", default="", help="file name tag")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nccl-high-priority", type=int, default=1, help="NCCL on high-priority streams (1/0)")
    ap.add_argument("--small", action="store_true", help="suites at 1/64 of their sizes (a CPU smoke run)")
    ap.add_argument("--emulate-world", type=int, default=0,
                    help="one process as one rank of this many on a fake group (Note [Emulated world]); no torchrun")
    ap.add_argument("--emulate-rank", default="busiest", help="the emulated rank: an int, or 'busiest' per config")
    ap.add_argument("--link", default="",
                    help="emulation: model transfer times with this planner profile (a built-in name or a JSON "
                         "path; Note [Modelled link] in seqpar.comm.link): records predict W GPUs' efficiency")
    ap.add_argument("--check-ranks", action="store_true",
                    help="emulation: keep seqpar's agreement round on (default off, as the issue's protocol)")
    ap.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                    help="seqpar's graphs= for every configuration: auto (None, the default), on (True), off (False)")
    ap.add_argument("--cpu-gloo", action="store_true",
                    help="process group 'cpu:gloo,cuda:nccl' (seqpar's agreement round then needs no device sync)")
    return ap.parse_args(argv)


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)) if args.device == "cuda" else None)
        if args.device == "cuda":
            torch.cuda.set_device(self.device)
        self.emulated = args.emulate_world > 0
        self.link = None
        if args.link:
            from ..comm.link import Link
            self.link = Link(args.link)
        if self.emulated:
            self.emulate_as(0 if args.emulate_rank == "busiest" else int(args.emulate_rank))
        elif args.device == "cuda" and args.cpu_gloo:
            # CPU tensors (seqpar's per-call agreement round) on gloo, CUDA tensors on NCCL: no device sync
            dist.init_process_group("cpu:gloo,cuda:nccl")
        elif args.device == "cuda":
            # NCCL kernels on high-priority streams: otherwise a transfer posted beside a GPU-filling attention
            # kernel waits for free SMs and shows up as exposed communication (measured: 4.4 of 65 ms at 128K)
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = args.nccl_high_priority
            dist.init_process_group("nccl", pg_options=opts)
        else:
            dist.init_process_group("gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.t0 = time.monotonic()
        self.meta = self._meta()
        out = Path(args.out)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M")
        gpu = self.meta["gpu"].replace(" ", "_")
        name = f"{platform.node()}-{self.world}x{gpu}-{stamp}" + (f"-{args.tag}" if args.tag else "")
        self.path = out / f"{name}.jsonl"
        if self.rank == 0 or self.emulated:
            out.mkdir(parents=True, exist_ok=True)
        self.done = 0
        self.limits: dict[tuple, float] = {}

    def emulate_as(self, rank: int) -> None:
        """Become rank ``rank`` of the emulated world (a fresh fake group when it changes; Note [Emulated world])."""
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from . import runners, suites

        if dist.is_initialized():
            if dist.get_rank() == rank:
                return
            dist.destroy_process_group()
            runners.forget_meshes()
            suites.forget_groups()
        dist.init_process_group("fake", rank=rank, world_size=self.args.emulate_world, store=FakeStore())
        self.rank = rank

    def busiest(self, layout, seq_len: int, causal: bool, cu_seqlens=None, mask=None) -> int:
        """The rank to emulate for a configuration on ``layout`` (a name or a layout object): ``--emulate-rank``,
        or the rank with the most visible (query, key) pairs."""
        if self.args.emulate_rank != "busiest":
            return int(self.args.emulate_rank)
        from ..layouts import Rule, make_layout
        from ..layouts.work import work

        lay = make_layout(layout, self.world, cu_seqlens) if isinstance(layout, str) else layout
        per_rank = work(lay, seq_len, Rule(causal, mask=mask), cu_seqlens)
        return max(range(self.world), key=lambda r: (per_rank[r], -r))

    def rank_of(self, spec: MethodSpec, preset: Preset) -> int:
        """The rank to emulate for ``spec`` on ``preset``: ``--emulate-rank``; else rank 0 for Ulysses (every rank
        the same work), the method's own ``slowest_rank`` where it declares one (ranks with the same work but not
        the same calls), or the rank with the most work."""
        if self.args.emulate_rank != "busiest":
            return int(self.args.emulate_rank)
        if spec.method == "ulysses":
            return 0
        slowest = methods.get(spec.method).slowest_rank
        if slowest is not None and preset.mask is None:
            from ..layouts import Rule
            return slowest(spec.layout, self.world, preset.seq_len, Rule(preset.causal))
        return self.busiest(spec.layout, preset.seq_len, preset.causal, mask=preset.mask_mod())

    def emulation(self, seq_len: int, time_ms_: float | None, limit_ms: float | None, fn=None) -> dict:
        """The emulated-world fields of a record (empty on a real group); ``fn``: the timed call, profiled."""
        if not self.emulated:
            return {}
        rec = {"emulated_world": self.world, "emulated_rank": self.rank, "tokens_per_rank": seq_len // self.world,
               "check_ranks": self.args.check_ranks}
        if self.link is not None:
            rec["link"] = self.link.name
        if time_ms_ is not None and limit_ms is not None:
            # communication free, or with the modelled link a prediction of W GPUs (Note [Modelled link])
            rec["predicted_efficiency" if self.link is not None else "compute_efficiency"] = limit_ms / time_ms_
        if fn is not None and time_ms_ is not None:
            prof = call_profile(fn, self.device)
            rec.update(prof)
            steady = self.steady_ms(fn, time_ms_)
            rec["steady_ms"] = steady
            if limit_ms is not None:
                key = "steady_predicted_efficiency" if self.link is not None else "steady_compute_efficiency"
                rec[key] = limit_ms / steady
            if "gpu_busy_ms" in prof:
                rec["gpu_idle_fraction"] = max(0.0, 1.0 - prof["gpu_busy_ms"] / time_ms_)
                rec["steady_gpu_idle_fraction"] = max(0.0, 1.0 - prof["gpu_busy_ms"] / steady)
        return rec

    def steady_ms(self, fn, time_ms_: float, group=None) -> float:
        """Milliseconds a call of ``fn`` takes issued back to back (``timing.burst_ms``: three bursts of up to 10
        calls, fewer for calls of more than ``STEADY_BUDGET_MS`` / 30; the slowest rank's median on a real group)."""
        burst = max(1, min(10, int(STEADY_BUDGET_MS / 3 / max(time_ms_, 1e-3))))   # long calls: few
        return burst_ms({"call": fn}, self.device, burst=burst, rounds=3, warmup=1, group=group)["call"]

    def steady(self, fn, time_ms_: float | None, limit_ms: float, group=None) -> dict:
        """``--steady`` on a real group: a record's ``steady_ms`` and ``steady_efficiency`` (limit / steady_ms);
        empty otherwise (an emulated record carries its own, ``emulation``)."""
        if not self.args.steady or self.emulated or time_ms_ is None:
            return {}
        ms = self.steady_ms(fn, time_ms_, group)
        return {"steady_ms": ms, "steady_efficiency": limit_ms / ms}

    def _meta(self) -> dict:
        cuda = self.device.type == "cuda"
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
        launch = "python" if self.emulated else f"torchrun --nproc-per-node {self.world}"
        cmd = f"{launch} -m seqpar.bench " + shlex.join(sys.argv[1:])
        return {"host": platform.node(), "gpu": torch.cuda.get_device_name(self.device) if cuda else "cpu",
                "torch": torch.__version__, "nccl": nccl, "cudnn": torch.backends.cudnn.version() if cuda else None,
                "command": cmd, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "nccl_high_priority": bool(self.args.nccl_high_priority) if cuda and not self.args.cpu_gloo else None,
                "graphs": self.args.graphs,
                "backend": "fake" if self.emulated else (
                    "cpu:gloo,cuda:nccl" if self.args.cpu_gloo else ("nccl" if cuda else "gloo"))}

    @property
    def check_ranks(self) -> bool:
        """The agreement round: on for real groups; off when emulating unless ``--check-ranks``."""
        return not self.emulated or self.args.check_ranks

    @property
    def measures_limit(self) -> bool:
        """Whether this process times the single-GPU limit (rank 0 of a real group; the one emulated rank)."""
        return self.rank == 0 or self.emulated

    def log(self, msg: str) -> None:
        if self.measures_limit:
            print(f"[{time.monotonic() - self.t0:6.0f}s] {msg}", file=sys.stderr, flush=True)

    def over_budget(self) -> bool:
        return bool(self.args.budget_s) and time.monotonic() - self.t0 > self.args.budget_s

    def write(self, rec: dict) -> None:
        if self.measures_limit:
            with self.path.open("a") as f:
                f.write(json.dumps({**rec, **self.meta}) + "\n")

    def _agree(self, ok: bool, group=None) -> bool:
        """Whether every rank of ``group`` succeeded (so all take the same branch, never a hang)."""
        t = torch.tensor([1 if ok else 0], device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())

    def modes(self, preset: Preset) -> list[str]:
        want = [m for m in self.args.modes.split(",") if m]
        return [m for m in preset.modes if not want or m in want]

    # ------------------------------------------------------------------------------------------- limit
    def limit(self, preset: Preset, seq_len: int | None = None) -> dict[str, float]:
        """Single-GPU cuDNN time on the full sequence (rank 0 computes, the others wait)."""
        s = preset.seq_len if seq_len is None else seq_len
        key = (preset.name, s)
        if key in self.limits:
            return self.limits[key]
        measure_at = preset.limit_from or s
        res: dict[str, float] = {}
        runner = limit_runner(preset, self.device, measure_at) if self.measures_limit else None
        for mode in self.modes(preset):
            fn = runner[mode] if runner else (lambda: None)
            t = time_ms(fn, self.device, warmup=1, iters=3)
            res[mode] = t * (preset.flops(mode, s) / preset.flops(mode, measure_at))
            self.write({"preset": preset.name, "method": "limit:flex-1gpu" if preset.mask else "limit:cudnn-1gpu",
                        "mode": mode, "world_size": 1,
                        "seq_len": s, "time_ms": res[mode], "measured_at": measure_at})
        del runner
        self._free()
        self.limits[key] = res
        return res

    def _free(self) -> None:
        """Release what the last configuration cached; emulated, seed the pool the next one's buffers come from
        (Note [Emulated data] in ``timing``)."""
        free_cached(self.device, seed=self.emulated)

    # ------------------------------------------------------------------------------------------- one config
    def time_config(self, preset: Preset, label: str, build, limit: dict[str, float], *, profile: bool,
                    world: int | None = None, group=None, extra: dict | None = None) -> None:
        """Time ``build()``'s runner in each of the preset's modes and record it."""
        world = world or self.world
        modes = self.modes(preset)
        runner, err = None, None
        try:
            runner = build()
        except Exception as e:      # a peer that cannot run this preset: recorded, not fatal
            err = f"{type(e).__name__}: {e}"
        if not self._agree(err is None, group):
            err = err or "failed on another rank"
            for mode in modes:
                self._record(preset, label, mode, world, None, limit, err=err, extra=extra)
            return
        for mode in modes:
            reset_peak(self.device)
            try:
                t = time_ms(runner[mode], self.device, warmup=self.args.warmup, iters=self.args.iters, group=group)
                err = None
            except Exception as e:
                t, err = None, f"{type(e).__name__}: {str(e)[:300]}"
            if not self._agree(err is None, group):
                self._record(preset, label, mode, world, None, limit, err=err or "failed on another rank",
                             extra=extra)
                continue
            rec_extra = dict(extra or {})
            rec_extra["peak_mem_gib"] = peak_mem_gib(self.device, group)
            rec_extra.update(self.emulation(preset.seq_len, t, limit[mode] / world, runner[mode]))
            rec_extra.update(self.steady(runner[mode], t, limit[mode] / world, group))
            if profile and self.args.profile:
                comm, exposed, kernels = exposed_comm_ms(runner[mode], self.device)
                rec_extra.update(comm_ms=comm, exposed_comm_ms=exposed, kernel_ms=kernels)
            self._record(preset, label, mode, world, t, limit, extra=rec_extra)
        if "__exit__" in runner:
            runner["__exit__"]()
        del runner
        self._free()

    def _record(self, preset, label, mode, world, t, limit, *, err=None, extra=None) -> None:
        self.done += 1
        rec = {"preset": preset.name, "method": label, "mode": mode, "world_size": world,
               "time_ms": t, "limit_ms": limit[mode] / world, "heads": preset.heads, "kv_heads": preset.kv_heads,
               "seq_len": preset.seq_len, "head_dim": preset.head_dim, "causal": preset.causal,
               "mask": None if preset.mask is None else preset.mask[0], "mask_spec": preset.mask,
               "dtype": preset.dtype, "target": preset.targets.get(mode), "min_mem_gib": preset.min_mem_gib(world)}
        rec.update(extra or {})
        if t is not None:
            rec["efficiency"] = rec["limit_ms"] / t
        if err:
            rec["error"] = err
        self.write(rec)
        eff = f"eff {rec['efficiency']:.3f}" if t is not None else f"FAILED {err}"
        self.log(f"#{self.done} {preset.name} {label} {mode}: "
                 f"{'' if t is None else f'{t:.2f} ms '}{eff}")

    # ------------------------------------------------------------------------------------------- runs
    def run_preset(self, preset: Preset) -> None:
        self.log(f"preset {preset.name}: S={preset.seq_len} H={preset.heads}/{preset.kv_heads} "
                 f"causal={preset.causal} on {self.world} ranks")
        limit = self.limit(preset)
        keep = [m for m in self.args.methods.split(",") if m]
        specs = method_specs(preset, self.world, methods.available())
        listed = {s.label for s in specs}
        asked = [MethodSpec.parse(m, self.world) for m in keep if "/" in m and m not in listed and not is_auto(m)]
        specs += [a for a in asked if any(s.method == a.method for s in specs)]   # its method runs on this preset
        for spec in specs:
            if keep and spec.label not in keep and spec.method not in keep:
                continue
            if self.over_budget():
                self.log("budget reached: skipping the rest")
                return
            if self.emulated:       # Ulysses gives every rank the same work; the others follow their layout
                self.emulate_as(self.rank_of(spec, preset))
            self.time_config(preset, spec.label,
                             lambda s=spec: ours_runner(s, preset, self.device, check_ranks=self.check_ranks,
                                                         graphs=GRAPHS[self.args.graphs]), limit,
                             profile=True)
        if not keep or any(is_auto(m) for m in keep):
            self.time_auto(preset, limit)
        if self.args.peers and preset.mask is not None:
            self.log(f"peers: not run on {preset.name} (no peer takes a mask)")
        elif self.args.peers and self.device.type == "cuda":
            for label, factory in peer_runners(preset, self.device).items():
                if self.over_budget():
                    return
                if self.emulated:
                    self.emulate_as(self.busiest(_peer_layout(label), preset.seq_len, preset.causal))
                self.time_config(preset, label, factory, limit, profile=False)

    def time_auto(self, preset: Preset, limit: dict[str, float]) -> None:
        """``method="auto"`` on each layout a caller would shard by (zigzag and contiguous when causal, else
        contiguous), each record naming what auto ran (``auto_pick``, from the planner's log): Note [Auto rows]."""
        for layout in ("zigzag", "contiguous") if preset.causal else ("contiguous",):
            if self.over_budget():
                return
            if self.emulated:
                self.emulate_as(self.busiest(layout, preset.seq_len, preset.causal, mask=preset.mask_mod()))
            extra: dict = {}
            self.time_config(preset, f"auto/{layout}", lambda lay=layout, extra=extra: self._auto_runner(
                preset, lay, extra), limit, profile=False, extra=extra)

    def _auto_runner(self, preset: Preset, layout: str, extra: dict):
        """``ours_runner`` for ``method="auto"`` on ``layout``, whose first call in each mode records the pick."""
        runner = ours_runner(MethodSpec("auto", layout), preset, self.device, check_ranks=self.check_ranks,
                             graphs=GRAPHS[self.args.graphs])
        return {mode: self.watch_auto(fn, extra) for mode, fn in runner.items()}

    @staticmethod
    def watch_auto(fn, extra: dict):
        """``fn`` (a call of ``method="auto"``) whose first call records in ``extra["auto_pick"]`` the method auto
        ran (Note [Auto rows])."""
        picks, mine = _AutoPicks(), {}

        def call():                         # a mode's first call plans (and logs); later ones run as they are
            if mine:
                return fn()
            with picks:
                got = fn()
            mine["pick"] = extra["auto_pick"] = picks.last
            return got
        return call

    def run_scaling(self) -> None:
        """Strong: global 128K on 1, 2, N GPUs; weak: 32K per GPU. ring/zigzag and allgather/zigzag."""
        sizes = sorted({1, 2, self.world})
        groups = {n: (dist.new_group(list(range(n))) if n < self.world else None) for n in sizes}
        base = PRESETS["gqa-causal-128k"] if self.device.type == "cuda" else PRESETS["tiny-causal"]
        per_gpu = base.seq_len // 4
        specs = [MethodSpec("ring", "zigzag")] + \
            ([MethodSpec("allgather", "zigzag")] if "allgather" in methods.available() else [])
        for kind in ("strong", "weak"):
            for n in sizes:
                seq = base.seq_len if kind == "strong" else per_gpu * n
                preset = Preset(name=f"{kind}-{base.name}", heads=base.heads, kv_heads=base.kv_heads, seq_len=seq,
                                causal=True, head_dim=base.head_dim, dtype=base.dtype)
                limit = self.limit(preset)
                if self.rank >= n:
                    continue
                for spec in specs:
                    if self.over_budget():
                        return
                    g = groups[n]
                    self.time_config(preset, spec.label,
                                     lambda s=spec, g=g, p=preset: ours_runner(s, p, self.device, g),
                                     limit, profile=False, world=n, group=g, extra={"scaling": kind})
            dist.barrier()


def _peer_layout(label: str) -> str:
    """The token layout a peer configuration runs (to emulate its busiest rank): ring-flash-attn's ring and llama3
    and yunchang's basic ring are contiguous; PyTorch's CP balances (rank 0 stands for all)."""
    for name in ("zigzag", "stripe"):
        if name in label:
            return name
    balanced = "torch-cp" in label or ("/u" in label and "r1/" in label)     # Ulysses alone: every rank the same
    return "zigzag" if balanced else "contiguous"


def _select(names: list[str]) -> list[Preset]:
    out: list[str] = []
    for n in names or ["table"]:
        if n in SUITES or n == "inference":
            continue
        out += list(TABLE) if n == "table" else list(MASKS) if n == "masks" else (list(PRESETS) if n == "all" else [n])
    unknown = [n for n in out if n not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; known: {', '.join(PRESETS)}, table, all")
    return [PRESETS[n] for n in out]


class _AutoPicks(logging.Handler):
    """Inside ``with``: the last method ``method="auto"`` chose (``seqpar.planner`` logs each choice once, when the
    call is planned), e.g. "allgather" or "usp {'ulysses': 2}".

    Note [Auto rows]
        Every preset also times ``method="auto"`` through ``seqpar.attention`` as a user calls it, once per layout a
        user would shard by ("auto/zigzag", "auto/contiguous": auto never re-shards, so the layout bounds its
        choice - Ulysses takes contiguous tokens only; a packed row: contiguous, "balanced" and "balanced_whole",
        ``suites.PACKED_CONFIGS``); its records say which method auto ran, per mode (a
        forward and a training call are planned apart). In an emulated world auto plans with free transfers
        (Note [Auto on an emulated world] in ``seqpar.comm.link``), so its rows are the check that the best
        method is what auto picks. Only a mode's first call is watched (it plans); a pick of None means its plan
        was cached before the row began.
    """

    def __init__(self):
        super().__init__(logging.INFO)
        self.last: str | None = None
        self._log = logging.getLogger("seqpar.planner")
        self._level = self._log.level

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg is AUTO_CHOICE:
            method, options = record.args[:2]
            self.last = f"{method} {options}" if options else method

    def __enter__(self):
        self.last = None
        self._level = self._log.level
        self._log.setLevel(logging.INFO)
        self._log.addHandler(self)
        return self

    def __exit__(self, *exc):
        self._log.removeHandler(self)
        self._log.setLevel(self._level)


def _log_graph_decisions() -> None:
    """Auto's graph decisions (``seqpar.runtime`` at INFO), one line each, in the bench's log - once per process."""
    runtime_log = logging.getLogger("seqpar.runtime")
    runtime_log.setLevel(logging.INFO)
    if not any(getattr(h, "seqpar_bench", False) for h in runtime_log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.seqpar_bench = True
        runtime_log.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    presets = _select(args.preset)
    own = [n for n in args.preset if n in ("overhead", "heads", "inference")]
    if args.steady and own:
        raise SystemExit(f"--steady times the presets and the packed suite back to back; {', '.join(own)} cannot "
                         f"take it (the overhead and heads suites time calls back to back themselves, inference "
                         f"times its own steps): run them without --steady")
    if "RANK" not in os.environ and not args.emulate_world:
        raise SystemExit("launch with torchrun: torchrun --nproc-per-node N -m seqpar.bench ... (or emulate one rank: "
                         "python -m seqpar.bench --emulate-world W ...)")
    if args.link and not (args.emulate_world and args.device == "cuda"):
        raise SystemExit(f"--link {args.link!r} models transfers of an emulated world on CUDA (--emulate-world W, "
                         f"--device cuda); a real group's transfers take their own time")
    if args.link and args.peers:
        raise SystemExit(f"--link {args.link!r} models seqpar's transfers only (the peers call torch.distributed "
                         f"themselves, so theirs would stay free): run the peers without --link")
    if args.emulate_world and (args.scaling or "inference" in args.preset):
        raise SystemExit("--emulate-world times presets and suites; --scaling and the inference preset need a real "
                         "group")
    if "inference" in args.preset:
        from .inference import main as inference_main
        inference_main(["--out", str(Path(args.out) / "inference.jsonl"), "--baseline"])
        if set(args.preset) == {"inference"}:
            return 0
    bench = Bench(args)
    _log_graph_decisions()
    from ..comm.link import modelled
    with modelled(bench.link):
        for preset in presets:
            if bench.over_budget():
                break
            bench.run_preset(preset)
        for name in args.preset:
            if name in SUITES and not bench.over_budget():
                SUITES[name](bench)
    if args.scaling and not bench.over_budget():
        bench.run_scaling()
    dist.barrier()
    if bench.measures_limit and bench.path.exists():
        rows = load([bench.path])
        table = console_table(rows) + "\n\n" + suite_table(rows)
        print(table)
        readme = readme_table(rows)
        if args.steady and not bench.emulated:        # the same table for calls issued back to back
            readme += "\n\nCalls issued back to back (--steady):\n\n" + readme_table(steady_rows(rows))
        print()
        print(readme)
        bench.path.with_suffix(".md").write_text(table + "\n\n" + readme + "\n")
        msg = plot(rows, bench.path.with_suffix(".png"))
        print(msg or f"plot: {bench.path.with_suffix('.png')}")
        print(f"records: {bench.path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
