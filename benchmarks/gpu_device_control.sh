#!/usr/bin/env bash
# One device call for decode decided on the device (moe/device_control.py): the CUDA tests of
# the runtime, the graphs and the doorbell, the fill kernel against the copy engines, then
# decode tok/s of offload and hybrid with their decisions on the device and on the host
# (`STRATEGY:host`), beside fused.
# Usage: bash benchmarks/gpu_device_control.sh OUT_DIR [decode_offload.py args...]
set -uo pipefail
out=${1:?output directory}
shift
source benchmarks/engine_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  (cd tests && timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short \
    -k "cuda or graph or doorbell" test_moe_runtime.py test_cuda_graphs.py test_doorbell.py) \
    > "$out/cuda-tests.txt" 2>&1
  grep -E "passed|failed|Error" "$out/cuda-tests.txt" | tail -5
fi
if [ "${FILL:-1}" = 1 ]; then
  timeout 120 python3 benchmarks/expert_fill_bench.py --out "$out/fill.md" 2>&1 | tail -12
fi
timeout "${BENCH_TIMEOUT:-360}" python3 benchmarks/decode_offload.py --out "$out/decode.md" "$@" \
  2>&1 | tee "$out/decode.log" | grep -v "^{" | tail -30
