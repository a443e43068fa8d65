#!/usr/bin/env bash
# Emulated worlds on one GPU (Note [Emulated world] in seqpar/bench/__main__.py): the busiest rank of W on a fake
# group, communication free, every method and (with PEERS=1) the peers, per preset and W.
# Usage (device machine, repo root):
#   WORLDS="4 8" PRESETS="gqa-causal-16k mha-causal-16k" SRC=. TAG=new bash benchmarks/gpu/emulate_1gpu.sh
# SRC: the directory holding the seqpar package to time (a baseline checkout for before/after in one run).
# Writes $OUT/emulated-$TAG.tgz (JSON lines, tables, logs).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; SRC=${SRC:-.}; TAG=${TAG:-run}; WORLDS=${WORLDS:-"4 8"}
PRESETS=${PRESETS:-"gqa-causal-16k mha-causal-16k mha-full-16k gqa-causal-128k"}
DIR=$(mktemp -d)/emulated-$TAG; mkdir -p "$DIR" "$OUT"
if [ "${PEERS:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target .peers/site .peers/*.whl > /dev/null 2>&1
  PEERS_PATH=:$PWD/.peers/site:$PWD/.peers/shim:$PWD/.peers; PEER_ARG=--peers
fi
export PYTHONPATH=$(cd "$SRC" && pwd)${PEERS_PATH:-}
args=(); for p in $PRESETS; do args+=(--preset "$p"); done
for W in $WORLDS; do
  # from SRC: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH
  (cd "$SRC" && timeout "${TIMEOUT:-900}" python3 -m seqpar.bench --emulate-world "$W" "${args[@]}" ${PEER_ARG:-} \
    ${EXTRA:-} --warmup 6 --iters 7 --out "$DIR" --tag "w$W-$TAG") > "$DIR/w$W.log" 2>&1
  echo "== W=$W rc=$?"; grep -E "eff|FAILED|Error" "$DIR/w$W.log" | grep -v "^W11" | tail -n 80 | cut -c1-160
done
tar czf "$OUT/emulated-$TAG.tgz" -C "$(dirname "$DIR")" "emulated-$TAG"
