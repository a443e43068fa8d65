#!/usr/bin/env bash
# Left by the thirty-first session (its device time ran out): the checks and timings of Note [Equal blocks as a batch]
# and the search for what slows Ulysses' masked forward inside the bench. One job per GPU
# (benchmarks/gpu/jobs_per_gpu.sh; fewer GPUs: jobs share them in turn, ONLY="0 1" picks).
#   job 0: the masks' and emulated GPU tests (the equal chunks as one batched cuDNN call against the oracle)
#   job 1: stacked_blocks.sh - Ulysses under Llama 4's chunks, 16K and 128K over 8, one call per chunk against one
#          batched call, in one process (off, on, off)
#   job 2: the bench's chunked rows over 8 (2K and 16K tokens per rank), every method, with the batched calls
#   job 3: ulysses_after.sh - Ulysses' forward under spans after one other configuration's records in the bench
#   job 4: the sink window's forward+backward at 2K tokens per rank over 8 (rank 3), GPU time by operation: what the
#          ring and the all-gather spend beyond flex's W = 1 share (0.807 against causal's 0.885 this session)
#   bash benchmarks/gpu/next_stacked.sh        (device machine, repo root)
set -uo pipefail
export JOB0='python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider -p no:warnings tests/test_gpu_masks.py tests/test_gpu_emulated.py 2>&1 | grep -v DEBUG | tail -n 12'
export JOB1='bash benchmarks/gpu/stacked_blocks.sh'
export JOB2='python3 -m seqpar.bench --warmup 6 --iters 7 --out $JOBOUT --emulate-world 8 --preset mask-chunked-16k --preset mask-chunked-128k --methods ring/zigzag,ring/contiguous,allgather/zigzag,allgather/contiguous,ulysses'
export JOB3='OUT=$JOBOUT bash benchmarks/gpu/ulysses_after.sh'
export JOB4='python3 benchmarks/gpu/probe_steady_gaps.py --seq 16384 --world 8 --rank 3 --configs ring/contiguous,allgather/contiguous --modes fwd+bwd --mask sink_window:4095,4 --out $JOBOUT/sink-fb.jsonl'
TIMEOUT=${TIMEOUT:-560} TAIL=${TAIL:-24} bash benchmarks/gpu/jobs_per_gpu.sh
