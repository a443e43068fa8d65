#!/usr/bin/env bash
# The masks' GPU checks and timings in one device call, one job per GPU of a host (benchmarks/gpu/jobs_per_gpu.sh);
# on one GPU (GPUS=1) the same jobs run one after another. Left open by the twenty-ninth session:
#   job 0: the GPU tests of masks, flex and graphs (test_flex_blocks_capture_and_replay never ran yet)
#   job 1: the W = 1 table against flex, 16K and 128K (the engine path for bands: 33262c6), softcap
#   job 2: the sink window and causal at 128K over 8, emulated (busiest rank), ring and all-gather, contiguous
#   job 3: the bench's mask presets and causal at 2K tokens per rank, emulated W = 8
# Usage (device machine, repo root):  bash benchmarks/gpu/masks_next.sh      (TIMEOUT per job, default 540 s)
set -uo pipefail
export JOB0='python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -p no:warnings tests/test_gpu_masks.py tests/test_flex_final_rows.py tests/test_gpu_emulated.py tests/test_gpu_runtime.py 2>&1 | grep -v DEBUG | tail -n 12'
export JOB1='python3 benchmarks/gpu/masks_1gpu.py --out $JOBOUT --sections w1,softcap --sizes 16384,131072 --large-masks sink_window,window,generic 2>&1 | grep "^|"'
export JOB2='python3 benchmarks/gpu/masks_1gpu.py --out $JOBOUT --sections emulated --sizes 131072 --emulated-methods allgather/contiguous,ring/contiguous,ring/zigzag --emulated-masks causal,sink_window 2>&1 | grep "^{" | cut -c1-400'
export JOB3='python3 -m seqpar.bench --emulate-world 8 --preset gqa-causal-16k --preset mask-sink-window-16k --preset mask-chunked-16k --preset mask-spans-16k --preset mask-prefix-lm-16k --preset mask-block-causal-16k --preset mask-shared-prefix-32k --methods ring/zigzag,ring/contiguous,allgather/zigzag,allgather/contiguous,ulysses --warmup 6 --iters 7 --budget-s 480 --out $JOBOUT 2>&1 | grep -A 20 "^| preset"'
if [ "${GPUS:-4}" = 1 ]; then
  OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"; export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
  for g in 0 1 2 3; do
    var=JOB$g; mkdir -p "$OUT/job$g"
    JOBOUT=$OUT/job$g timeout "${TIMEOUT:-540}" bash -c "${!var}" > "$OUT/job$g.log" 2>&1; echo "== job $g rc=$?"
  done
  tar czf "$OUT/jobs.tgz" -C "$OUT" $(cd "$OUT" && ls -d job*)
else
  TAIL=${TAIL:-40} bash benchmarks/gpu/jobs_per_gpu.sh
fi
