#!/usr/bin/env bash
# One device call for the offload runtime: its CUDA tests, the bandwidth profile (which `auto`
# then reads), the decode benchmark, a profile of the decode step and the streamed prefill.
# Usage: bash benchmarks/gpu_offload_suite.sh OUT_DIR [decode_offload.py args...]
set -uo pipefail
out=${1:?output directory}
shift
source benchmarks/engine_env.sh
(cd tests && python3 -m pytest -q -p no:cacheprovider --tb=short -k "not interpreter" \
  test_cuda_graphs.py test_moe_runtime.py test_prefill.py test_grouped_experts.py \
  test_cpu_experts.py test_host_copies.py) > "$out/cuda-tests.txt" 2>&1
tail -3 "$out/cuda-tests.txt"
python3 -m freetoken.cli.main bench bw --seconds 1.5 | tee "$out/bench-bw.txt"
python3 benchmarks/decode_offload.py --out "$out/decode_offload.md" "$@" 2>&1 | grep -v "^{"
python3 benchmarks/profile_decode.py --layers 16 --strategy hybrid --strategy offload \
  --out "$out/profile" 2>&1 | grep -E "ms/step"
[ "${PREFILL:-1}" = 1 ] && python3 benchmarks/prefill.py --layers 16 --tokens 1024 --tokens 4096 --tokens 8192 \
  --tokens 16384 --out "$out/prefill.md" 2>&1 | tail -14
