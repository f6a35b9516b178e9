#!/usr/bin/env bash
# The CPU expert kernel built several ways (FREETOKEN_NATIVE_FLAGS: the prefetch distance and
# the quantized work item's size, kernels/cpu_experts.c), each timed by format beside dense
# bf16 in its own process. One device call.
# Usage: bash benchmarks/cpu_kernel_variants.sh OUT_DIR [cpu_experts_bench.py args...]
set -uo pipefail
out=${1:?output directory}
shift
source benchmarks/engine_env.sh
variants=(${VARIANTS:-"" "-DPREFETCH_BYTES=4096" "-DPREFETCH_BYTES=8192" "-DQUANTIZED_ITEM_TIMES=1"
          "-DQUANTIZED_ITEM_TIMES=1 -DPREFETCH_BYTES=4096"})
for flags in "${variants[@]}"; do
  echo "== flags: ${flags:-(defaults)}"
  FREETOKEN_NATIVE_FLAGS="$flags" timeout 120 python3 benchmarks/cpu_experts_bench.py \
    --tables formats --dtypes bfloat16 "$@" 2>&1 | tee -a "$out/variants.txt" | grep "| bfloat16"
done
