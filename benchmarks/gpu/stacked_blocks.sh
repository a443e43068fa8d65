#!/usr/bin/env bash
# Note [Equal blocks as a batch]: Ulysses under Llama 4's chunks (8K), emulated rank 0 of 8, the bench's runner, calls
# back to back, one call per chunk (off) against one batched call (on), in one process per row (off, on, off).
#   bash benchmarks/gpu/stacked_blocks.sh        (device machine, repo root)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
for preset in mask-chunked-16k mask-chunked-128k; do
  timeout 200 python3 benchmarks/gpu/probe_steady_gaps.py --world 8 --rank 0 --configs ulysses/contiguous \
    --modes fwd,fwd+bwd --stack off,on,off --runner bench --preset $preset --out "$OUT/$preset.jsonl" 2>&1 \
    | grep "^{" | cut -c1-200
done
