#!/usr/bin/env bash
# 2 GPUs (nvidia-h100-x2): the REAL W = 2 table with the peers in the same run, and the EMULATED W = 2
# prediction of the same rows on the same machine. Everything takes about 10 minutes on 2x H100, so run it
# as two calls of ~535 s at most each: PART=real, then PART=emulated (PART=all stops starting work at DEADLINE).
#   1. env (nvidia-smi, topo, versions) -> $OUT/env.txt
#   2. torchrun --nproc-per-node 2 -m seqpar demo          (every method vs the fp64 oracle on NCCL)
#   3. torchrun --nproc-per-node 2 -m seqpar.bench ... --peers --profile   (real W = 2, NCCL)
#   4. python -m seqpar.bench --emulate-world 2 ... --peers (emulated W = 2, fake group, one GPU per process;
#      two queues of processes side by side, one per GPU, to fit the call: see Q0, Q1 below)
# Rows (tokens per rank at W = 2): 2K, 4K, 8K, 64K. The library has no 4K or GQA-8K preset, and seqpar/ is
# not edited here, so the driver adds two presets to seqpar.bench's table before calling its main()
# (gqa-causal-4k, gqa-causal-8k: GQA 32/8, causal, head dim 128, bf16, like gqa-causal-16k).
# Usage (device machine, repo root, carry .peers):  bash benchmarks/gpu/real_2gpu_table.sh
#   PART=all (default) | real (steps 1-3) | emulated (steps 1 and 4); SHORT / LONG: preset lists (" " for
#   none); DEMO=0 skips step 2; Q0 / Q1: the emulated queues (below);
#   DRY=1: a CPU smoke run of the whole pipeline (gloo, tiny presets, no peers).
#   SRC: a directory holding the seqpar package to time, e.g. a clean copy of a commit, made here with
#     mkdir .seqpar-head && git archive HEAD seqpar | tar -x -C .seqpar-head; git rev-parse HEAD > .seqpar-head/COMMIT
#   (ignore it in .git/info/exclude and carry it): every Python command then runs from SRC, so a working tree being
#   edited is not what is timed.
# Writes $OUT/env.txt, $OUT/demo_2gpu.log, $OUT/bench_real.log, $OUT/emulated_gpu0.log, $OUT/emulated_gpu1.log,
# $OUT/commands.txt and $OUT/results.tgz (every JSONL, table and plot); at most 8 files come back.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; PART=${PART:-all}; DRY=${DRY:-0}; mkdir -p "$OUT"
REPO=$PWD; SRC=$(cd "${SRC:-.}" && pwd)
START=$(date +%s); DEADLINE=${DEADLINE:-535}           # seconds after START by which everything has ended
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
RES=$(mktemp -d)/results; mkdir -p "$RES/real" "$RES/emulated"
SHORT=${SHORT:-"gqa-causal-4k gqa-causal-8k mha-causal-8k gqa-causal-16k mha-causal-16k mha-full-16k"}
LONG=${LONG:-"gqa-causal-128k"}
if [ "$DRY" = 1 ]; then
  SHORT="tiny-causal tiny-full"; LONG="tiny-causal"; DEV="--device cpu"; PEERS=""; PROFILE=""; ITERS="--warmup 1 --iters 2"
else
  DEV=""; PEERS="--peers"; PROFILE="--profile"; ITERS="--warmup 2 --iters 5"
fi

# seqpar.bench with two extra presets (seqpar/ itself untouched); torchrun and python both run this file
WRAP=$(dirname "$RES")/bench_2gpu.py
cat > "$WRAP" <<'EOF'
import sys
from seqpar.bench.__main__ import main
from seqpar.bench.presets import PRESETS, Preset
for name, seq in (("gqa-causal-4k", 4096), ("gqa-causal-8k", 8192)):
    PRESETS.setdefault(name, Preset(name=name, heads=32, kv_heads=8, seq_len=seq, causal=True))
raise SystemExit(main(sys.argv[1:]))
EOF
presets() { for p in "$@"; do printf -- '--preset %s ' "$p"; done; }

