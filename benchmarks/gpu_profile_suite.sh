#!/usr/bin/env bash
# One device call: CUDA and native-kernel tests, the CPU expert kernel's bandwidth by thread
# count, a profile of the decode step per strategy, and the streamed prefill benchmark.
# Usage: bash benchmarks/gpu_profile_suite.sh OUT_DIR [--layers N]
set -uo pipefail
out=${1:?output directory}
layers=${3:-16}
source benchmarks/engine_env.sh
{ nproc; cc --version | head -1; lscpu | grep -E "Model name|Thread|Core|Socket"; } > "$out/machine.txt" 2>&1
(cd tests && python3 -m pytest -q -p no:cacheprovider --tb=short -k "cuda or native or fp32 or bf16" \
  test_cpu_experts.py test_prefill.py test_moe_runtime.py) > "$out/tests.txt" 2>&1
tail -3 "$out/tests.txt"
python3 benchmarks/cpu_experts_bench.py --threads 4 8 12 15 16 --out "$out/cpu-experts.md"
python3 benchmarks/profile_decode.py --layers "$layers" --out "$out/profile" 2>&1 | grep -v -E "^(STAGE|USDT)"
python3 benchmarks/prefill.py --layers "$layers" --out "$out/prefill.md" 2>&1 | tail -15
