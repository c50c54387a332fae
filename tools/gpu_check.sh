#!/usr/bin/env bash
# Everything the GPU machine should confirm, in one go, with a log per step under $1 (default
# ./gpu-logs): build the CUDA extension, the test suite (cuda tests included), memcheck over
# every CUDA kernel, `python -m paged_attention check` and the decode benchmarks.
# Usage: bash tools/gpu_check.sh [LOG_DIR] [STEPS...]   (steps: build tests memcheck check bench)
set -u
LOG=${1:-gpu-logs}; shift || true
STEPS=${*:-build tests memcheck check bench}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"   # the scripts import the package
step() {  # step NAME COMMAND...: run, log, print a one-line summary
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s  | $(tail -n 1 "$LOG/$name.log")"
}
for s in $STEPS; do
  case $s in
    build) step build python -c "from paged_attention.kernels import cuda; print(cuda.available())" ;;
    tests) step tests python -m pytest tests -q -p no:cacheprovider -rs ;;
    memcheck) step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python tools/memcheck_cuda.py ;;
    check) step check python -m paged_attention check ;;
    bench) step bench_cuda python benchmarks/bench_decode.py --cuda
           step bench_triton python benchmarks/bench_decode.py
           step bench_v2 python benchmarks/bench_v2_block_tables.py ;;
    *) echo "unknown step $s" ;;
  esac
done
