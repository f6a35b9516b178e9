#!/usr/bin/env bash
# DeepSeek-V4 (and its sibling families) on the GPU machine, one device call per part:
#   bash benchmarks/gpu_deepseek_v4.sh tests  OUT_DIR   # CUDA tests: bf16/fp32 numerics of every
#                                                       # family, graphs, V4 and DSA
#   bash benchmarks/gpu_deepseek_v4.sh speed  OUT_DIR   # a V4-Flash-shaped model: decode_offload
#   bash benchmarks/gpu_deepseek_v4.sh context OUT_DIR  # the same at contexts 0, 32k, 128k
# The machine's transformers predates deepseek_v4: carry transformers 5.25's wheels (and their
# pure-Python dependencies, numpy excepted) in .carry/wh; they are installed beside the code.
set -uo pipefail
part=$1
out=${2:-${OUT:-/tmp/out}}
mkdir -p "$out"
if [ -d .carry/wh ]; then
  pip install -q --no-deps --target /tmp/tf .carry/wh/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/tf:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export FT_COMMIT=${FT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
layers=${V4_LAYERS:-16}
# The expert cache a 32 GB card leaves V4-Flash (bf16 non-expert weights: 14 GiB over 43
# layers, ~2 GiB of KV and workspace at short contexts: ~14 GiB of experts, 0.33 GiB a layer,
# 26 of its 256 MXFP4 experts): 10% of each layer's experts.
cache=${V4_CACHE:-10%}
case $part in
tests)
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  commit: $FT_COMMIT"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
    cd tests && timeout 540 python3 -m pytest -q -rA -p no:cacheprovider -k cuda \
      test_device_numerics.py test_cuda_graphs.py 2>&1 \
      | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error|assert" | head -150
  } 2>&1 | tee "$out/tests.txt"
  ;;
speed)
  cd benchmarks && timeout 560 python3 decode_offload.py --shape deepseek-v4-flash \
    --layers "$layers" --expert-format mxfp4 --cache all --cache "$cache" \
    --strategy hybrid --strategy offload --batch 1 --batch 4 --steps 24 --warmup 24 --rounds 3 \
    --out "$out/v4-speed.md" 2>&1 | tail -40
  ;;
context)
  cd benchmarks && timeout 560 python3 decode_context.py --shape deepseek-v4-flash \
    --layers "$layers" --expert-format mxfp4 --cache "$cache" --strategy "${V4_STRATEGY:-hybrid}" \
    --batch 1 --batch 4 --contexts 0 32768 131072 --steps 16 --warmup 24 --rounds 3 \
    --out "$out/v4-context.md" 2>&1 | tail -30
  ;;
esac
