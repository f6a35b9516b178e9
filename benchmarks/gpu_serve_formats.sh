#!/usr/bin/env bash
# One device call for issue 18's `ft serve` start from each format the engine reads: the
# safetensors checkpoint and the weight directory (`ft checkpoint convert`'s), each launched
# whole and timed to its first answered request (serve_start.py), warm and cold page cache,
# twice each, each beside a plain read of its own files made just before it.
# Usage: bash benchmarks/gpu_serve_formats.sh OUT_DIR [TOKENIZER_DIR]  (carry .carry/whl with
# the HTTP stack's wheels for Python 3.12, and the tokenizer: engine_env.sh)
set -uo pipefail
out=${1:?output directory}
tokenizer=${2:-.carry/tokenizer}
source benchmarks/engine_env.sh
start=$(date +%s)
mkdir -p /tmp/logs
for format in safetensors weight-dir; do
  timeout 280 python3 benchmarks/serve_start.py --format $format --layers 16 --work /tmp/lt \
    --tokenizer "$tokenizer" --repeat 2 --page-cache warm cold --logs /tmp/logs/$format \
    --out "$out/$format.md" 2>&1 | tail -7
  echo "$format done in $(( $(date +%s) - start )) s"
done
tar czf "$out/logs.tgz" -C /tmp logs
