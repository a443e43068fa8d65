"""Host time of planning under named masks (CPU only): the block planner, the all-gather's reads, the cost model.

    python benchmarks/planning_host_time.py --out DIR

One JSON line per measurement in DIR/planning_host_time.jsonl (host, CPU count, torch, commit, wall seconds):

- ``block plan``: one rank's all-gather plan against the whole sequence (zigzag, rank 1 of 8) under a block-causal
  mask of 1024 frames at 1M, with the block planner's key-run groups found in one pass (``_longest``) and by a
  left-to-right scan of ``merged`` (Note [Block planning] step 3; the galloping between them is not kept);
- ``selective reads``: ``selected_rows`` - every rank's reads (Note [Selective gather]) - over 8 ranks, for masks of
  128 to 1024 pieces (``SELECT_PIECES`` lifted, so the work is done);
- ``planner``: ``seqpar.plan`` at 128K over 8 for block-causal masks of 32 to 128 frames and at 1M for Llama 4
  chunks of 256 to 1024 pieces (``PLANNED_PIECES`` lifted; Note [Masked problems]).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import seqpar
from seqpar import masks
from seqpar.cost import model
from seqpar.layouts import Rule, blocks, make_layout
from seqpar.methods import allgather


def _scan(g, i, mine, start):
    end = start
    while end + 1 < len(mine) and g.merged(i, i, mine[start], mine[end + 1]) is not None:
        end += 1
    return end


def _timed(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
           "torch": torch.__version__, "commit": commit, "command": " ".join([sys.executable, *sys.argv])}

    def record(**rec) -> None:
        line = json.dumps({**rec, **env})
        print(line, flush=True)
        with (out / "planning_host_time.jsonl").open("a") as f:
            f.write(line + "\n")

    M, W = 1 << 20, 8
    lay = make_layout("zigzag", W, None)
    frames = masks.block_causal(M // 1024)
    q = lay.segments(1, M).cut((0, M))
    keys = blocks.Segments((blocks.Run(0, 0, M),)).cut((0, M))
    one_pass = blocks._longest
    for name, longest in (("one pass", one_pass), ("scan", _scan)):
        blocks._longest = longest
        try:
            s = _timed(blocks.plan, q, keys, Rule(False, mask=frames))
        finally:
            blocks._longest = one_pass
        record(part="block plan", grouping=name, seq_len=M, world=W, mask="block_causal", pieces=1024, seconds=s)

    allgather.SELECT_PIECES = 1 << 20
    for S, mask, pieces in ((1 << 17, masks.block_causal((1 << 17) // 128), 128),
                            (M, masks.block_causal(M // 256), 256), (M, masks.block_causal(M // 512), 512),
                            (M, frames, 1024)):
        allgather.selected_rows.cache_clear()
        s = _timed(allgather.selected_rows, lay, S, Rule(False, mask=mask), None)
        record(part="selective reads", seq_len=S, world=W, mask=mask.name, pieces=pieces, seconds=s)

    model.PLANNED_PIECES = 1 << 20
    S = 1 << 17
    for n in (32, 64, 128):
        s = _timed(seqpar.plan, seq_len=S, heads=32, kv_heads=8, world=W, causal=False,
                   mask_mod=masks.block_causal(S // n), profile="h100-nvswitch")
        record(part="planner", seq_len=S, world=W, mask="block_causal", pieces=n, seconds=s)
    for n in (256, 1024):
        s = _timed(seqpar.plan, seq_len=M, heads=32, kv_heads=8, world=W, causal=True,
                   mask_mod=masks.chunked(M // n), profile="h100-nvswitch")
        record(part="planner", seq_len=M, world=W, mask="chunked", pieces=n, seconds=s)


if __name__ == "__main__":
    main()
