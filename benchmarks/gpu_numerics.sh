#!/usr/bin/env bash
# Runs the numerics tests on an NVIDIA GPU and records the result with the machine, the
# software versions and the commit: bash benchmarks/gpu_numerics.sh OUT_FILE
set -uo pipefail
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
out=${1:-benchmarks/results/gpu-numerics.txt}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "commit: ${FT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
  python3 -c 'import torch, transformers; print("torch:", torch.__version__, "cuda:", torch.version.cuda, "transformers:", transformers.__version__)'
  cd tests && python3 -m pytest -q -rA -p no:cacheprovider test_device_numerics.py test_exactness.py 2>&1 | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed"
} | tee "$out"
