#!/usr/bin/env bash
# Thirtieth session: where an emulated rank's time goes for the two rows below their bars, one job per GPU
# (benchmarks/gpu/jobs_per_gpu.sh): the sink window (4095 + 4) at 2K and 16K tokens per rank over 8, causal
# beside it, and TASP against the ring at 128K over 8 (GPU time by operation, probe_steady_gaps.py); the flex call
# of the sink window's rank at 2K tokens against W = 1 (probe_rank_flex.py).
#   bash benchmarks/gpu/profile_sink_tasp.sh        (device machine, repo root)
set -uo pipefail
P=benchmarks/gpu/probe_steady_gaps.py
export JOB0="python3 $P --out \$JOBOUT/sink16k.jsonl --seq 16384 --world 8 --rank 3 --mask sink_window:4095,4 \
--configs ring/contiguous,allgather/contiguous,ring/zigzag; python3 $P --out \$JOBOUT/causal16k.jsonl --seq 16384 \
--world 8 --rank 0 --configs allgather/zigzag,ring/zigzag,ulysses/contiguous"
export JOB1="python3 benchmarks/gpu/probe_rank_flex.py --seq 16384 --world 8 --rank 3 --rounds 5; \
python3 benchmarks/gpu/probe_rank_flex.py --seq 16384 --world 8 --rank 3 --rounds 5 --method ring"
export JOB2="python3 $P --out \$JOBOUT/sink128k.jsonl --seq 131072 --world 8 --rank 1 --mask sink_window:4095,4 \
--configs allgather/contiguous,ring/contiguous --modes fwd"
export JOB3="python3 $P --out \$JOBOUT/tasp128k.jsonl --seq 131072 --world 8 --rank 0 --configs tasp/zigzag,ring/zigzag"
TIMEOUT=${TIMEOUT:-400} TAIL=${TAIL:-70} bash benchmarks/gpu/jobs_per_gpu.sh
