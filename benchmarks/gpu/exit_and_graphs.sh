#!/usr/bin/env bash
# Two GPUs (nvidia-h100-x2), one device call, 2026-11-26:
#   1. benchmarks/gpu/exit_check.py's cases on 2 NCCL ranks, each under `timeout` (a hang is killed and its stacks,
#      printed every 15 s by faulthandler, stay in the log);
#   2. then, in parallel: GPU 0 - Ulysses emulated (busiest rank of W on a fake group) with graphs auto and off,
#      W = 8 and 4, three presets; GPU 1 - probe_host.py (per-call GPU operations) for Ulysses and the packed rows
#      with graphs auto and off, then masks_1gpu.py's profile of the sink window and chunked masks.
# Usage (device machine, repo root or a `git archive` copy): OUT=... bash benchmarks/gpu/exit_and_graphs.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD
OUT=${OUT:-/tmp/seqpar-out}; R=$OUT/results; mkdir -p "$R"; START=$(date +%s)
left() { echo $(( ${DEADLINE:-570} - ($(date +%s) - START) )); }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version())"
  echo "seqpar $(cat COMMIT 2>/dev/null)"; } > "$R/env.txt" 2>&1
for c in ${CASES:-eager-destroy graphs-destroy graphs-exit graphs-clear-destroy graphs-noreg-destroy graphs-skew-destroy}; do
  t0=$(date +%s)
  timeout -k 5 "${CASE_S:-40}" torchrun --nproc-per-node 2 benchmarks/gpu/exit_check.py --case "$c" > "$R/exit-$c.log" 2>&1
  echo "== exit case $c: rc=$? in $(( $(date +%s) - t0 ))s" | tee -a "$R/exit-summary.txt"
  grep -E "^\[" "$R/exit-$c.log" | tail -n 4
done
T=$(( $(left) - 20 ))
( export CUDA_VISIBLE_DEVICES=0
  for W in 8 4; do for g in auto off; do
    timeout $(( T / 4 )) python3 -m seqpar.bench --emulate-world $W --preset gqa-causal-16k --preset mha-causal-16k \
      --preset mha-full-16k --methods ulysses --graphs $g --warmup 2 --iters 7 --out "$R/graphs" --tag w$W-$g \
      > "$R/graphs-w$W-$g.log" 2>&1; echo "== graphs W=$W $g rc=$?"
  done; done ) &
( export CUDA_VISIBLE_DEVICES=1
  for g in auto off; do
    timeout $(( T / 4 )) python3 benchmarks/gpu/probe_host.py --out "$R/probe-$g" --world 8 --cases packed32,dense16 \
      --dense-methods ulysses/contiguous --graphs $g > "$R/probe-$g.log" 2>&1; echo "== probe $g rc=$?"
  done
  timeout $(( T / 2 )) python3 benchmarks/gpu/masks_1gpu.py --out "$R/masks" --sections profile --profile-cases \
    sink_window:131072:ulysses/contiguous:fb,sink_window:131072:w1:fb,sink_window:131072:ring/zigzag:fb,chunked:131072:ring/zigzag:fb \
    > "$R/masks-profile.log" 2>&1; echo "== masks profile rc=$?" ) &
wait
cat "$R"/probe-*.log | grep -E "host .* ms, call" | cut -c1-160
grep -E "^== profile" "$R/masks-profile.log"
tar czf "$OUT/results.tgz" -C "$OUT" results; echo "== done at $(( $(date +%s) - START ))s"
