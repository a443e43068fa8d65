#!/usr/bin/env bash
# Flex's backward from the final rows (Note [Flex backward from the final rows] in seqpar/kernels/flex_backward.py)
# on one GPU: its tests, the kernel-level probe (final rows against the recompute, one process), then the sink
# window and causal at 128K as the busiest of 8 ranks (fake group), base tree and this tree alternating.
# Usage (device machine, repo root; BASE: a `git archive` of the commit before, carried; PARTS: any of tests probe
# masks):
#   BASE=.seqpar-base bash benchmarks/gpu/flex_final_rows.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; BASE=${BASE:-.seqpar-base}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch; print(torch.__version__)"
  git rev-parse HEAD 2>/dev/null; cat "$BASE/COMMIT" 2>/dev/null; } > "$OUT/env.txt" 2>&1
PARTS=${PARTS:-tests probe masks}
if [[ $PARTS == *tests* ]]; then
PYTHONPATH=$PWD timeout "${TEST_S:-300}" python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider \
  tests/test_flex_final_rows.py ${GPU_TESTS:-tests/test_gpu_masks.py} > "$OUT/gpu_tests.log" 2>&1
echo "== tests rc=$?"; tail -n 3 "$OUT/gpu_tests.log"
fi
if [[ $PARTS == *probe* ]]; then
PYTHONPATH=$PWD timeout "${PROBE_S:-240}" python3 benchmarks/gpu/probe_flex_final_rows.py --out "$OUT/probe" \
  > "$OUT/probe.log" 2>&1
echo "== probe rc=$?"; grep -o '"case[^,]*\|"speedup[^,]*\|"d[qkv]_diff[^,]*\|_first_s[^,]*' "$OUT/probe.log" | paste -sd' ' | sed 's/"case/\n"case/g'
fi
[[ $PARTS == *masks* ]] || exit 0
for run in ${RUNS:-1}; do
  for tree in base head; do
    src=$PWD; [ "$tree" = base ] && src=$PWD/$BASE
    PYTHONPATH=$src timeout "${MASKS_S:-300}" python3 benchmarks/gpu/masks_1gpu.py --out "$OUT/$tree-$run" \
      --sections emulated --sizes "${SIZES:-131072}" --emulated-masks "${MASKS:-causal,sink_window}" \
      --emulated-methods "${METHODS:-ring/contiguous,allgather/contiguous,ulysses/contiguous}" \
      > "$OUT/$tree-$run.log" 2>&1
    echo "== $tree run $run rc=$?"
    grep -o '"mask[^,]*\|"method[^,]*\|"compute_efficiency_f[^,]*\|"error[^}]*' "$OUT/$tree-$run.log" | paste -sd' ' | sed 's/"mask/\n"mask/g'
  done
done
