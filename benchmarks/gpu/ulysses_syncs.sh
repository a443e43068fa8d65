#!/usr/bin/env bash
# Why Ulysses' forward under spans and block-causal at 2K tokens per rank over 8 runs 1.15 ms a call back to back in
# the bench (the GPU idle 44-49%, its single call from an idle GPU 0.95 ms) where probe_steady_gaps.py's own calls of
# the same mask ran 0.68 ms. First call: each case alone through the bench's runner and the probe's, with the host's
# CUDA runtime calls per call (a synchronization per call shows there): 0.62-0.69 ms, no synchronization. Second call
# (this one): after the configurations the bench times before it, their planned calls kept (--keep-plans) or not.
#   bash benchmarks/gpu/ulysses_syncs.sh        (device machine, repo root)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
P="python3 benchmarks/gpu/probe_steady_gaps.py --seq 16384 --world 8 --rank 0 --modes fwd,fwd+bwd --runner bench
   --preset mask-block-causal-16k --configs ring/contiguous,allgather/contiguous,ulysses/contiguous"
for keep in "" --keep-plans; do
  echo "### keep plans: ${keep:-no}"
  $P $keep --out $OUT/bench-block-causal$keep.jsonl 2>&1 | grep -v "Warn\|warn\|op us/call"
done
