#!/usr/bin/env bash
# Thirtieth session, third call: Note [Short steps join] checked and timed. One job per GPU
# (benchmarks/gpu/jobs_per_gpu.sh; on 2 GPUs jobs 0, 2 and 1, 3 share one).
#   job 0: the GPU tests of masks and emulated ranks
#   job 1, 2: the sink window and causal at 16K over 8 and 4 (2K and 4K tokens per rank), emulated, the bench
#   job 3: the other mask presets at 2K tokens per rank, emulated W = 8 (no windowed band of 1024+ rows: unchanged)
#   bash benchmarks/gpu/short_steps.sh        (device machine, repo root)
set -uo pipefail
B="python3 -m seqpar.bench --warmup 6 --iters 7 --out \$JOBOUT"
ALL="--methods ring/zigzag,ring/contiguous,allgather/zigzag,allgather/contiguous,ulysses"
export JOB0='python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -p no:warnings tests/test_gpu_masks.py tests/test_gpu_emulated.py 2>&1 | grep -v DEBUG | tail -n 12'
export JOB1="$B --emulate-world 8 --preset gqa-causal-16k --preset mask-sink-window-16k $ALL"
export JOB2="$B --emulate-world 4 --preset gqa-causal-16k --preset mask-sink-window-16k $ALL"
export JOB3="$B --emulate-world 8 --preset mask-chunked-16k --preset mask-spans-16k --preset mask-prefix-lm-16k \
--preset mask-block-causal-16k --preset mask-shared-prefix-32k $ALL --budget-s 250"
TIMEOUT=${TIMEOUT:-280} TAIL=${TAIL:-20} bash benchmarks/gpu/jobs_per_gpu.sh
