#!/usr/bin/env bash
# Ulysses' forward under spans at 2K tokens per rank over 8, in the bench's process (probe_bench_steady.py: each
# record's steady bursts profiled), after different earlier work: which of it slows the forward to ~1.1 ms a call
# (0.62 alone; benchmarks/results/2026-11-28-h200-thirty-first, section 3).
#   1. --methods ulysses: the limit (flex called directly, forward and forward+backward) and Ulysses only
#   2. the same, forwards only (the limit's forward only): fast in the thirty-first session's run (c)
#   3. ring contiguous first, both modes, then Ulysses
#   bash benchmarks/gpu/ulysses_after.sh        (device machine, repo root)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/seqpar-out}
i=0
for args in "--methods ulysses" "--methods ulysses --modes fwd" "--methods ring/contiguous,ulysses"; do
  i=$((i + 1)); echo "### $i: $args"
  timeout 280 python3 benchmarks/gpu/probe_bench_steady.py --emulate-world 8 --preset mask-spans-16k $args \
    --warmup 6 --iters 7 --out "$OUT/case$i" 2>&1 | grep -v "Warn\|warn(" | grep "steady\|API\|] #" | cut -c1-230
done
