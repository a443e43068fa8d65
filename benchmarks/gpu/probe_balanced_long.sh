#!/usr/bin/env bash
# One GPU: what the balanced layout's split threshold costs at short chunks (Note [Balanced layout], step 1: a
# document longer than C / _LONG tokens, C a rank's tokens, is cut into 2W chunks over every rank). The packed
# preset, emulated (the busiest rank of W on a fake group), with _LONG = 4 (the layout as it is) and 1 (documents
# that fit on a rank stay whole), for the methods that take balanced; Ulysses (no layout) beside them.
# Usage (device machine, a seqpar tree as cwd): OUT=... bash benchmarks/gpu/probe_balanced_long.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/seqpar-out}; R=$OUT/balanced-long; mkdir -p "$R"
for W in ${WORLDS:-8 4}; do
  for long in 4 1; do
    timeout "${PROBE_S:-150}" python3 -c "import runpy, sys, seqpar.layouts.documents as d; d._LONG = int(sys.argv.pop(1)); \
runpy.run_module('seqpar.bench', run_name='__main__', alter_sys=True)" "$long" --emulate-world "$W" --preset packed \
      --methods "${METHODS:-allgather/balanced,ring/balanced}" --warmup 4 --iters 7 --out "$R" --tag "w$W-long$long" \
      > "$R/w$W-long$long.log" 2>&1
    echo "== W=$W _LONG=$long rc=$?"; grep -E "^\[ *[0-9]+s\] " "$R/w$W-long$long.log" | cut -c1-120 || true
  done
done
