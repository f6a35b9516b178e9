#!/usr/bin/env bash
# One device call for the CPU side of the offload runtime: the expert team's bandwidth with and
# without spinning, the decode table at one cache size, and a profile of the hybrid and offload
# steps (torch ops and Python). Usage: bash benchmarks/gpu_cpu_team.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
source benchmarks/engine_env.sh
(cd tests && python3 -m pytest -q -p no:cacheprovider --tb=short test_cpu_experts.py) 2>&1 | tail -2
for spin in 0 2000; do
  echo "spin ${spin} us"
  python3 -m freetoken.cli.main bench bw --seconds 1.5 --cpu-spin-us $spin | grep "B_"
done
python3 benchmarks/decode_offload.py --out "$out/decode_offload.md" --layers 16 --steps 48 \
  --warmup 16 --cache 8GiB --strategy offload --strategy static --strategy hybrid 2>&1 | grep "^|"
python3 benchmarks/profile_decode.py --layers 16 --strategy hybrid --strategy offload \
  --out "$out/profile" 2>&1 | grep -E "ms/step"
