#!/usr/bin/env bash
# Two GPUs (nvidia-h100-x2), one device call, 2026-11-26 (after exit_and_graphs.sh found graphed calls hanging on
# NCCL): exit_check.py's cases with and without expandable segments and NCCL graph registration, now that seqpar
# releases its graphs before a process group shuts down (Note [Graphs and shutdown]); then the real 2-GPU bench of
# ring, Ulysses and all-gather with graphs auto and off (what graphs are worth on a real group), which also ends
# with destroy_process_group.
# Usage (device machine, a `git archive` copy's root): OUT=... bash benchmarks/gpu/exit_and_graphs_real.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
unset PYTORCH_CUDA_ALLOC_CONF
OUT=${OUT:-/tmp/seqpar-out}; R=$OUT/results; mkdir -p "$R"; START=$(date +%s)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "seqpar $(cat COMMIT 2>/dev/null)"; } > "$R/env.txt" 2>&1
# case:environment (expandable = PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
for spec in ${CASES:-graphs-destroy:plain graphs-destroy:expandable graphs-noreg-destroy:expandable graphs-exit:plain}; do
  c=${spec%%:*}; e=${spec#*:}; t0=$(date +%s)
  if [ "$e" = expandable ]; then A="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"; else A="SEQPAR_PLAIN=1"; fi
  env "$A" timeout -k 5 "${CASE_S:-45}" torchrun --nproc-per-node 2 benchmarks/gpu/exit_check.py --case "$c" \
    > "$R/exit-$c-$e.log" 2>&1
  echo "== exit case $c ($e): rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$R/exit-summary.txt"
  grep -E "^\[" "$R/exit-$c-$e.log" | tail -n 3
done
for g in auto off; do
  t0=$(date +%s)
  timeout -k 5 100 torchrun --nproc-per-node 2 -m seqpar.bench --preset gqa-causal-8k --preset mha-causal-16k \
    --methods ring/zigzag,ulysses,allgather/zigzag --graphs $g --warmup 2 --iters 7 --out "$R/bench" \
    --tag real-w2-$g > "$R/bench-$g.log" 2>&1
  echo "== bench graphs=$g: rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$R/exit-summary.txt"
  grep -E "^\[ *[0-9]+s\] #" "$R/bench-$g.log" | cut -c1-120
done
tar czf "$OUT/results.tgz" -C "$OUT" results; echo "== done at $(( $(date +%s) - START ))s"
