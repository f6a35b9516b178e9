#!/usr/bin/env bash
# One device call after changing the decode path of the offload runtime: its CUDA tests, the
# decode table at both cache sizes, the same at 8 GiB with the CPU team not spinning, and a
# profile of the hybrid and offload steps. Usage: bash benchmarks/gpu_fold_check.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR=/tmp/freetoken-cache
(cd tests && python3 -m pytest -q -p no:cacheprovider --tb=short -k "not interpreter" \
  test_cuda_graphs.py test_moe_runtime.py test_host_copies.py test_cpu_experts.py \
  test_prefill.py) > "$out/cuda-tests.txt" 2>&1
tail -3 "$out/cuda-tests.txt"
python3 -m freetoken.cli.main bench bw --seconds 1.5 | grep "B_\|auto"
python3 benchmarks/decode_offload.py --out "$out/decode_offload.md" --layers 16 --steps 64 \
  --warmup 16 --cache 8GiB --cache 37% 2>&1 | grep "^|"
echo "spin 0:"
FREETOKEN_CPU_SPIN_US=0 python3 benchmarks/decode_offload.py --layers 16 --steps 64 \
  --warmup 16 --cache 8GiB --strategy static --strategy hybrid 2>&1 | grep "^| 8"
python3 benchmarks/profile_decode.py --layers 16 --strategy hybrid --strategy offload \
  --out "$out/profile" 2>&1 | grep -E "ms/step"
