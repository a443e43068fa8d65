#!/usr/bin/env bash
# 4 GPUs, final part 2: strong/weak scaling, 1M-token GQA fwd+bwd, HF Llama training at 128K and 1M, LASP-2 vs
# LASP-1 vs all-gather softmax, and the planner's calibration. Everything lands in $OUT/long.tgz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; R="$OUT/long"; mkdir -p "$R"
export PYTHONPATH=$PWD
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version(), torch.cuda.get_device_name())" > "$R/env.txt"
step() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "== $name rc=$?"; }
step bench_long 260 torchrun --nproc-per-node 4 -m seqpar.bench --preset gqa-causal-1m --scaling --warmup 1 --iters 2 \
  --budget-s 230 --out "$R" --tag long
grep -A 12 "^| preset" "$R/bench_long.log" | cut -c1-200
step train_128k 150 torchrun --nproc-per-node 4 examples/train_long_context.py --preset gpu-128k \
  --out "$R/train_128k.jsonl"
step train_1m 150 torchrun --nproc-per-node 4 examples/train_long_context.py --preset gpu-1m --out "$R/train_1m.jsonl"
python3 examples/train_long_context.py --plot-from "$R/train_128k.jsonl" "$R/train_1m.jsonl" --plot "$R/train_loss.png" \
  > "$R/plot.log" 2>&1
tail -n 3 "$R/train_128k.log" "$R/train_1m.log" | cut -c1-200
step bench_linear 100 torchrun --nproc-per-node 4 benchmarks/bench_linear.py --seq-lens 65536,262144,1048576 \
  --heads 16 --head-dim 128
step calibrate 90 torchrun --nproc-per-node 4 -m seqpar.calibrate --out "$R/profile_h200x4.json"
tar czf "$OUT/long.tgz" -C "$OUT" long && ls -la "$OUT/long.tgz"
