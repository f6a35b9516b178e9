#!/usr/bin/env bash
# One device call for experts kept quantized (FP8, MXFP4, NVFP4): the CUDA tests of the kernels,
# the fills and every strategy on quantized checkpoints; the GPU decode kernels' time per layer
# by format beside bf16; the CPU expert kernel's bytes per second by format beside bf16 on all
# cores; the bandwidth profile of gpt-oss-20b's MXFP4 experts.
# Usage: bash benchmarks/gpu_quantized_suite.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
source benchmarks/engine_env.sh
start=$(date +%s)
(cd tests && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --tb=short \
  -k "cuda or graph" test_grouped_experts.py test_expert_fill.py test_quantized.py \
  test_gpt_oss.py test_doorbell.py test_moe_runtime.py) > "$out/cuda-tests.txt" 2>&1
tail -4 "$out/cuda-tests.txt"
echo "tests done in $(( $(date +%s) - start )) s"
timeout 200 python3 benchmarks/grouped_experts_bench.py 2>&1 | tee "$out/grouped-experts.txt" \
  | tail -16
echo "GPU kernels done in $(( $(date +%s) - start )) s"
timeout 150 python3 benchmarks/cpu_experts_bench.py --tables formats --dtypes bfloat16 \
  ${CPU_BENCH_ARGS:-} 2>&1 | tee "$out/cpu-experts.txt" | tail -16
echo "CPU kernel done in $(( $(date +%s) - start )) s"
timeout 60 python3 benchmarks/expert_fill_bench.py --format mxfp4 --model gpt-oss-20b 2>&1 \
  | tee "$out/expert-fill.txt" | tail -8
timeout 60 python3 -m freetoken.cli.main bench bw --hidden 2880 --intermediate 2880 \
  --expert-format mxfp4 --seconds 1.5 | tee "$out/bench-bw-mxfp4.txt"
echo "done in $(( $(date +%s) - start )) s"
