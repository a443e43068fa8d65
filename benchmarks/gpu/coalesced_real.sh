#!/usr/bin/env bash
# W GPUs of one host (nvidia-h100-x4 / -x2), one device call: all-gather's coalesced parts (Note [Coalesced parts] in
# seqpar/comm/all_gather.py) on a real NCCL group. 1. the oracle demo and graphed-equals-eager
# (graphed_equal_real.py) on the new tree; 2. the real W-GPU bench of all-gather zigzag (ring zigzag beside it)
# for the BASE tree and the new one, alternated twice, so card and clock drift fall on both.
# Usage (device machine, the new tree's `git archive` copy as cwd): W=4 BASE=../.seqpar-base OUT=... bash $0
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; R=$OUT/results; mkdir -p "$R"; START=$(date +%s); W=${W:-4}
NEW=$PWD; BASE=$(cd "${BASE:?a baseline tree}" && pwd)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  echo "new seqpar $(cat "$NEW/COMMIT" 2>/dev/null), base $(cat "$BASE/COMMIT" 2>/dev/null)"; } > "$R/env.txt" 2>&1
cat "$R/env.txt" | tail -n 2
PYTHONPATH=$NEW timeout 120 torchrun --nproc-per-node "$W" -m seqpar demo > "$R/demo.log" 2>&1
echo "== demo rc=$?"; grep -E "PASS|FAIL|passed" "$R/demo.log" | grep -v "^W11" | tail -n 4 | cut -c1-130
PYTHONPATH=$NEW timeout 120 torchrun --nproc-per-node "$W" benchmarks/gpu/graphed_equal_real.py > "$R/graphed_equal.log" 2>&1
echo "== graphed vs eager rc=$?"; grep -E "^\[rank 0\]" "$R/graphed_equal.log"
for round in 1 2; do
  for tree in base new; do
    src=$NEW; [ "$tree" = base ] && src=$BASE; t0=$(date +%s)
    (cd "$src" && PYTHONPATH=$src timeout -k 5 "${BENCH_S:-100}" torchrun --nproc-per-node "$W" -m seqpar.bench \
      --preset gqa-causal-16k --preset gqa-causal-8k --preset mha-causal-16k --methods allgather/zigzag,ring/zigzag \
      --warmup 4 --iters 7 --out "$R/bench" --tag "real-w$W-$tree-$round") > "$R/bench-$tree-$round.log" 2>&1
    echo "== bench $tree round $round: rc=$? in $(( $(date +%s) - t0 ))s"
    grep -E "^\[ *[0-9]+s\] #" "$R/bench-$tree-$round.log" | cut -c1-120
  done
done
tar czf "$OUT/results.tgz" -C "$OUT" results; echo "== done at $(( $(date +%s) - START ))s"
