#!/usr/bin/env bash
# The modelled link (Note [Modelled link] in seqpar/comm/link.py) on one GPU: its GPU test, then the emulated W = 4
# rows of the real 4x H200 run of 2026-11-26 with the H200 profile's link, to set beside that run's real records
# (python benchmarks/real_vs_emulated.py DIR with DIR/real = that run's real/, DIR/emulated = these records).
# Usage (device machine, repo root or SRC): OUT=... SRC=. [WORLD=4 PRESETS="..." LINK=h200-nvswitch TESTS=1] \
#   bash benchmarks/gpu/link_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/seqpar-out}; SRC=$(cd "${SRC:-.}" && pwd); mkdir -p "$OUT/link"; cd "$SRC"
nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1
if [ "${TESTS:-1}" = 1 ]; then
  PYTHONPATH=$SRC timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_gpu_emulated.py \
    > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -n 3
fi
for p in ${PRESETS:-gqa-causal-16k gqa-causal-8k mha-causal-16k}; do
  PYTHONPATH=$SRC timeout 150 python3 -m seqpar.bench --emulate-world "${WORLD:-4}" --link "${LINK:-h200-nvswitch}" --preset "$p" \
    --warmup 2 --iters 5 --out "$OUT/link" --tag "link-$p" > "$OUT/link/$p.log" 2>&1
  echo "== $p rc=$?"; grep -E "^\| $p" "$OUT/link/$p.log" | cut -c1-160
done
tar czf "$OUT/link.tgz" -C "$OUT" link && rm -rf "$OUT/link"
