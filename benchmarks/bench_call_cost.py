"""What a call costs beyond its kernels, on CPU (gloo): the three figures of the hot-path issue.

1. A steady-state call on a tiny problem at W = 1 (one gloo process): ``seqpar.attention`` (ring, ulysses,
   allgather; B 1, S 128, GQA 4/2, D 16, fp32, causal) against ``F.scaled_dot_product_attention`` with
   ``enable_gqa=True`` on the same tensors. Median of 300 calls after 30 warm-up calls, forward (no grad) and
   forward+backward. Target: <= 3x SDPA.
2. Packed batches at W = 4 (four gloo processes): ``method="ring"`` on 1000 documents in a 32K-token row
   (2 heads, 1 KV head, D 8: tiny kernels, so the per-call cost shows), a call whose ``cu_seqlens`` are new
   every time (20 distinct seeded batches, each used once, inputs sharded beforehand) against a call that
   repeats one batch. Median forward time of the slowest rank, zigzag and balanced layouts.
   Target: new <= 1.3x cached.
3. ``torch._dynamo.explain`` of a block that calls ``seqpar.attention`` (W = 1): graph breaks. Target: 0.

    python benchmarks/bench_call_cost.py --out benchmarks/results/call-cost-$(date +%F).txt
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import seqpar


def _median_ms(fn, warmup: int, iters: int, group=None) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tiny_calls() -> list[tuple[str, str, float, float]]:
    """``(method, mode, seqpar ms, sdpa ms)`` at W = 1 (this process holds a one-rank gloo group)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 128, h, 16, generator=g) for h in (4, 2, 2))

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=True).transpose(1, 2)
    rows = []
    for method in ("ring", "ulysses", "allgather"):
        layout = "contiguous" if method == "ulysses" else None
        ours = {"fwd": lambda m=method, lay=layout: _nograd(lambda: seqpar.attention(q, k, v, method=m, layout=lay)),
                "fwd+bwd": lambda m=method, lay=layout: _fb(lambda a, b, c: seqpar.attention(a, b, c, method=m,
                                                                                           layout=lay), q, k, v)}
        ref = {"fwd": lambda: _nograd(lambda: sdpa(q, k, v)), "fwd+bwd": lambda: _fb(sdpa, q, k, v)}
        for mode in ("fwd", "fwd+bwd"):
            rows.append((method, mode, _median_ms(ours[mode], 30, 300), _median_ms(ref[mode], 30, 300)))
    return rows


def _nograd(fn):
    with torch.no_grad():
        return fn()


def _fb(fn, q, k, v):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fn(*leaves).sum().backward()


def _packed_batch(seed: int, total: int, docs: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: docs - 1] + 1
    return (0, *sorted(int(c) for c in cuts), total)


def _packed_worker(rank: int, world: int, init: str, total: int, docs: int, fresh: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, total, h, 8, generator=g) for h in (2, 1, 1))
    lines = []
    for layout in ("zigzag", "balanced"):
        batches = [_packed_batch(1000 + i, total, docs) for i in range(fresh + 1)]

        def sharded(cu, layout=layout):
            where = {"method": "ring", "layout": layout, "cu_seqlens": cu}
            return [seqpar.shard(t, **where) for t in (q, k, v)], torch.tensor(cu, dtype=torch.int32)
        inputs = [sharded(cu) for cu in batches]

        def call(i, layout=layout, inputs=inputs):
            (ql, kl, vl), cu = inputs[i]
            with torch.no_grad():
                seqpar.attention(ql, kl, vl, method="ring", layout=layout, cu_seqlens=cu)
        cached = _median_ms(lambda: call(0), 3, 15, group=dist.group.WORLD)
        it = iter(range(1, fresh + 1))
        new = _median_ms(lambda it=it: call(next(it)), 0, fresh, group=dist.group.WORLD)
        t = torch.tensor([cached, new], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        lines.append((layout, float(t[0]), float(t[1])))
    if rank == 0:
        torch.save(lines, out)
    dist.destroy_process_group()


def packed_calls(total: int = 32768, docs: int = 1000, fresh: int = 20, world: int = 4) -> list:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "packed.pt")
        mp.spawn(_packed_worker, args=(world, f"file://{os.path.join(d, 'init')}", total, docs, fresh, out),
                 nprocs=world, join=True)
        return torch.load(out)


def graph_breaks() -> tuple[int, list[str]]:
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 64)

        def forward(self, x):
            q, k, v = self.qkv(x).view(1, x.shape[1], 8, 8).split([4, 2, 2], dim=2)
            return seqpar.attention(q.contiguous(), k.contiguous(), v.contiguous(), method="ring").sum()

    torch._dynamo.reset()
    e = torch._dynamo.explain(Block())(torch.randn(1, 64, 32))
    return e.graph_break_count, [str(b.reason) for b in e.break_reasons]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        tiny = tiny_calls()
        breaks, reasons = graph_breaks()
        dist.destroy_process_group()
    packed = packed_calls()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"seqpar per-call cost on CPU (gloo), {datetime.datetime.now():%Y-%m-%d %H:%M:%S}",
             f"host: {platform.node()} ({platform.machine()}, {os.cpu_count()} cpus), python "
             f"{platform.python_version()}, torch {torch.__version__}, seqpar commit {commit}",
             f"command: python {' '.join(sys.argv)}", "",
             "1. tiny steady-state call, W = 1 (B 1, S 128, GQA 4/2, D 16, fp32, causal), median of 300",
             f"   {'method':10} {'mode':8} {'seqpar ms':>10} {'sdpa ms':>8} {'ratio':>6}  target <= 3x"]
    for method, mode, ours, ref in tiny:
        lines.append(f"   {method:10} {mode:8} {ours:10.3f} {ref:8.3f} {ours / ref:6.2f}  "
                     f"{'met' if ours <= 3 * ref else 'MISSED'}")
    lines += ["", "2. packed row, W = 4, ring: 1000 documents in 32K tokens (2/1 heads, D 8), forward, slowest rank",
              f"   {'layout':10} {'cached ms':>10} {'new ms':>8} {'ratio':>6}  target <= 1.3x"]
    for layout, cached, new in packed:
        lines.append(f"   {layout:10} {cached:10.2f} {new:8.2f} {new / cached:6.2f}  "
                     f"{'met' if new <= 1.3 * cached else 'MISSED'}")
    lines += ["", f"3. torch._dynamo.explain of a block calling seqpar.attention: {breaks} graph breaks "
              f"(target 0: {'met' if breaks == 0 else 'MISSED'}){''.join(chr(10) + '   ' + r for r in reasons)}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
