#!/usr/bin/env bash
# One device call for the offload runtime: its CUDA tests, the bandwidth profile and the decode
# benchmark. Usage: bash benchmarks/gpu_offload_suite.sh OUT_DIR [decode_offload.py args...]
set -uo pipefail
out=${1:?output directory}
shift
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR=$out/cache
(cd tests && python3 -m pytest -q -p no:cacheprovider --tb=short -k cuda \
  test_moe_runtime.py test_grouped_experts.py) > "$out/cuda-tests.txt" 2>&1
tail -3 "$out/cuda-tests.txt"
python3 -m freetoken.cli.main bench bw --seconds 1.5 | tee "$out/bench-bw.txt"
python3 benchmarks/decode_offload.py --out "$out/decode_offload.md" "$@" 2>&1 | tee "$out/decode.log"
