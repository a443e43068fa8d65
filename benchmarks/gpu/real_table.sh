#!/usr/bin/env bash
# W GPUs of one host (nvidia-h100-x2, -x4, ...): the REAL W-GPU table with the peers in the same run, the EMULATED
# prediction of the same rows on the same cards, and the Llama-3-8B training recipe, real and emulated.
# PART names the parts to run, in this order: PART="real", PART="emulated train", ... (all = real emulated); work
# stops starting at DEADLINE, so a device call (~560 s at most) holds the real part, or the emulated and train parts.
#   1. env (nvidia-smi, topo, versions) -> $OUT/env.txt
#   2. real:     torchrun --nproc-per-node W -m seqpar demo    (every method vs the fp64 oracle on NCCL)
#                torchrun --nproc-per-node W -m seqpar.bench ... --peers --profile   (real W, NCCL)
#   3. emulated: python -m seqpar.bench --emulate-world W ... --peers (the busiest rank of W on a fake group), the
#                jobs dealt over the W GPUs, one process per GPU at a time
#   4. train:    examples/train_long_context.py --model llama3-8b at TRAIN_SEQ: the emulated rank 0 of W on GPU 0,
#                then the real W-rank run (torchrun, NCCL, FSDP2 over W); the recipe's records in train.jsonl
# Usage (device machine, repo root, carry .peers):  W=4 PART=real bash benchmarks/gpu/real_table.sh
#   SHORT / LONG: preset lists (" " for none); DEMO=0 skips the demo; EMU_JOBS: the emulated jobs, ';'-separated
#   "presets|flags" (default: the long row's seqpar configurations, its peers, then each short preset with its
#   peers), job i on GPU i mod W; LINK=h200-nvswitch (a planner profile) also runs each job's seqpar configurations
#   with the modelled link into emulated-link/ (Note [Modelled link]: a prediction of the real rows;
#   benchmarks/real_vs_emulated.py DIR emulated-link); TRAIN_SEQ (default 256K), TRAIN_EXTRA: more
#   recipe arguments;
#   PROFILE=" " drops the bench's --profile (exposed communication: extra timed calls per configuration);
#   STEADY=" " drops the bench's --steady (the real rows' calls issued back to back too: steady_ms, steady_efficiency;
#   `python -m seqpar.bench.report --steady --readme results/real/*.jsonl`);
#   DRY=1: a CPU smoke run of the whole pipeline (gloo, tiny presets, no peers, a tiny model).
#   SRC: a directory holding the seqpar package to time, e.g. a clean copy of a commit, made here with
#     mkdir .seqpar-head && git archive HEAD seqpar examples | tar -x -C .seqpar-head; git rev-parse HEAD > .seqpar-head/COMMIT
#   (ignore it in .git/info/exclude and carry it): every Python command then runs from SRC, so a working tree being
#   edited is not what is timed.
# Writes $OUT/env.txt, $OUT/commands.txt, the logs of the part (demo.log, bench_real.log, emulated_gpuG.log,
# train.log) and $OUT/results-$PART.tgz (every JSONL, table and plot); at most 8 files come back.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; PART=${PART:-all}; DRY=${DRY:-0}; W=${W:-2}; mkdir -p "$OUT"
REPO=$PWD; SRC=$(cd "${SRC:-.}" && pwd)
START=$(date +%s); DEADLINE=${DEADLINE:-540}           # seconds after START by which everything has ended
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
RES=$(mktemp -d)/results; mkdir -p "$RES/real" "$RES/emulated" "$RES/emulated-link" "$RES/train"
SHORT=${SHORT:-"gqa-causal-4k gqa-causal-8k mha-causal-8k gqa-causal-16k mha-causal-16k mha-full-16k"}
LONG=${LONG:-"gqa-causal-128k"}
TRAIN_SEQ=${TRAIN_SEQ:-256K}; TRAIN_EXTRA=${TRAIN_EXTRA:-}
if [ "$DRY" = 1 ]; then
  SHORT="tiny-causal tiny-full"; LONG="tiny-causal"; DEV="--device cpu"; PEERS=""; PROFILE=""; STEADY="--steady"
  ITERS="--warmup 1 --iters 2"
  TRAIN="--preset cpu-tiny --steps 1"; TRAIN_SEQ=2K; LAUNCH="python3 examples/train_long_context.py --spawn $W"
