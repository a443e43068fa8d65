#!/usr/bin/env bash
# Thirtieth session, fourth call: Note [Open bands backwards] checked and timed, with Note [Short steps join]. One job
# per GPU (benchmarks/gpu/jobs_per_gpu.sh; on 2 GPUs jobs 0, 2 and 1, 3 share one).
#   job 0: the GPU kernel tests (open bands on every kernel) and the masks' GPU tests
#   job 1: the sink window's emulated rank at 2K tokens over 8, open bands on cuDNN against as before (A/B, one process)
#   job 2: the sink window and causal at 16K over 8 and 4, emulated, the bench
#   job 3: the sink window at 128K over 8 and the presets with open bands (spans, block-causal) at 2K per rank
#   bash benchmarks/gpu/open_bands.sh        (device machine, repo root)
set -uo pipefail
B="python3 -m seqpar.bench --warmup 6 --iters 7 --out \$JOBOUT"
M="--methods ring/zigzag,ring/contiguous,allgather/zigzag,allgather/contiguous,ulysses"
export JOB0='python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -p no:warnings tests/test_gpu_kernels.py tests/test_gpu_masks.py 2>&1 | grep -v DEBUG | tail -n 12'
export JOB1="python3 benchmarks/gpu/probe_steady_gaps.py --out \$JOBOUT/open16k.jsonl --seq 16384 --world 8 --rank 3 \
--mask sink_window:4095,4 --open-bands band,cudnn --configs ring/contiguous,ring/zigzag,allgather/contiguous"
export JOB2="$B --emulate-world 8 --preset gqa-causal-16k --preset mask-sink-window-16k $M --budget-s 110; \
$B --emulate-world 4 --preset gqa-causal-16k --preset mask-sink-window-16k $M --budget-s 110"
export JOB3="$B --emulate-world 8 --preset mask-sink-window-128k --methods ring/contiguous,ring/zigzag,allgather/contiguous \
--budget-s 100; $B --emulate-world 8 --preset mask-spans-16k --preset mask-block-causal-16k $M --budget-s 120"
TIMEOUT=${TIMEOUT:-250} TAIL=${TAIL:-24} bash benchmarks/gpu/jobs_per_gpu.sh
