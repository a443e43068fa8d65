#!/usr/bin/env bash
# W GPUs of one host: does a ring step's transfer move faster under another NCCL setting, or on copy engines? The
# real W-GPU forward at 1-4K tokens per GPU is bound by it (a ring step's 64 MB of MHA K and V at ~126 GB/s behind
# ~0.2 ms of attention: benchmarks/results/2026-11-27-4xh100-real-twenty-second/README.md).
#   1. benchmarks/gpu/p2p_lanes.py (NCCL patterns and symm_pull, copy engines over symmetric memory) under each
#      setting in KNOBS (';'-separated; "-" is NCCL's defaults)
#   2. the real bench, ring / double ring / Ulysses / TASP on the short rows, under the defaults and under each of
#      BENCH_KNOBS, with --steady (calls back to back)
# Usage (device machine, repo root, SRC a `git archive` copy as in real_table.sh):
#   W=4 SRC=.seqpar-head bash benchmarks/gpu/p2p_knobs.sh        # DRY=1: gloo on CPU, tiny, the pipeline only
# Writes $OUT/p2p_knobs.tgz (p2p.jsonl, the bench's records, logs, commands.txt).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; W=${W:-4}; DRY=${DRY:-0}; mkdir -p "$OUT"
SRC=$(cd "${SRC:-.}" && pwd); RES=$(mktemp -d)/p2p_knobs; mkdir -p "$RES"
KNOBS=${KNOBS:-"-;TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1;NCCL_P2P_USE_CUDA_MEMCPY=1;NCCL_MIN_P2P_NCHANNELS=32 NCCL_MAX_P2P_NCHANNELS=32;NCCL_PROTO=Simple"}
BENCH_KNOBS=${BENCH_KNOBS:-"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1"}
ROWS=${ROWS:-"mha-causal-16k gqa-causal-8k"}; METHODS=${METHODS:-"ring/zigzag,double_ring,ulysses,tasp/zigzag"}
if [ "$DRY" = 1 ]; then
  L=(python3 -m torch.distributed.run --standalone --nproc-per-node "$W"); SIZES=1,4; ROWS=tiny-causal; DEV="--device cpu"
  ITERS="--warmup 0 --iters 1"; GRAPHS="--graphs off"
else
  L=(torchrun --nproc-per-node "$W"); SIZES=${SIZES:-4,16,64,256}; DEV=""; ITERS="--warmup 6 --iters 5"; GRAPHS=""
fi
export PYTHONPATH=$SRC
echo "# $(date -u +%FT%TZ) W=$W DRY=$DRY SRC=$SRC $(cat "$SRC/COMMIT" 2>/dev/null)" > "$RES/commands.txt"
run() {  # run LOG TIMEOUT ENV cmd...: ENV "-" for none
  local log=$1 t=$2 knob=$3; shift 3
  echo "$knob timeout $t $*  >> $(basename "$log")" >> "$RES/commands.txt"
  if [ "$knob" = - ]; then timeout "$t" "$@" >> "$log" 2>&1; else env $knob timeout "$t" "$@" >> "$log" 2>&1; fi
  echo "rc=$? ($knob)" >> "$RES/commands.txt"
}
IFS=';' read -ra KS <<< "$KNOBS"
for k in "${KS[@]}"; do
  run "$RES/p2p.log" 120 "$k" "${L[@]}" "$SRC/benchmarks/gpu/p2p_lanes.py" --out "$RES/p2p.jsonl" --sizes-mib "$SIZES" --lanes 1
done
IFS=';' read -ra BK <<< "-;$BENCH_KNOBS"
for k in "${BK[@]}"; do
  tag=$(echo "$k" | tr -c 'A-Za-z0-9\n' '_' | cut -c1-40)
  (cd "$SRC" && run "$RES/bench.log" 240 "$k" "${L[@]}" -m seqpar.bench $(for p in $ROWS; do printf -- '--preset %s ' "$p"; done) \
    --methods "$METHODS" --steady $DEV $ITERS $GRAPHS --budget-s 200 --out "$RES/bench" --tag "knob-$tag")
done
python3 - "$RES/p2p.jsonl" <<'PY' | tee "$RES/p2p.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if len(sys.argv) > 1 else []
knob = lambda r: " ".join(f"{k}={v}" for k, v in sorted(r["env"].items()) if k not in ("NCCL_NVLS_ENABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_SYMM_MEM_DISABLE_MULTICAST")) or "defaults"
print("| setting | pattern | " + " | ".join(f"{m} MiB GB/s" for m in sorted({r["mib"] for r in rows})) + " |")
for key in dict.fromkeys((knob(r), r["pattern"]) for r in rows):
    cells = {r["mib"]: (f"{r['gbps']}" if "gbps" in r else "error") for r in rows if (knob(r), r["pattern"]) == key}
    print(f"| {key[0]} | {key[1]} | " + " | ".join(cells.get(m, "-") for m in sorted({r["mib"] for r in rows})) + " |")
PY
tar czf "$OUT/p2p_knobs.tgz" -C "$(dirname "$RES")" p2p_knobs
echo "== done"; grep -E "^\| (mha|gqa|tiny)" "$RES/bench.log" | cut -c1-200
