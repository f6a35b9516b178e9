#!/usr/bin/env bash
# One device call: a full-depth model beside llama.cpp, where neither a full-depth checkpoint
# nor its conversion fit the call (the 48-layer Qwen3-30B-A3B shape is 61 GB; the disk holds
# one copy, and writing then converting it takes minutes). A 2-layer random checkpoint is
# converted by llama.cpp's converter, its blocks repeated to LAYERS in a GGUF in RAM
# (benchmarks/gguf_deepen.py), llama-bench runs on it with -ncmoe NCMOE, the GGUF is deleted,
# then decode_offload.py runs ours on a random model of the same shape built in memory.
# Usage: [SHAPE=gpt-oss-20b [MXFP4=1]] bash benchmarks/gpu_deep_side_by_side.sh OUT_DIR LAYERS NCMOE
#        [decode_offload.py args]    (SHAPE: qwen3-30b-a3b, the default, or gpt-oss-20b;
#        NCMOE may be a list, 22,18, as llama-bench takes it)
set -uo pipefail
out=${1:?output directory}; layers=${2:-48}; ncmoe=${3:-41}
shift 3
source benchmarks/llama_cpp_env.sh
deep=${GGUF_DIR:-/dev/shm}/deep.gguf
start=$(date +%s)
export SHAPE=${SHAPE:-qwen3-30b-a3b}
python3 - <<'PY'
import os
from pathlib import Path
from checkpoint import write_random_checkpoint
from decode_offload import SHAPES
raw = SHAPES[os.environ["SHAPE"]](2)
if os.environ.get("MXFP4"):  # (gpt-oss: llama.cpp on the release's expert format)
    raw["quantization_config"] = {"quant_method": "mxfp4"}
write_random_checkpoint(raw, Path("/tmp/ckpt2"), tokenizer=Path(".carry/tokenizer"))
PY
(cd /tmp/conv && PYTHONPATH=gguf-py python3 convert_hf_to_gguf.py /tmp/ckpt2 --outtype bf16 \
  --outfile /tmp/m2.gguf > "$out/convert.log" 2>&1) || tail -5 "$out/convert.log"
rm -rf /tmp/ckpt2
PYTHONPATH=/tmp/conv/gguf-py python3 benchmarks/gguf_deepen.py /tmp/m2.gguf "$deep" \
  --layers "$layers" 2>&1 | tail -1
echo "GGUF ready in $(( $(date +%s) - start )) s"
/tmp/lb/bin/llama-bench -m "$deep" -ngl 99 -ncmoe "$ncmoe" -t "$(nproc)" -p 0 -n 32 -r 2 -o md \
  2>&1 | tee "$out/llama-bench.md" | grep -E "^\|"
rm -f "$deep"
echo "llama.cpp done in $(( $(date +%s) - start )) s"
timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/decode_offload.py --shape "$SHAPE" --layers "$layers" \
  --out "$out/decode.md" "$@" 2>&1 | tee "$out/decode.log" | grep -v "^{" | tail -20
echo "done in $(( $(date +%s) - start )) s"
