#!/usr/bin/env bash
# One GPU: masks against flex, softcap, the shared-prefix RL row, emulated W = 8 per named mask (masks_1gpu.py).
#   TESTS=1: first tests/test_gpu_masks.py (named masks, generic mask_mod, softcap and windowed bands on CUDA
#   kernels against the fp64 oracle; the sm90 plan of the sink window), log in $OUT/masks/gpu_masks_tests.log.
#   SECTIONS=w1: seqpar against flex at W = 1, every named mask at 16K, --large-masks at 128K, and a table.
#   SECTIONS=emulated EMU_METHODS=ring/contiguous,...: the busiest of 8 ranks per named mask, those methods.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT/masks"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
  git log -1 --format='commit %H %s' 2>/dev/null
} > "$OUT/masks/env.txt" 2>&1
export PYTHONPATH=$PWD
if [ -n "${TESTS:-}" ]; then
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -m gpu tests/test_gpu_masks.py -q -rs -p no:cacheprovider \
    > "$OUT/masks/gpu_masks_tests.log" 2>&1; echo "== tests rc=$?"; tail -n 15 "$OUT/masks/gpu_masks_tests.log" | cut -c1-300
fi
timeout "${TIMEOUT:-560}" python3 benchmarks/gpu/masks_1gpu.py --out "$OUT/masks" --sections "${SECTIONS:-w1,softcap,rl,emulated}" \
  --sizes "${SIZES:-16384,131072}" --large-masks "${LARGE_MASKS:-sink_window,chunked,window}" \
  ${EMU_METHODS:+--emulated-methods "$EMU_METHODS"} > "$OUT/masks/log.txt" 2>&1
echo "== rc=$?"
grep -v '^\s' "$OUT/masks/log.txt" | grep -v Warning | tail -n 60 | cut -c1-400
if [ -n "${BENCH:-}" ]; then    # the bench's mask presets, emulated W = 8 (limit: flex on one GPU, same mask)
  timeout "${BENCH_TIMEOUT:-300}" python3 -m seqpar.bench --emulate-world 8 --preset masks --preset gqa-causal-16k \
    --preset gqa-causal-128k --methods ring/zigzag,ring/contiguous,ulysses,allgather/zigzag --out "$OUT/masks/bench" \
    > "$OUT/masks/bench.log" 2>&1; echo "== bench rc=$?"; grep -A 30 "^| preset" "$OUT/masks/bench.log" | cut -c1-200
fi
