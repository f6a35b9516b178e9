#!/usr/bin/env bash
# One device call for decode at agent-sized contexts: the CUDA tests of attention, graphs and
# numerics, where a fused decode step's time goes, then decode_context.py (ours only; pass
# --llama-bench/--gguf/--checkpoint for the side-by-side run).
# Usage: bash benchmarks/gpu_decode_suite.sh OUT_DIR [decode_context.py args...]
set -uo pipefail
out=${1:?output directory}
shift
source benchmarks/engine_env.sh
if [ "${TESTS:-1}" = 1 ]; then
  (cd tests && timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short \
    -k "not interpreter" test_paged_attention.py test_norm_rope.py test_cuda_graphs.py test_device_numerics.py \
    test_moe_runtime.py test_prefill.py) > "$out/cuda-tests.txt" 2>&1
  grep -E "passed|failed|Error" "$out/cuda-tests.txt" | tail -5
fi
if [ "${PROFILE:-1}" = 1 ]; then
  timeout 240 python3 benchmarks/profile_decode.py --layers 16 --strategy fused \
    --out "$out/profile" > "$out/profile.txt" 2>&1
  grep -E "ms/step" "$out/profile.txt" | head
fi
timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/decode_context.py --out "$out/decode_context.md" "$@" 2>&1 \
  | grep -v "^{" | tail -20