else
  DEV=""; PEERS="--peers"; PROFILE=${PROFILE:---profile}; STEADY=${STEADY:---steady}; ITERS="--warmup 6 --iters 5"
  TRAIN="--preset gpu-1m --model llama3-8b --tile-mlp --tile-norms --offload --no-keep-attention --warmup --steps 1"
  LAUNCH="torchrun --nproc-per-node $W examples/train_long_context.py"
fi
has() { [[ " $PART " == *" $1 "* ]] || { [ "$PART" = all ] && [ "$1" != train ]; }; }
presets() { for p in "$@"; do printf -- '--preset %s ' "$p"; done; }

echo "# $(date -u +%FT%TZ) W=$W PART=$PART DRY=$DRY SRC=$SRC" > "$OUT/commands.txt"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'cudnn', torch.backends.cudnn.version(), 'gpus', torch.cuda.device_count())"
  python3 -c "import triton; print('triton', triton.__version__)"; uname -r; nproc; free -g | head -n 2
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

if has real; then
  # every method against the fp64 oracle on NCCL (DEMO=0 skips it)
  if [ "${DEMO:-1}" = 0 ]; then echo "== demo skipped (DEMO=0)"
  elif [ "$DRY" = 1 ]; then run "$OUT/demo.log" 300 python3 -m seqpar demo --world "$W" --seq-len 256
  else run "$OUT/demo.log" 100 torchrun --nproc-per-node "$W" -m seqpar demo; fi
  [ -f "$OUT/demo.log" ] && grep -E "PASS|FAIL|passed|Error" "$OUT/demo.log" | grep -v "^W11" | tail -n 30 | cut -c1-130
  # the short rows, then the long row in a process of its own. In one process the long row's single-GPU limit
  # (fwd+bwd at 128K) ran out of memory on an H100 after the short rows: 35 GiB were still held in PyTorch's
  # private pools (CUDA graphs; presumably the earlier configurations' graphed calls), 2026-11-25.
  AFTER=$(has emulated && echo "${EMU_RESERVE:-145}" || echo 10)
  for rows in short long; do
    if [ $rows = short ]; then P=$SHORT; R=$(( AFTER + $([ -n "${LONG// }" ] && echo "${LONG_RESERVE:-270}" || echo 0) ))
    else P=$LONG; R=$AFTER; fi
    [ -z "${P// }" ] && continue
    T=$(( $(left) - R ))
    if [ "$T" -lt 45 ]; then echo "== real $rows rows: skipped, ${T}s left" | tee -a "$OUT/bench_real.log"; continue; fi
    if [ "$DRY" = 1 ]; then L=(python3 -m torch.distributed.run --nproc-per-node "$W"); else L=(torchrun --nproc-per-node "$W"); fi
    run "$OUT/bench_real.log" "$T" "${L[@]}" -m seqpar.bench $(presets $P) $PEERS $PROFILE $STEADY \
      $DEV $ITERS --budget-s $(( T - 45 )) --out "$RES/real" --tag "real-w$W-$rows"
  done
  grep -E "^\[ *[0-9]+s\] (preset|budget)|FAILED|OutOfMemory" "$OUT/bench_real.log" | cut -c1-160 | head -n 40
  grep -A 60 "^| preset" "$OUT/bench_real.log" | cut -c1-220
fi

