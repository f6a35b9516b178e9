#!/usr/bin/env bash
# One device call for issue 6: TTFT per turn of a 34k-token agent conversation, with and
# without prefix reuse (and anchors, for the hybrid models), on a full-attention and two hybrid
# models. Usage: bash benchmarks/gpu_agent_suite.sh OUT_DIR
set -uo pipefail
out=${1:?output directory}
source benchmarks/engine_env.sh
cd benchmarks
python3 agent_replay.py --family qwen3_moe --layers 16 --cache 8GiB \
  --out "$out/agent-replay-qwen3-moe.md" 2>&1 | tail -30
# Qwen3-Next-80B-A3B's experts are 512 per layer: 8 layers already make a 25 GB pool.
python3 agent_replay.py --family qwen3_next --layers 8 --cache 8GiB \
  --out "$out/agent-replay-qwen3-next.md" 2>&1 | tail -30
# Kimi-Linear-48B-A3B's shape (KDA layers, MLA every fourth): each turn's recomputed tokens are
# checked against the new suffix plus the distance back to the deepest anchor (exit 1 if over).
python3 agent_replay.py --family kimi_linear --layers 16 --cache 8GiB \
  --out "$out/agent-replay-kimi-linear.md" 2>&1 | tail -30
