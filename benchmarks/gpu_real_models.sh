#!/usr/bin/env bash
# Device calls for issue 41's GPU figures on the real GGUF files: the Qwen2 family's bf16 greedy
# tokens on CUDA, then benchmarks/real_models.py (freetoken beside llama-bench on the same files,
# the MoEs made of them at 25% and 50% of their experts cached against the matching -ncmoe).
# The files are larger than one call carries: split them here into .carry/stage/ parts of 60 MB
# (`split -b 60000000 -d -a 2 FILE .carry/stage/NAME.part`), carry them over successive calls on
# the warm machine (`bash benchmarks/gpu_real_models.sh stage`: each call copies its parts into
# /tmp/stage), then run `bash benchmarks/gpu_real_models.sh run OUT [FILES...]` in the last
# (with .carry/llama-bench-cuda-sm90.tar.xz, .carry/gguf-convert.tar.xz and .carry/whl carried).
set -uo pipefail
mode=${1:?stage or run}
mkdir -p /tmp/stage
if compgen -G ".carry/stage/*.part*" > /dev/null; then cp .carry/stage/*.part* /tmp/stage/; fi
ls -l /tmp/stage | awk 'NR > 1 {s += $5} END {print NR - 1, "parts,", s, "bytes staged"}'
[ "$mode" = stage ] && exit 0
out=${2:?output directory}; shift 2
source benchmarks/llama_cpp_env.sh
start=$(date +%s)
for name in q05 smol; do
  if compgen -G "/tmp/stage/$name.part*" > /dev/null; then
    cat /tmp/stage/$name.part* > /tmp/$name.gguf
    sha256sum /tmp/$name.gguf | tee -a "$out/sha256.txt"
  fi
done
if [ -z "${SKIP_NUMERICS:-}" ]; then
  (cd tests && timeout 300 python3 -m pytest -q -rA -p no:cacheprovider test_device_numerics.py \
    test_exactness.py -k "qwen2 or llama") 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed" \
    | tee "$out/numerics.txt"
fi
files=()
for name in "$@"; do
  if [ ! -f "/tmp/$name.gguf" ] && [ -f "/tmp/${name%-moe8}.gguf" ]; then
    python3 -m freetoken.cli.main checkpoint moe-from-dense "/tmp/${name%-moe8}.gguf" \
      "/tmp/$name.gguf" --experts 8 --top-k 2 2>&1 | tail -2
  fi
  files+=("/tmp/$name.gguf")
done
echo "files ready in $(( $(date +%s) - start )) s"
timeout "${BENCH_TIMEOUT:-480}" python3 benchmarks/real_models.py "${files[@]}" --device cuda \
  --llama-bench /tmp/lb/bin/llama-bench --threads "$(nproc)" --cached 0.25 --cached 0.5 \
  --rounds "${ROUNDS:-2}" --out "$out/real_models.md" 2>&1 | grep -v "^{" | tail -20
cp "$out/real_models.md" "$out/real_models.md" 2>/dev/null
echo "done in $(( $(date +%s) - start )) s"