{ echo "# $(date -u +%FT%TZ) PART=$PART DRY=$DRY"; echo "# driver: bench_2gpu.py = seqpar.bench + gqa-causal-4k/8k presets:"
  sed 's/^/#   /' "$WRAP"; } > "$OUT/commands.txt"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version(), 'gpus', torch.cuda.device_count())"
  python3 -c "import triton; print('triton', triton.__version__)"; uname -r; nproc
  git log -1 --format='repo HEAD %H %s' 2>/dev/null; echo "seqpar package timed: $SRC/seqpar $(cat "$SRC/COMMIT" 2>/dev/null)"
  [ "$SRC" != "$REPO" ] && diff -rq "$SRC/seqpar" "$REPO/seqpar" 2>&1 | head -n 20 | sed 's/^/working tree vs SRC: /'
  env | grep -E '^(NCCL|TORCH_SYMM|NVSHMEM)_' | sort
} > "$OUT/env.txt" 2>&1
if [ -n "$PEERS" ]; then
  python3 -m pip install -q --no-index --no-deps --target .peers/site .peers/*.whl > /dev/null 2>&1 \
    || echo "peer wheels failed to install" | tee -a "$OUT/env.txt"
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton) " >> "$OUT/env.txt"
fi
export PYTHONPATH=$SRC:$REPO/.peers/site:$REPO/.peers/shim:$REPO/.peers
cd "$SRC"             # `python -m` puts the working directory first on sys.path
run() {  # run LOG TIMEOUT cmd...: logged to commands.txt, output to LOG, rc echoed
  local log=$1 t=$2; shift 2
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-} timeout $t $*  >> $(basename "$log")" >> "$OUT/commands.txt"
  timeout "$t" "$@" >> "$log" 2>&1; local rc=$?; echo "rc=$rc ($(basename "$log"), $*)" | cut -c1-160 >> "$OUT/commands.txt"
  echo "== $(basename "$log") rc=$rc at $(( $(date +%s) - START ))s"; return $rc
}

if [ "$PART" != emulated ]; then
  # 2. every method against the fp64 oracle on NCCL (DEMO=0 skips it)
  if [ "${DEMO:-1}" = 0 ]; then echo "== demo skipped (DEMO=0)"
  elif [ "$DRY" = 1 ]; then run "$OUT/demo_2gpu.log" 300 python3 -m seqpar demo --world 2 --seq-len 256
  else run "$OUT/demo_2gpu.log" 100 torchrun --nproc-per-node 2 -m seqpar demo; fi
  [ -f "$OUT/demo_2gpu.log" ] && grep -E "PASS|FAIL|passed|Error" "$OUT/demo_2gpu.log" | grep -v "^W11" | tail -n 30 | cut -c1-130
  # 3. the real W = 2 table: the short rows, then the long row in a process of its own. In one process the long
  # row's single-GPU limit (fwd+bwd at 128K) ran out of memory on an H100 after the short rows: 35 GiB were still
  # held in PyTorch's private pools (CUDA graphs; presumably the earlier configurations' graphed calls), 2026-11-25.
  AFTER=$([ "$PART" = all ] && echo "${EMU_RESERVE:-145}" || echo 10)
  for rows in short long; do
    if [ $rows = short ]; then P=$SHORT; R=$(( AFTER + $([ -n "${LONG// }" ] && echo "${LONG_RESERVE:-270}" || echo 0) ))
    else P=$LONG; R=$AFTER; fi
    [ -z "${P// }" ] && continue
    T=$(( $(left) - R ))
    if [ "$T" -lt 45 ]; then echo "== real $rows rows: skipped, ${T}s left" | tee -a "$OUT/bench_real.log"; continue; fi
    run "$OUT/bench_real.log" "$T" torchrun --nproc-per-node 2 "$WRAP" $(presets $P) $PEERS $PROFILE \
      $DEV $ITERS --budget-s $(( T - 45 )) --out "$RES/real" --tag "real-w2-$rows"
  done
  grep -E "^\[ *[0-9]+s\] (preset|budget)|FAILED|OutOfMemory" "$OUT/bench_real.log" | cut -c1-160 | head -n 40
  grep -A 40 "^| preset" "$OUT/bench_real.log" | cut -c1-220
fi

if [ "$PART" != real ]; then
  # 4. the emulated prediction of the same rows: rank r (the busiest) of 2 on a fake group, one process per GPU at
  # a time; the long row's seqpar methods on GPU 0 and its peers on GPU 1 (--methods none keeps no seqpar
  # configuration), the short rows shared out after them. Queues: "presets|flags" jobs, run in order (the
  # defaults name the default rows; set Q0 / Q1 when SHORT / LONG change).
  if [ "$DRY" = 1 ]; then Q0=${Q0:-"$LONG|"}; Q1=${Q1:-"$SHORT|"}; fi
  Q0=${Q0:-"$LONG|;mha-causal-16k mha-full-16k|$PEERS"}
  Q1=${Q1:-"$LONG|$PEERS --methods none;gqa-causal-4k gqa-causal-8k mha-causal-8k gqa-causal-16k|$PEERS"}
  queue() {  # queue GPU JOBS
    local g=$1 job i=0; IFS=';' read -ra jobs <<< "$2"
    for job in "${jobs[@]}"; do
      i=$((i + 1)); local T=$(( $(left) - 15 ))
      if [ "$T" -lt 45 ]; then echo "== emulated GPU $g job $i ($job): skipped, ${T}s left" | tee -a "$OUT/emulated_gpu$g.log"; continue; fi
      CUDA_VISIBLE_DEVICES=$([ "$DRY" = 1 ] || echo "$g") run "$OUT/emulated_gpu$g.log" "$T" python3 "$WRAP" \
        --emulate-world 2 $(presets ${job%%|*}) ${job#*|} $DEV $ITERS --budget-s $(( T - 35 )) \
        --out "$RES/emulated" --tag "emu-w2-gpu$g-$i"
    done
  }
  queue 0 "$Q0" & queue 1 "$Q1" & wait
  for g in 0 1; do grep -E "^\[ *[0-9]+s\] (preset|budget)|FAILED|skipped" "$OUT/emulated_gpu$g.log" | cut -c1-160 | head -n 30; done
fi
cp "$OUT/commands.txt" "$OUT/env.txt" "$RES/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" results
echo "== done at $(( $(date +%s) - START ))s"; ls -la "$OUT"
