#!/usr/bin/env bash
# One GPU: kernel conformance vs the fp64 oracle, the demo on CUDA, a W=1 benchmark smoke with peers.
# Usage (device machine, repo root): bash benchmarks/gpu/check_1gpu.sh   (writes logs under $OUT)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
export PYTHONPATH=$PWD
# one pytest process per kernel: a CUDA error in one kernel must not poison the others' context
for kern in cudnn flash flex efficient; do
  timeout 300 python3 -m pytest -m gpu tests/test_gpu_kernels.py -k "$kern" -q -rs -p no:cacheprovider \
    > "$OUT/gpu_kernels_$kern.log" 2>&1; echo "== kernels $kern rc=$?"
  grep -E "passed|failed|^FAILED|Error" "$OUT/gpu_kernels_$kern.log" | head -n 12 | cut -c1-250
done
timeout 150 torchrun --nproc-per-node 1 -m seqpar demo > "$OUT/demo_1gpu.log" 2>&1; echo "== demo rc=$?"
tail -n 20 "$OUT/demo_1gpu.log" | cut -c1-200
python3 -m pip install -q --no-index --no-deps --target .peers/site .peers/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/.peers/site:$PWD/.peers/shim:$PWD/.peers
timeout 300 torchrun --nproc-per-node 1 -m seqpar.bench --preset mha-causal-16k --preset gqa-causal-16k --peers \
  --profile --warmup 1 --iters 3 --out "$OUT" --tag w1smoke > "$OUT/bench_1gpu.log" 2>&1; echo "== bench rc=$?"
grep -v "^W11\|^\[" "$OUT/bench_1gpu.log" | tail -n 40 | cut -c1-220
grep "FAILED\|Error" "$OUT/bench_1gpu.log" | head -20 | cut -c1-300
