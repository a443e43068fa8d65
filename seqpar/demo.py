"""``python -m seqpar demo``: every available method and layout, checked against the dense oracle.

Without a launcher it spawns 4 CPU processes on gloo; under ``torchrun --nproc-per-node N -m seqpar demo`` it
runs on the launcher's world (NCCL and bf16 on GPUs). Prints one row per case - method, layout, world size,
forward / backward max error and the limit, pass/fail, time - and exits non-zero if any case fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

from . import methods
from .testing.cases import Case, check_case, run_case
from .testing.linear_cases import LinearCase, check_linear_case, run_linear_case

__all__ = ["demo_cases", "main"]


def demo_cases(world: int, device: str, seq_len: int = 1024) -> list[Case]:
    """The demo's problems: a realistic small GQA attention (8/2 heads, D = 64; S = ``seq_len`` on CPU, 256 per
    GPU on CUDA), with the rows every registered method declares (``Method.demo_cases``), in registry order."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    seq = 256 * world if device == "cuda" else seq_len
    base = Case(seq_len=seq, heads=8, kv_heads=2, head_dim=64, dtype=dtype, device=device,
                kernel="auto", seed=1)
    cases = []
    for name in methods.available():
        declared = methods.get(name).demo_cases
        if declared is not None:
            cases += [base.with_(method=name, **fields) for fields in declared(world, seq, _documents(seq))]
    return cases


def linear_cases(world: int, device: str, seq_len: int = 1024) -> list[LinearCase]:
    """Linear attention (LASP-2 with per-token and per-dimension gates, LASP-1 as the baseline), on half the
    softmax rows' length (its fp64 recurrent oracle is the demo's slowest part)."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    n = seq_len // 2
    base = LinearCase(seq_len=n, heads=4, k_dim=32, v_dim=32, dtype=dtype, chunk_size=min(64, max(16, n // 8)),
                      device=device, seed=1)
    return [base.with_(method="lasp2", layout="contiguous", gate="scalar"),
            base.with_(method="lasp2", layout="zigzag", gate="dim"),
            base.with_(method="lasp1", layout="contiguous", gate="const")]


def _documents(seq: int) -> tuple[int, ...]:
    """Packed documents of uneven lengths, some spanning ranks, one of length 1 (what a row may pack)."""
    cuts = [0, seq // 16, seq // 16 + 1, seq // 3, (seq * 5) // 8, seq]
    return tuple(cuts)


def _judge(case: Case | LinearCase, results: list[Any]) -> Any:
    """The report of one case; a case that raised (on any rank) is a failure with its message, not a crash."""
    from .testing.cases import Report
    from .testing.linear_cases import LinearReport

    errors = [r for r in results if isinstance(r, str)]
    linear = isinstance(case, LinearCase)
    if errors:
        rep = LinearReport(case) if linear else Report(case)
        rep.problems.append(errors[0].strip().splitlines()[-1][:300])
        return rep
    return check_linear_case(case, results) if linear else check_case(case, results)


def _errors(rep) -> tuple[float, float, float, float] | None:
    """(forward error, its limit, backward error, its limit) of a softmax or linear report."""
    if hasattr(rep, "verdicts"):
        if not rep.verdicts:
            return None
        fwd, bwd = ("out", "lse"), ("dq", "dk", "dv")
        return (rep.max_error(fwd), max(rep.verdicts[f].limit for f in fwd),
                rep.max_error(bwd), max(rep.verdicts[f].limit for f in bwd))
    if not rep.errors:
        return None
    fwd = [f for f in ("out", "final") if f in rep.errors]
    bwd = [f for f in rep.errors if f not in fwd]
    return (max(rep.errors[f] for f in fwd), max(rep.limits[f] for f in fwd),
            max(rep.errors[f] for f in bwd), max(rep.limits[f] for f in bwd))


def _row(rep, world: int) -> list[str]:
    c = rep.case
    if isinstance(c, LinearCase):
        what, extra, times = f"{c.method} (linear)", f"gate {c.gate}", "-"
    else:
        what = c.method + (f" U{c.ulysses}" if c.ulysses else "") + "".join(f" {k}={v}" for k, v in c.options)
        extra = "docs" if c.cu_seqlens else (f"window {c.window[0]}" if c.window != (-1, -1) else
                                             ("causal" if c.causal else "full"))
        times = f"{rep.times[0] * 1e3:.0f} / {rep.times[1] * 1e3:.0f}"
    errs = _errors(rep)
    if errs is None:
        return [what, c.layout, extra, str(world), "-", "-", "FAIL", "-"]
    fwd, lim_f, bwd, lim_b = errs
    return [what, c.layout, extra, str(world), f"{fwd:.1e} / {lim_f:.0e}", f"{bwd:.1e} / {lim_b:.0e}",
            "PASS" if rep.ok else "FAIL", times]


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    return "\n".join(lines + [fmt.format(*r) for r in rows])


HEADER = ["method", "layout", "mask", "W", "fwd err / limit", "bwd err / limit", "result", "fwd / bwd ms"]


def _spawned(world: int, seq_len: int) -> list[Any]:
    from .pool import ProcessPool, WorkerError

    with ProcessPool(world, timeout=600, threads=max(1, (os.cpu_count() or 2) // world)) as pool:
        reports = []
        for case in [*demo_cases(world, "cpu", seq_len), *linear_cases(world, "cpu", seq_len)]:
            fn = run_linear_case if isinstance(case, LinearCase) else run_case
            try:
                results: list[Any] = pool.run(fn, case)
            except WorkerError as e:
                results = [str(e)]
            reports.append(_judge(case, results))
        return reports


def _launched() -> list[Any] | None:
    """Under torchrun: run every case on the launcher's world; rank 0 judges. Returns None off rank 0."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    reports = []
    dev = "cuda" if cuda else "cpu"
    for case in [*demo_cases(world, dev), *linear_cases(world, dev)]:
        fn = run_linear_case if isinstance(case, LinearCase) else run_case
        try:                    # validation errors are raised on every rank before any collective
            local: Any = fn(case)
        except Exception as e:  # reported as a failed row; the other cases still run
            local = f"{type(e).__name__}: {e}"
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, local)
        if rank == 0:
            reports.append(_judge(case, gathered))
    dist.destroy_process_group()
    return reports if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpar demo", description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="processes to spawn without a launcher (default 4)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="global length of the softmax rows without a launcher (default 1024; smaller is faster)")
    args = parser.parse_args(argv)
    if args.seq_len < 16 * args.world or args.seq_len % (2 * args.world):
        parser.error(f"--seq-len must be a multiple of 2 x --world = {2 * args.world} and at least {16 * args.world}, "
                     f"got {args.seq_len}")
    t0 = time.perf_counter()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else args.world
    reports = _launched() if launched else _spawned(world, args.seq_len)
    if reports is None:
        return 0
    print(_table([_row(r, world) for r in reports], HEADER))
    failed = [r for r in reports if not r.ok]
    for r in failed:
        print(r, file=sys.stderr)
    dev = "GPU (NCCL)" if launched and torch.cuda.is_available() else "CPU (gloo)"
    print(f"\n{len(reports) - len(failed)}/{len(reports)} passed on {world} {dev} processes against the dense "
          f"fp64 oracle in {time.perf_counter() - t0:.1f} s  (errors: max |x - ref| / max |ref|)")
    return 1 if failed else 0
