#!/usr/bin/env bash
# One H100: long-context inference, seqpar at W = 1 against transformers' SDPA path on the same model
# (seqpar.bench.inference, preset "small": Llama config, hidden 1024, 4 layers, GQA 8/2 heads of 128, bf16).
# Prefill time and decode tokens/s (eager, and the CUDA-graph static step) at 32K, 128K and 1M tokens.
# Usage (device machine, repo root): bash benchmarks/gpu/inference_1gpu.sh   (writes logs and JSON lines under $OUT)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
export PYTHONPATH=$PWD
timeout 580 torchrun --nproc-per-node 1 -m seqpar.bench.inference --preset small --contexts 32k,128k,1m \
  --new-tokens 64 --baseline --out "$OUT/inference_1gpu.jsonl" > "$OUT/inference_1gpu.log" 2>&1
echo "== inference 1 GPU rc=$?"
grep -v "^W11" "$OUT/inference_1gpu.log" | tail -n 30 | cut -c1-300
python3 -m seqpar.bench.inference --report "$OUT/inference_1gpu.jsonl" | tee "$OUT/inference_1gpu.md"
