#!/usr/bin/env bash
# One GPU, issue 24's probes in one bounded call, then the emulated short-chunk and packed rows (issue 23):
#   1. tests/test_gpu_hardening.py: syncs of a compiled packed HF step (2 vs 4 layers), the static decode refused
#      past its buffer inside a real CUDA graph, planned calls from 8 threads;
#   2. prefill through the public entry point: seqpar's generate vs model.generate, 32K and 128K, median of 5;
#   3. 200 distinct 1M-token packed batches, rank 0 of 4 emulated: GPU and host memory flat;
#   4. with the time left: python -m seqpar.bench --emulate-world 8 on the 16K and packed presets.
# Usage (device machine, repo root): bash benchmarks/gpu/hardening_1gpu.sh   (logs and JSON lines under $OUT)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
START=$SECONDS; LIMIT=${LIMIT:-570}
left() { echo $(( LIMIT - (SECONDS - START) )); }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__)"
  git log -1 --format='seqpar %H %s' 2>/dev/null; echo "command: bash benchmarks/gpu/hardening_1gpu.sh"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
export PYTHONPATH=$PWD
timeout 240 python3 -m pytest -m gpu tests/test_gpu_hardening.py -q -rA -s -p no:cacheprovider > "$OUT/gpu_hardening.log" 2>&1
echo "== hardening tests rc=$? at $((SECONDS - START)) s"
grep -E "syncs per step|static decode past|passed|failed|^FAILED|Error" "$OUT/gpu_hardening.log" | head -n 20 | cut -c1-300
timeout 150 python3 -m seqpar.bench.inference --preset small --contexts 32k,128k --entry generate --repeats 5 \
  --baseline --check --out "$OUT/generate_prefill.jsonl" > "$OUT/generate_prefill.log" 2>&1
echo "== generate prefill rc=$? at $((SECONDS - START)) s"
python3 -m seqpar.bench.inference --report "$OUT/generate_prefill.jsonl" 2>&1 | tail -n 4
timeout 200 python3 benchmarks/gpu/probe_packed_batches.py --out "$OUT" --batches 200 --tokens 1M --world 4 \
  > "$OUT/packed_batches.log" 2>&1
echo "== packed batches rc=$? at $((SECONDS - START)) s"; tail -n 3 "$OUT/packed_batches.log" | cut -c1-400
if [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 15 )) python3 -m seqpar.bench --emulate-world 8 --preset gqa-causal-16k \
    --preset packed --warmup 2 --iters 7 --out "$OUT/emulated" \
    --tag w8-hardening > "$OUT/emulated_w8.log" 2>&1
  echo "== emulated W=8 rc=$? at $((SECONDS - START)) s"
  grep -E "^\| " "$OUT/emulated_w8.log" | head -n 40 | cut -c1-220
fi
