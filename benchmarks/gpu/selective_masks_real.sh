#!/usr/bin/env bash
# Usage (W = 4 device machine, repo root; carry .seqpar-base and .seqpar-head, git archive copies):
#   RUNS="1 2" T=150 B=120 bash benchmarks/gpu/selective_masks_real.sh
# the all-gather's selective gather under named masks, real W = 4 (NCCL): base (the full gather) and head alternating
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())"; cat .seqpar-base/COMMIT .seqpar-head/COMMIT; } > $OUT/env.txt 2>&1
for run in ${RUNS:-1}; do for tree in base head; do
  echo "PYTHONPATH=.seqpar-$tree timeout ${T:-120} torchrun --nproc-per-node 4 -m seqpar.bench --preset mask-sink-window-128k --preset mask-chunked-128k --methods allgather/contiguous,allgather/zigzag --warmup 4 --iters 5 --budget-s ${B:-100} --out $OUT/$tree-$run --tag $tree-$run" >> $OUT/commands.txt
  PYTHONPATH=$PWD/.seqpar-$tree timeout ${T:-120} torchrun --nproc-per-node 4 -m seqpar.bench --preset mask-sink-window-128k --preset mask-chunked-128k --methods allgather/contiguous,allgather/zigzag --warmup 4 --iters 5 --budget-s ${B:-100} --out $OUT/$tree-$run --tag $tree-$run > $OUT/$tree-$run.log 2>&1
  echo "== $tree $run rc=$?"; grep -E "^mask-" $OUT/$tree-$run.log | cut -c1-200
done; done
