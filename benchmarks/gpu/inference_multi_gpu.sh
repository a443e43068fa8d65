#!/usr/bin/env bash
# N GPUs of one host (4 or 8 H200): long-context prefill parallel efficiency, decode latency per token against
# one GPU of the same host, KV memory per rank, and (in the report) the largest context each GPU count holds,
# estimated from the measured peak memory per token. The 1-GPU run on the same host is the reference.
# Usage (device machine, repo root): bash benchmarks/gpu/inference_multi_gpu.sh 8   (logs and JSON lines under $OUT)
set -uo pipefail
N=${1:-8}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"
export PYTHONPATH=$PWD
timeout 300 torchrun --nproc-per-node 1 -m seqpar.bench.inference --preset small --contexts 128k,1m \
  --new-tokens 64 --out "$OUT/inference_w1.jsonl" > "$OUT/inference_w1.log" 2>&1; echo "== W=1 rc=$?"
timeout 580 torchrun --nproc-per-node "$N" -m seqpar.bench.inference --preset small --contexts 128k,1m,4m \
  --new-tokens 64 --out "$OUT/inference_w$N.jsonl" > "$OUT/inference_w$N.log" 2>&1; echo "== W=$N rc=$?"
grep -v "^W11" "$OUT/inference_w$N.log" | tail -n 20 | cut -c1-300
python3 -m seqpar.bench.inference --report "$OUT/inference_w1.jsonl" "$OUT/inference_w$N.jsonl" \
  | tee "$OUT/inference_w$N.md"
