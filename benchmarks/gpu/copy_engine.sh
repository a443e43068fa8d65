#!/usr/bin/env bash
# The copy-engine ring (Note [Copy-engine ring] in seqpar.comm.symmetric) on W real GPUs of one host:
#   1. tests/test_gpu_copy_engine.py (bitwise equal to the NCCL ring, eager and graphed; the dense oracle)
#   2. the real bench, --steady, the ring and Ulysses with and without transport='copy_engine' beside the double
#      ring on the short rows (1-4K tokens per GPU)
# Usage (device machine, repo root; SRC a `git archive` copy as in real_table.sh):
#   W=4 SRC=.seqpar-head bash benchmarks/gpu/copy_engine.sh       # writes $OUT/copy_engine.tgz
# TESTS: the pytest arguments (default the copy-engine test, each test bounded by --timeout); PEERS=1 (carry .peers):
# the peers timed in the same run.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; W=${W:-4}; mkdir -p "$OUT"
SRC=$(cd "${SRC:-.}" && pwd); RES=$(mktemp -d)/copy_engine; mkdir -p "$RES"
ROWS=${ROWS:-"gqa-causal-8k gqa-causal-16k mha-causal-16k mha-full-16k"}
METHODS=${METHODS:-"ring/zigzag,ring/zigzag/transportcopy_engine,ring/contiguous,ring/contiguous/transportcopy_engine,ulysses,ulysses/transportcopy_engine,usp/u2/zigzag,usp/u2/zigzag/transportcopy_engine,double_ring"}
TESTS=${TESTS:-"--timeout 240 tests/test_gpu_copy_engine.py"}; PEERS=${PEERS:-0}; REPO=$(pwd)
echo "# $(date -u +%FT%TZ) W=$W SRC=$SRC $(cat "$SRC/COMMIT" 2>/dev/null)" > "$RES/commands.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1 >> "$RES/commands.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" \
  >> "$RES/commands.txt" 2>&1
if [ "$PEERS" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target .peers/site .peers/*.whl > /dev/null 2>&1 \
    || echo "peer wheels failed to install" >> "$RES/commands.txt"
  export PYTHONPATH=$SRC:$REPO/.peers/site:$REPO/.peers/shim:$REPO/.peers
fi
cd "$SRC" || exit 1
echo "timeout ${TEST_S:-200} python3 -u -m pytest -v -p no:warnings -m gpu $TESTS" >> "$RES/commands.txt"
eval "timeout ${TEST_S:-200} python3 -u -m pytest -v -p no:warnings -m gpu $TESTS" > "$RES/tests.log" 2>&1   # TESTS may quote: -k 'a or b'
echo "rc=$?" >> "$RES/commands.txt"
cmd=(torchrun --nproc-per-node "$W" -m seqpar.bench $(for p in $ROWS; do printf -- '--preset %s ' "$p"; done)
     --methods "$METHODS" --steady --budget-s "${BUDGET_S:-220}" --out "$RES/bench" --tag copy-engine)
[ "$PEERS" = 1 ] && cmd+=(--peers)
echo "timeout ${BENCH_S:-280} ${cmd[*]}" >> "$RES/commands.txt"
timeout "${BENCH_S:-280}" "${cmd[@]}" > "$RES/bench.log" 2>&1
echo "rc=$?" >> "$RES/commands.txt"
tar czf "$OUT/copy_engine.tgz" -C "$(dirname "$RES")" copy_engine
tail -n 5 "$RES/tests.log"; grep -E "^\| (mha|gqa)" "$RES/bench.log" | cut -c1-220
