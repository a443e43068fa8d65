#!/usr/bin/env bash
# Independent one-GPU jobs side by side on the GPUs of one host: JOB0 on GPU 0, JOB1 on GPU 1, ... (each a shell
# command run from the repo root; ';' chains commands inside a job). With fewer GPUs than jobs, job g runs on GPU
# g mod N after the jobs before it there (one GPU: one after another, each with its own TIMEOUT). Each job's output
# goes to $OUT/jobG.log, everything it writes under $OUT/jobG/ ($JOBOUT in the command); at the end $OUT/jobs.tgz
# holds them all.
#   JOB0="python3 -m pytest -m gpu ..." JOB1='python3 benchmarks/gpu/masks_1gpu.py --out $JOBOUT ...' \
#     TIMEOUT=540 bash benchmarks/gpu/jobs_per_gpu.sh
# ONLY="0 3" runs just those jobs. Timings from jobs run side by side share the host's CPUs: compare within a job, not across jobs.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/seqpar-out}; mkdir -p "$OUT"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  git log -1 --format='commit %H %s' 2>/dev/null; git status --short 2>/dev/null | head -n 20
} > "$OUT/env.txt" 2>&1
NGPU=$(nvidia-smi -L | wc -l)
for d in $(seq 0 $((NGPU - 1))); do
  ( for g in $(seq "$d" "$NGPU" 7); do
      var=JOB$g; [ -n "${!var:-}" ] || continue
      [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $g "* ]] || continue
      mkdir -p "$OUT/job$g"; echo "GPU $d: ${!var}" >> "$OUT/commands.txt"
      export CUDA_VISIBLE_DEVICES=$d JOBOUT=$OUT/job$g
      timeout "${TIMEOUT:-540}" bash -c "${!var}" > "$OUT/job$g.log" 2>&1; echo "== job $g rc=$?" >> "$OUT/job$g.log"
    done ) &
done
wait
for f in "$OUT"/job[0-7].log; do echo "#### $f"; grep -v "^W11\|Warning\|warn(" "$f" | tail -n "${TAIL:-25}" | cut -c1-240; done
tar czf "$OUT/jobs.tgz" -C "$OUT" $(cd "$OUT" && ls -d job* commands.txt env.txt)
