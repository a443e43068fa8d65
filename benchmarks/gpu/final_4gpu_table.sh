#!/usr/bin/env bash
# 4 GPUs, final part 1: every method vs the fp64 oracle on NCCL (demo), then the performance table with the
# peers in the same run (+ the 8K communication-bound case), with exposed communication per method.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version())"
} > "$OUT/env.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --target .peers/site .peers/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD
timeout 200 torchrun --nproc-per-node 4 -m seqpar demo > "$OUT/demo_4gpu.log" 2>&1; echo "== demo rc=$?"
grep -v "^W11\|^\[rank" "$OUT/demo_4gpu.log" | tail -n 24 | cut -c1-130
export PYTHONPATH=$PWD:$PWD/.peers/site:$PWD/.peers/shim:$PWD/.peers
timeout 520 torchrun --nproc-per-node 4 -m seqpar.bench --preset table --preset mha-causal-8k --peers --profile \
  --warmup 2 --iters 5 --budget-s 470 --out "$OUT" --tag table > "$OUT/bench_table.log" 2>&1
echo "== bench rc=$?"
grep -A 40 "^| preset" "$OUT/bench_table.log" | cut -c1-200
grep "FAILED" "$OUT/bench_table.log" | head -n 12 | cut -c1-200
