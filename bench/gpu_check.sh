#!/usr/bin/env bash
# The one command to run when a GPU is lent (../shared/GPU.md, issue 45): set up, test the
# CUDA path compiled, measure it against the device. Every step has its own time limit, so
# one that fails or hangs does not eat the loan; each step's log, the kernel and engine
# figures (JSON) and a summary go to $OUT.
#
#   bash bench/gpu_check.sh             # on the GPU machine: python3 is its CUDA PyTorch
#   bash bench/gpu_check.sh --dry-run   # on CPU (CI: tests/cluster/test_gpu_check.py):
#                                       # the plumbing, every step in its CPU form
#
# Setup: the GPU machine has PyTorch, Triton and pytest but no package registry; the
# project's pure-Python dependencies it lacks travel as wheels in .whl (device README:
# `pip download --no-deps ... -d .whl`), installed into /tmp/site. Without .whl the
# steps that need them fail and say so in their logs; the kernel steps need none.
#
# Steps (limit in seconds), the figures first (a loan that ends early still brings them
# back; on the first H200 loan they took 19 s and 26 s, before the MoE rows): setup 60;
# kernel figures 120; engine figures 150; kernel tests compiled 200 (8 pytest workers:
# compiling the Triton kernels cold for one worker took over 150 s); GPU-marked tests 70
# (30 s on the first loan). 10 minutes at most,
# inside a 15-minute loan with room to start the machine; `STEPS="kernels engine"` runs a
# subset.
set -u
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PY PYTHONUNBUFFERED=1
STEPS="${STEPS:-setup kernel_tests gpu_tests kernels engine}"
: > "$OUT/steps.jsonl"

step() {  # step NAME LIMIT_S COMMAND...: run it under its limit, log it, record rc and time
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local start rc
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d}\n' \
    "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" >> "$OUT/steps.jsonl"
  echo "gpu_check: $name rc=$rc ($(( $(date +%s) - start )) s)"
}

setup() {
  # The wheels are the GPU image's (cp312); a dry run uses this machine's environment.
  if [ "$DRY_RUN" != 1 ] && [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
  fi
  "$PY" - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0))
import triton
print("triton", triton.__version__)
PYEOF
}
export DRY_RUN
export -f setup  # timeout runs commands, not functions: `bash -c setup`

if [ "$DRY_RUN" = 1 ]; then
  # CPU: the kernel tests in Triton's interpreter (a small subset), the GPU-marked tests
  # collected (they skip without CUDA), the figures' scripts in their CPU forms.
  step setup 60 bash -c setup
  # Compiled for sm_90 without a device (Triton's own compiler; no interpreter here).
  step kernels 120 env -u TRITON_INTERPRET "$PY" -m bench.gpu_kernels --compile-only --arch 90
  step engine 150 "$PY" -m bench.gpu_engine --dry-run --json "$OUT/engine.json"
  step kernel_tests 200 env TRITON_INTERPRET=1 "$PY" -m pytest -q -x tests/kernels/test_triton_rms_norm.py
  # Collecting every kernel test module on a loaded 2-core machine can pass 70 s.
  step gpu_tests 180 env TRITON_INTERPRET=1 "$PY" -m pytest -q -m gpu --co tests/kernels
else
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  step setup 60 bash -c setup
  step kernels 120 "$PY" -m bench.gpu_kernels --json "$OUT/kernels.json"
  step engine 150 "$PY" -m bench.gpu_engine --json "$OUT/engine.json"
  # Collection errors do not stop the rest: ray and nixl cannot travel (their wheels pass
  # the 64 MiB a call carries), so the tests that import them are reported, not run.
  step kernel_tests 200 "$PY" -m pytest -q -p no:cacheprovider -n 8 -rf \
    --continue-on-collection-errors tests/kernels -k triton
  # The GPU-marked tests live in tests/kernels (the first loan: 9 passed; collecting the
  # whole tree only added errors for the modules that cannot travel).
  step gpu_tests 70 "$PY" -m pytest -q -p no:cacheprovider -rf -m gpu tests/kernels
fi

# The summary: each step's status, and the tail of each failed step's log.
{
  echo "gpu_check $(date -u +%FT%TZ) dry_run=$DRY_RUN"
  cat "$OUT/steps.jsonl"
  while read -r line; do
    name=$(echo "$line" | sed 's/.*"step": "\([^"]*\)".*/\1/')
    case "$line" in *'"rc": 0,'*) ;; *) echo "--- $name (failed), last lines:"; tail -15 "$OUT/$name.log" ;; esac
  done < "$OUT/steps.jsonl"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -q -v '"rc": 0,' "$OUT/steps.jsonl" && exit 1
exit 0
