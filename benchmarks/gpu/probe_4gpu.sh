#!/usr/bin/env bash
# 4 GPUs, probe: every method vs the fp64 oracle on NCCL (the demo), then a profiled timing pass over the
# communication-bound 16K presets and one 128K preset (seqpar methods only). Logs and records under $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version())"
} > "$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"
export PYTHONPATH=$PWD
timeout 300 torchrun --nproc-per-node 4 -m seqpar demo > "$OUT/demo_4gpu.log" 2>&1; echo "== demo rc=$?"
grep -v "^W11" "$OUT/demo_4gpu.log" | tail -n 32 | cut -c1-160
timeout 330 torchrun --nproc-per-node 4 -m seqpar.bench --preset mha-causal-16k --preset gqa-causal-16k \
  --preset mha-full-16k --preset mha-causal-128k --profile --warmup 2 --iters 5 --budget-s 280 \
  --out "$OUT" --tag probe > "$OUT/bench_probe.log" 2>&1; echo "== bench rc=$?"
grep -v "^W11\|^\[" "$OUT/bench_probe.log" | head -n 80 | cut -c1-130
grep "FAILED\|Error" "$OUT/bench_probe.log" | head -n 10 | cut -c1-300
