#!/usr/bin/env bash
# Ulysses' forward under spans at 2K tokens per rank over 8 after one other configuration's records in the same bench
# process (probe_bench_steady.py: each record's steady bursts profiled): which earlier configuration slows it.
#   bash benchmarks/gpu/ulysses_after.sh        (device machine, repo root)
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/seqpar-out}
for m in ring/contiguous,ulysses allgather/contiguous,ulysses; do
  echo "### $m"
  timeout 280 python3 benchmarks/gpu/probe_bench_steady.py --emulate-world 8 --preset mask-spans-16k --methods "$m" \
    --warmup 6 --iters 7 --out "$OUT/$(echo "$m" | tr / _)" 2>&1 | grep -v "Warn\|warn(" | grep "steady\|API\|] #" \
    | cut -c1-230
done
