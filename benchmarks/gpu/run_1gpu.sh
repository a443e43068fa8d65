#!/usr/bin/env bash
# One GPU, the whole session's measurements in parts (each well inside one device call):
#   bash benchmarks/gpu/run_1gpu.sh tests      GPU tests: runtime (cuDNN probe, lse gradient, CUDA graphs, compile)
#                                              and the kernel conformance suite
#   bash benchmarks/gpu/run_1gpu.sh overhead   python -m seqpar.bench --preset overhead --preset heads
#   bash benchmarks/gpu/run_1gpu.sh packed     python -m seqpar.bench --preset packed --peers
#   bash benchmarks/gpu/run_1gpu.sh inference  python -m seqpar.bench.inference (1M-token context, vs transformers)
#   bash benchmarks/gpu/run_1gpu.sh emulated   the busiest rank of W = 8 and 4 on a fake group, every method
#                                              (emulate_1gpu.sh; PRESETS), with BASE=<dir> (a `git archive` of a
#                                              baseline's seqpar/ and benchmarks/gpu/) the baseline in the same call;
#                                              a line per configuration: tree, preset, W, method, mode, efficiency of
#                                              one call and back to back, GPU operations and busy ms per call
#   bash benchmarks/gpu/run_1gpu.sh masks      the named masks against flex at W = 1, side by side (masks_1gpu.sh)
#   bash benchmarks/gpu/run_1gpu.sh masks-emulated   the busiest of 8 ranks per named mask at 128K (EMU_METHODS)
# Device machine, repo root, with .peers carried (../shared/peers). Logs and JSON lines go to $OUT/results.tgz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/seqpar-out}; OUT=/tmp/seqpar-results; mkdir -p "$OUT" "$FINAL"
trap 'tar -czf "$FINAL/results-$(date +%H%M%S).tgz" -C "$OUT" .' EXIT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --target .peers/site .peers/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:$PWD/.peers/site:$PWD/.peers/shim:$PWD/.peers
for part in "$@"; do
  case "$part" in
    tests)
      timeout 200 python3 -m pytest -m gpu tests/test_gpu_runtime.py tests/test_gpu_kernels.py \
        tests/test_gpu_emulated.py -q -rs -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; echo "== gpu tests rc=$?"
      grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | head -n 30 | cut -c1-300 ;;
    overhead)
      timeout 150 torchrun --nproc-per-node 1 -m seqpar.bench --preset overhead --preset heads --out "$OUT" \
        --tag overhead-heads > "$OUT/bench_overhead_heads.log" 2>&1; echo "== overhead/heads rc=$?"
      grep "^\[" "$OUT/bench_overhead_heads.log" | tail -n 60 | cut -c1-200 ;;
    packed)
      timeout 560 torchrun --nproc-per-node 1 -m seqpar.bench --preset packed --peers --out "$OUT" --tag packed \
        > "$OUT/bench_packed.log" 2>&1; echo "== packed rc=$?"
      grep "^\[" "$OUT/bench_packed.log" | tail -n 60 | cut -c1-200 ;;
    inference)
      timeout 400 torchrun --nproc-per-node 1 -m seqpar.bench.inference --preset small --contexts 32k,128k,1m \
        --new-tokens 64 --baseline --out "$OUT/inference_1gpu.jsonl" > "$OUT/inference_1gpu.log" 2>&1
      echo "== inference rc=$?"
      grep -v "^W11" "$OUT/inference_1gpu.log" | tail -n 25 | cut -c1-250
      python3 -m seqpar.bench.inference --report "$OUT/inference_1gpu.jsonl" | tee "$OUT/inference_1gpu.md" ;;
    emulated)
      for tree in ${BASE:+base} new; do
        src=.; [ "$tree" = base ] && src=$BASE
        OUT=$OUT SRC=$src TAG=$tree WORLDS="8 4" PRESETS="${PRESETS:-gqa-causal-16k mha-causal-16k mha-full-16k}" \
          TIMEOUT=120 bash benchmarks/gpu/emulate_1gpu.sh 2>&1 | grep -E "^== "
        tar xzf "$OUT/emulated-$tree.tgz" -O --wildcards '*.jsonl' | python3 -c "
import json, sys
for r in map(json.loads, sys.stdin):
    if 'compute_efficiency' in r:
        print('$tree', r['preset'], r['emulated_world'], r['method'], r['mode'], round(r['compute_efficiency'], 3),
              round(r.get('steady_compute_efficiency', 0), 3), r['gpu_ops_per_call'], round(r['gpu_busy_ms'], 3),
              r.get('auto_pick', ''))"
      done ;;
    masks-emulated)
      OUT=$OUT SECTIONS=emulated SIZES="${SIZES:-131072}" EMU_METHODS="${EMU_METHODS:-ring/contiguous,allgather/contiguous}" \
        TIMEOUT="${MASKS_S:-300}" bash benchmarks/gpu/masks_1gpu.sh | tail -n 30 ;;
    masks)
      OUT=$OUT SECTIONS=w1 SIZES="${SIZES:-16384,131072}" LARGE_MASKS="${LARGE_MASKS:-sink_window,window,generic}" \
        TIMEOUT=330 bash benchmarks/gpu/masks_1gpu.sh | tail -n 16 ;;
    *) echo "unknown part $part (tests, overhead, packed, inference, emulated, masks, masks-emulated)" ;;
  esac
done
