#!/usr/bin/env bash
# One device call for issue 18's `ft serve` start (2026-12-04-serve-timeline-h200.md): where a
# fresh server's time goes before its first answer, beside the engine's own start, on one
# machine.
# 1. the engine alone to its first token (load_time.py, warm, twice, timed logs);
# 2. `ft serve` to its first answered /v1/completions request (serve_start.py, warm, three
#    times; each start's `ft -v` log: a timeline from the launch);
# 3. the slowest imports of a server's start (`python -X importtime`, bytecode kept).
# Usage: bash benchmarks/gpu_serve_timeline.sh OUT_DIR [TOKENIZER_DIR]  (carry .carry/whl with
# the HTTP stack's wheels for Python 3.12, and the tokenizer: engine_env.sh)
set -uo pipefail
out=${1:?output directory}
tokenizer=${2:-.carry/tokenizer}
source benchmarks/engine_env.sh
start=$(date +%s)
mkdir -p /tmp/logs
timeout 300 python3 benchmarks/load_time.py --direct --layers 16 --work /tmp/lt \
  --tokenizer "$tokenizer" --prime --formats "weight directory" --page-cache warm --repeat 2 \
  --logs /tmp/logs/engine --out "$out/engine.md" 2>&1 | tail -4
echo "engine starts done in $(( $(date +%s) - start )) s"
timeout 200 python3 benchmarks/serve_start.py --layers 16 --work /tmp/lt --tokenizer "$tokenizer" \
  --repeat 3 --logs /tmp/logs/serve --out "$out/serve.md" 2>&1 | tail -6
echo "serve starts done in $(( $(date +%s) - start )) s"
for f in /tmp/logs/serve/*-0.txt /tmp/logs/engine/*-0.txt; do
  echo "== $f"; grep -v "urllib3\|^  *[0-9.]*s DEBUG asyncio" "$f" | head -40
done
PYTHONPYCACHEPREFIX=/tmp/lt/pycache python3 -X importtime -c \
  "import freetoken.cli.serve, freetoken.server.app, freetoken.engine.scheduler" \
  2> /tmp/logs/importtime.txt
sort -t'|' -k2 -n -r /tmp/logs/importtime.txt | head -40
tar czf "$out/logs.tgz" -C /tmp logs
echo "done in $(( $(date +%s) - start )) s"
