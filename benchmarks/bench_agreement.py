"""Cost of the agreement round (Note [Cost of the round] in seqpar/agreement.py) and of verify mode, on gloo.

    python benchmarks/bench_agreement.py --worlds 2 4 --out benchmarks/results/agreement-$(date +%F).txt

Per world size, on a spawned gloo pool (one thread per rank): the round alone (``agreement.check`` with a
repeated signature: the digest is cached, the all-reduce always runs), the signature build + digest
without the collective, a tiny ring attention call (forward) with and without ``check_ranks``, and one
``seqpar.verify`` of that call. Medians over repeats, microseconds per call, printed and written with the
host, the versions and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure(repeats: int) -> dict[str, float]:
    """Worker side: every timing of one rank (all ranks run the same calls in the same order)."""
    import seqpar
    from seqpar import agreement
    from seqpar.config import AttentionConfig
    from seqpar.groups import SeqParallelGroups

    W = dist.get_world_size()
    q = torch.randn(1, 256 // W, 8, 64)
    k, v = torch.randn(1, 256 // W, 2, 64), torch.randn(1, 256 // W, 2, 64)
    cfg = AttentionConfig(method="ring", layout="zigzag", cu_seqlens=tuple(range(0, 257, 32)))
    groups = SeqParallelGroups.resolve(None)
    items = agreement.attention_signature(q, k, v, cfg, groups, return_lse=False, verify=False)
    res = {"round (all-reduce of 4 int64)": _median_us(lambda: agreement.check(items, None), repeats),
           "signature + digest (no collective)": _median_us(
               lambda: agreement.digest(agreement.attention_signature(q, k, v, cfg, groups, return_lse=False,
                                                                      verify=False)), repeats)}
    with torch.no_grad():
        def call(check: bool):
            return lambda: seqpar.attention(q, k, v, kernel="reference", check_ranks=check)
        res["ring attention fwd, check_ranks=True"] = _median_us(call(True), repeats)
        res["ring attention fwd, check_ranks=False"] = _median_us(call(False), repeats)
        out = seqpar.attention(q, k, v, kernel="reference")
        res["verify (2 heads x 256 rows)"] = _median_us(lambda: seqpar.verify(q, k, v, out), max(repeats // 10, 3))
    return res


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from seqpar.testing import ProcessPool

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lines = [f"seqpar agreement/verify cost on gloo, {time.strftime('%Y-%m-%d %H:%M:%S')}",
             f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} cpus, load average "
             f"{os.getloadavg()[0]:.1f}), python {platform.python_version()}, torch {torch.__version__}",
             f"command: python benchmarks/bench_agreement.py {' '.join(sys.argv[1:] if argv is None else argv)}",
             "ring call: q (1, 256/W, 8, 64), kv heads 2, zigzag, causal, reference kernel, forward only",
             "median microseconds per call, the slowest rank", ""]
    for world in args.worlds:
        with ProcessPool(world, timeout=900) as pool:
            per_rank = pool.run(measure, args.repeats)
        lines.append(f"W={world}")
        for key in per_rank[0]:
            lines.append(f"  {key:42s} {max(r[key] for r in per_rank):10.1f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
