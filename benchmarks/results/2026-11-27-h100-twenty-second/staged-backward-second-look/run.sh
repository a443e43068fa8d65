#!/usr/bin/env bash
# one H100: PART=tests -> the GPU test set at HEAD; then the staged-backward A/B (ORDER="head sb" or "sb head")
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
O=$OUT; R=/tmp/r$$; mkdir -p $R
if [ "${TESTS:-0}" = 1 ]; then
  (cd .seqpar-head && timeout 300 python3 -m pytest -p no:warnings -m gpu -q tests/test_fa2_windows.py tests/test_gpu_masks.py \
    tests/test_gpu_kernels.py tests/test_long_docs.py tests/test_gpu_emulated.py tests/test_gpu_runtime.py tests/test_merge.py) \
    > $O/gputests.log 2>&1; echo "== gpu tests rc=$? $(tail -n 1 $O/gputests.log)"
fi
for t in $ORDER; do
  OUT=$R SRC=.seqpar-$t TAG=$t-d WORLDS="8 4" PRESETS="gqa-causal-16k mha-causal-16k" EXTRA="--methods ulysses --modes fwd,fwd+bwd" TIMEOUT=110 bash .seqpar-head/benchmarks/gpu/emulate_1gpu.sh | grep -v "^\[" | tail -n 3
  OUT=$R SRC=.seqpar-$t TAG=$t-p WORLDS="8" PRESETS="packed" EXTRA="--methods ulysses --modes fwd,fwd+bwd" TIMEOUT=110 bash .seqpar-head/benchmarks/gpu/emulate_1gpu.sh | grep -v "^\[" | tail -n 3
done
tar czf $O/ab-$RUN.tgz -C $R .
for f in $R/*.tgz; do tar xzf $f -C $R; done
for t in $ORDER; do for s in d p; do echo "== $t-$s"; PYTHONPATH=.seqpar-head python3 -m seqpar.bench.report --emulated $R/emulated-$t-$s --steady 2>&1 | grep -E "^\||ulysses" | head -n 12; done; done
