#!/usr/bin/env bash
# Thirtieth session, second call: the sink window's emulated ranks with WIDE_ROWS lowered (its bands of 1K-2K rows
# on flex, whose backward now runs from the final rows - Note [Bands on flex] measured 2048 before that), and TASP
# against the ring at 128K through the bench (its emulated busiest rank, W = 8 and 4). One job per GPU
# (benchmarks/gpu/jobs_per_gpu.sh; on 2 GPUs jobs 0, 2 and 1, 3 share one).
#   bash benchmarks/gpu/wide_rows_tasp.sh        (device machine, repo root)
set -uo pipefail
P=benchmarks/gpu/probe_steady_gaps.py
M="--mask sink_window:4095,4"
export JOB0="python3 $P --out \$JOBOUT/sink16k.jsonl --seq 16384 --world 8 --rank 3 $M --wide-rows 4096,2048 \
--configs ring/contiguous,allgather/contiguous"
export JOB1="python3 $P --out \$JOBOUT/sink16k-zigzag.jsonl --seq 16384 --world 8 --rank 3 $M --wide-rows 4096,1024 \
--configs ring/zigzag,allgather/zigzag"
export JOB2="python3 $P --out \$JOBOUT/sink128k.jsonl --seq 131072 --world 8 --rank 1 $M --wide-rows 4096,2048 \
--configs ring/contiguous,allgather/contiguous"
export JOB3="for w in 8 4; do python3 -m seqpar.bench --emulate-world \$w --preset gqa-causal-128k \
--preset mha-causal-128k --methods tasp/zigzag,ring/zigzag --warmup 3 --iters 5 --out \$JOBOUT; done"
TIMEOUT=${TIMEOUT:-280} TAIL=${TAIL:-80} bash benchmarks/gpu/jobs_per_gpu.sh
