#!/usr/bin/env bash
# One device call for issue 18: `ft serve` launched to its first answered request, this tree
# against an older one (its src/ and benchmarks/ under OLD_DIR, e.g. from `git archive REV src
# benchmarks`), starts interleaved on one machine, warm page cache; then one cold start of this
# tree. serve_start.py's own floor (a plain read of the same files) beside each start.
# Usage: [REPS=3] [COLD=1] bash benchmarks/gpu_serve_ab.sh OUT_DIR OLD_DIR [TOKENIZER_DIR]  (carry
# .carry: the HTTP stack's wheels for Python 3.12 (fastapi's too, for an older tree), the
# tokenizer, OLD_DIR)
set -uo pipefail
out=${1:?output directory}
old=${2:?older tree}
tokenizer=${3:-.carry/tokenizer}
source benchmarks/engine_env.sh
new_path=$PYTHONPATH
old_path=$PWD/$old/src:$PWD/$old/benchmarks:/tmp/carried
start=$(date +%s)
mkdir -p /tmp/logs
for rep in $(seq "${REPS:-3}"); do
  for side in new old; do
    if [ "$side" = new ]; then
      path=$new_path dir=benchmarks logs=(--logs "/tmp/logs/new-$rep")
    else
      path=$old_path dir=$old/benchmarks logs=()
    fi
    PYTHONPATH=$path timeout 150 python3 "$dir/serve_start.py" --layers 16 --work /tmp/lt \
      --tokenizer "$tokenizer" --repeat 1 "${logs[@]}" 2>&1 | grep '^{' | sed "s/^/$side /"
  done
done | tee "$out/ab.txt"
echo "warm starts done in $(( $(date +%s) - start )) s"
tar czf "$out/logs.tgz" -C /tmp logs  # (kept should the cold start run past the call's limit)
if [ "${COLD:-1}" != 0 ]; then
  timeout 200 python3 benchmarks/serve_start.py --layers 16 --work /tmp/lt \
    --tokenizer "$tokenizer" --repeat 1 --page-cache cold --logs /tmp/logs/cold \
    --out "$out/cold.md" 2>&1 | tail -3
  tar czf "$out/logs.tgz" -C /tmp logs
fi
echo "done in $(( $(date +%s) - start )) s"
