#!/usr/bin/env bash
# Left open by the thirtieth session (its device time ran out): the checks and timings after Note [Open bands
# backwards] and Note [Short steps join] that did not run. One job per GPU (benchmarks/gpu/jobs_per_gpu.sh; fewer
# GPUs: jobs share them in turn).
#   job 0: the GPU kernel tests (the untrimmed open bands on cuDNN only, since f2b5ea5's fix) and the masks' tests
#   job 1: the sink window and causal at 16K over 8 (2K tokens per rank), emulated, the bench
#   job 2: spans and block-causal at 2K per rank (their lone image / frame bands now on cuDNN), emulated W = 8
#   job 3: Ulysses' forward under prefix LM and block-causal at 2K per rank over 8, which idled the GPU 44-48% of a
#          call back to back (causal's: 8%): its gaps, operations and synchronizations (probe_steady_gaps.py); then
#          W = 1 against flex at 16K (masks_1gpu.py: spans' and block_causal's bands stay packed on FA2 there)
#   bash benchmarks/gpu/open_bands_next.sh        (device machine, repo root)
set -uo pipefail
B="python3 -m seqpar.bench --warmup 6 --iters 7 --out \$JOBOUT"
M="--methods ring/zigzag,ring/contiguous,allgather/zigzag,allgather/contiguous,ulysses"
export JOB0='python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -p no:warnings tests/test_gpu_kernels.py tests/test_gpu_masks.py 2>&1 | grep -v DEBUG | tail -n 12'
export JOB1="$B --emulate-world 8 --preset gqa-causal-16k --preset mask-sink-window-16k $M"
export JOB2="$B --emulate-world 8 --preset mask-spans-16k --preset mask-block-causal-16k $M"
P="python3 benchmarks/gpu/probe_steady_gaps.py --seq 16384 --world 8 --rank 0 --configs ulysses/contiguous,ring/zigzag"
export JOB3="$P --mask prefix_lm:4096 --modes fwd --out \$JOBOUT/ulysses-prefix-lm.jsonl; \
$P --mask block_causal:512 --modes fwd --out \$JOBOUT/ulysses-block-causal.jsonl; \
python3 benchmarks/gpu/masks_1gpu.py --out \$JOBOUT --sections w1 --sizes 16384 2>&1 | grep '^|'"
TIMEOUT=${TIMEOUT:-280} TAIL=${TAIL:-24} bash benchmarks/gpu/jobs_per_gpu.sh