if has emulated; then
  # the emulated prediction of the same rows: the busiest rank of W on a fake group, one process per GPU at a
  # time (--methods none keeps no seqpar configuration: the long row's peers run beside its seqpar methods)
  if [ -z "${EMU_JOBS:-}" ]; then
    EMU_JOBS=""; [ -n "${LONG// }" ] && EMU_JOBS="$LONG|;$LONG|$PEERS --methods none"
    for p in $SHORT; do EMU_JOBS="${EMU_JOBS:+$EMU_JOBS;}$p|$PEERS"; done
  fi
  IFS=';' read -ra JOBS <<< "$EMU_JOBS"
  queue() {  # queue GPU: the jobs i with i mod W == GPU, in order
    local g=$1 i job
    for i in "${!JOBS[@]}"; do
      [ $(( i % W )) = "$g" ] || continue
      job=${JOBS[$i]}; local T=$(( $(left) - 15 ))
      if [ "$T" -lt 45 ]; then echo "== emulated GPU $g job $i ($job): skipped, ${T}s left" | tee -a "$OUT/emulated_gpu$g.log"; continue; fi
      CUDA_VISIBLE_DEVICES=$([ "$DRY" = 1 ] || echo "$g") run "$OUT/emulated_gpu$g.log" "$T" python3 -m seqpar.bench \
        --emulate-world "$W" $(presets ${job%%|*}) ${job#*|} $DEV $ITERS --budget-s $(( T - 35 )) \
        --out "$RES/emulated" --tag "emu-w$W-gpu$g-$i"
      # the same job's seqpar configurations with the modelled link (Note [Modelled link]): W GPUs predicted
      T=$(( $(left) - 15 ))
      if [ -n "${LINK:-}" ] && [ "$DRY" != 1 ] && [ "$T" -ge 45 ] && [[ "${job#*|}" != *"--methods none"* ]]; then
        CUDA_VISIBLE_DEVICES=$g run "$OUT/emulated_gpu$g.log" "$T" python3 -m seqpar.bench --emulate-world "$W" \
          --link "$LINK" $(presets ${job%%|*}) $ITERS --budget-s $(( T - 35 )) --out "$RES/emulated-link" \
          --tag "emu-link-w$W-gpu$g-$i"
      fi
    done
  }
  for (( g = 0; g < W; g++ )); do queue "$g" & done; wait
  for (( g = 0; g < W; g++ )); do
    grep -E "^\[ *[0-9]+s\] (preset|budget)|FAILED|skipped" "$OUT/emulated_gpu$g.log" 2>/dev/null | cut -c1-160 | head -n 30
  done
fi

if has train; then
  # the 8B recipe at TRAIN_SEQ: rank 0 of W emulated on GPU 0 first (its prediction), then W real ranks
  T=$(( $(left) / 3 ))
  CUDA_VISIBLE_DEVICES=$([ "$DRY" = 1 ] || echo 0) run "$OUT/train.log" "$T" python3 examples/train_long_context.py \
    $TRAIN $TRAIN_EXTRA --seq-len "$TRAIN_SEQ" --world "$W" --emulate --json "$RES/train/train.jsonl" \
    --out "$RES/train/emulated.jsonl"
  T=$(( $(left) - 20 ))
  run "$OUT/train.log" "$T" $LAUNCH $TRAIN $TRAIN_EXTRA --seq-len "$TRAIN_SEQ" --json "$RES/train/train.jsonl" \
    --out "$RES/train/real.jsonl"
  cp "$RES/train/train.jsonl" "$OUT/" 2>/dev/null; grep -E "fits|step_s|Error|error" "$OUT/train.log" | tail -n 20 | cut -c1-300
fi
cp "$OUT/commands.txt" "$OUT/env.txt" "$RES/" 2>/dev/null
tar czf "$OUT/results-${PART// /-}.tgz" -C "$(dirname "$RES")" results
echo "== done at $(( $(date +%s) - START ))s"; ls -la "$OUT"
