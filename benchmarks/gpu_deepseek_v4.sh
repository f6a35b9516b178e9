#!/usr/bin/env bash
# DeepSeek-V4 (and its sibling families) on the GPU machine, one device call per part:
#   bash benchmarks/gpu_deepseek_v4.sh tests  OUT_DIR   # CUDA tests: bf16/fp32 numerics of every
#                                                       # family, graphs, V4 and DSA
#   bash benchmarks/gpu_deepseek_v4.sh speed  OUT_DIR   # a V4-Flash-shaped model: decode_offload
#   bash benchmarks/gpu_deepseek_v4.sh context OUT_DIR  # the same at contexts 0, 32k, 128k
#   bash benchmarks/gpu_deepseek_v4.sh switches OUT_DIR # V4's bf16 comparison with transformers,
#                                                       # with each decode kernel switched off
#   bash benchmarks/gpu_deepseek_v4.sh timeline OUT_DIR # where a hybrid step's time goes
#   bash benchmarks/gpu_deepseek_v4.sh prefetch OUT_DIR # fills a layer ahead: its CUDA tests,
#                                                       # then hybrid with 0, 1, 2 prefetched
#   bash benchmarks/gpu_deepseek_v4.sh stacked OUT_DIR  # stacked projections: CUDA tests, time
#   bash benchmarks/gpu_deepseek_v4.sh side OUT_DIR     # side branches (layers/concurrent.py):
#                                                       # CUDA tests, then the dense work and
#                                                       # hybrid decode with and without
#   bash benchmarks/gpu_deepseek_v4.sh glm5 OUT_DIR     # a GLM-5-shaped model: decode_offload
#   bash benchmarks/gpu_deepseek_v4.sh glm5-context OUT_DIR  # the same at contexts 0, 32k, 128k
# (V4_FUSED=1 adds the whole pool resident to `speed`: 51 GiB at 16 layers, more than an
# 80 GB card holds beside the rest.)
# The machine's transformers predates deepseek_v4: carry transformers 5.25's wheels (and their
# pure-Python dependencies, numpy excepted) in .carry/wh; they are installed beside the code.
set -uo pipefail
part=$1
out=${2:-${OUT:-/tmp/out}}
mkdir -p "$out"
if [ -d .carry/wh ]; then
  [ -d /tmp/tf/transformers ] || pip install -q --no-deps --target /tmp/tf .carry/wh/*.whl 2>&1 | tail -2
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
  caches=(--cache "$cache")
  [ "${V4_FUSED:-0}" = 1 ] && caches=(--cache all "${caches[@]}")
  # (warm-up 40: hybrid's first way trial, 16 + 18 steps, ends inside it)
  cd benchmarks && timeout 560 python3 decode_offload.py --shape deepseek-v4-flash \
    --layers "$layers" --expert-format mxfp4 "${caches[@]}" \
    --strategy ${V4_STRATEGIES:-hybrid offload} --batch 1 --batch 4 --steps 24 --warmup 40 \
    --rounds "${V4_ROUNDS:-3}" --out "$out/v4-speed.md" 2>&1 | tail -40
  ;;
prefetch)
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  commit: $FT_COMMIT"
    cd tests && timeout 150 python3 -m pytest -q -rA -p no:cacheprovider test_prefetch.py \
      test_cuda_graphs.py -k "prefetch" 2>&1 | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error" | head -40
  } 2>&1 | tee "$out/prefetch-tests.txt"
  # (warm-up 64: with a prefetch hybrid's first trial takes each of six ways twice, 3 rounds,
  # after 16 steps: it ends at step 52)
  cd benchmarks && timeout ${V4_PREFETCH_TIMEOUT:-420} python3 decode_offload.py \
    --shape deepseek-v4-flash --layers "${V4_LAYERS:-8}" --expert-format mxfp4 --cache "$cache" \
    --strategy hybrid --batch 1 --batch 4 --prefetch 0 --prefetch 1 --prefetch 2 \
    --prediction-recall "${V4_RECALL:-0.8}" --steps 24 --warmup 64 --rounds "${V4_ROUNDS:-3}" \
    --out "$out/v4-prefetch.md" 2>&1 | tail -30
  ;;
switches)
  python3 benchmarks/kernel_switches.py --off none --off attention --off streams --off mix \
    --off router -- tests/test_device_numerics.py -k "deepseek_v4 and cuda and bf16" \
    2>&1 | tee "$out/switches.txt"
  ;;
timeline)
  cd benchmarks && timeout 400 python3 step_timeline.py --shape deepseek-v4-flash \
    --layers "${V4_TIMELINE_LAYERS:-8}" --expert-format mxfp4 --contender "hybrid@$cache" \
    --batch 1 --steps 24 --profiled 4 --out "$out/v4-timeline.md" 2>&1 | tail -40
  ;;
stacked)
  # Projections of one input stacked into one GEMM and the MLP's gated unit in one kernel
  # (DecoderModel.stack_projections, off on a GPU until this has run): their CUDA tests, then
  # the dense work of a step (the routed experts skipped) without and with them.
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  commit: $FT_COMMIT"
    # (the numerics of the families whose routing or MLP the new kernels compute, stacked
    # and not: DeepSeek-V3/V3.2, GLM-4.5/5, Kimi-K2.6/Linear route by sigmoid groups)
    cd tests && timeout ${STACKED_TESTS_TIMEOUT:-300} python3 -m pytest -q -rA -p no:cacheprovider \
      test_gated_unit.py test_norm_rope.py test_device_numerics.py -k "cuda and (not numerics \
      or deepseek or glm or kimi or qwen3_moe)" 2>&1 \
      | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error|assert" | head -80
  } 2>&1 | tee "$out/stacked-tests.txt"
  for shape in deepseek-v4-flash qwen3-30b-a3b; do
    fmt=dense; [ $shape = deepseek-v4-flash ] && fmt=mxfp4
    (cd benchmarks && timeout 150 python3 profile_decode.py --shape $shape --layers 4 \
      --expert-format $fmt --strategy fused --stacked --steps 50 --out "$out/profile-$shape" \
      2>&1 | tail -3)
  done 2>&1 | tee "$out/stacked-speed.txt"
  ;;
side)
  # A layer's independent work on a side stream (the shared expert, the cache row's
  # projections) and fills on a capped grid (kernels/expert_fill.py FILL_PROGRAMS): the CUDA
  # tests of what they touch, what a fill's grid costs the work beside it (fill_beside.py),
  # hybrid with and without the side branches and with a prefetch (decode_offload
  # --side-branches), then the dense work of a step with and without (profile_decode
  # --side-branches). Both are off by default until this has run.
  # (the shortest first: a device call may be cut short)
  timeout 60 python3 benchmarks/fill_beside.py --out "$out/fill-beside.md" 2>&1 | tail -9
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  commit: $FT_COMMIT"
    cd tests && timeout ${SIDE_TESTS_TIMEOUT:-150} python3 -m pytest -q -rA -p no:cacheprovider \
      test_expert_fill.py test_cuda_graphs.py test_device_numerics.py test_compressed_decode.py \
      -k "cuda and (fill or deepseek_v4 or compressed or glm_moe_dsa or qwen3_moe or graph)" \
      2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -80
  } 2>&1 | tee "$out/side-tests.txt" | tail -4
  (cd benchmarks && timeout ${SIDE_SPEED_TIMEOUT:-250} python3 decode_offload.py \
    --shape deepseek-v4-flash --layers "${V4_LAYERS:-8}" --expert-format mxfp4 --cache "$cache" \
    --strategy hybrid --batch 1 --prefetch 0 --prefetch 1 --prediction-recall 0.8 --side-branches \
    --fill-programs 0 --fill-programs ${SIDE_FILL_PROGRAMS:-64} \
    --steps 24 --warmup 64 --rounds "${V4_ROUNDS:-3}" --out "$out/v4-side.md" 2>&1 | tail -8)
  cd benchmarks && timeout 100 python3 profile_decode.py --shape deepseek-v4-flash --layers 4 \
    --expert-format mxfp4 --strategy fused --side-branches --steps 40 --out "$out/profile" 2>&1 | tail -4
  ;;
glm5)
  # GLM-5's NVFP4 experts are 20 MiB: 5 GiB a layer. A 32 GB card holds its non-expert
  # weights only quantized (~0.45 GiB a layer in bf16, 78 layers), so two caches: 3% (what
  # FP8 non-expert weights leave a 32 GB card) and 10% (V4's figure).
  cd benchmarks && timeout 560 python3 decode_offload.py --shape glm-5 \
    --layers "${GLM_LAYERS:-8}" --expert-format nvfp4 --cache 3% --cache 10% \
    --strategy hybrid --batch 1 --batch 4 --steps 16 --warmup 40 --rounds 2 \
    --out "$out/glm5-speed.md" 2>&1 | tail -40
  ;;
glm5-context)
  cd benchmarks && timeout 560 python3 decode_context.py --shape glm-5 \
    --layers "${GLM_LAYERS:-8}" --expert-format nvfp4 --cache "${GLM_CACHE:-3%}" \
    --strategy hybrid --batch 1 --batch 4 --contexts 0 32768 131072 --steps 16 --warmup 40 \
    --rounds 2 --out "$out/glm5-context.md" 2>&1 | tail -30
  ;;
context)
  # (decode_context.py takes slots: a percentage of the layers' 256 experts each)
  [[ $cache == *% ]] && cache=$(( ${cache%\%} * layers * 256 / 100 ))
  cd benchmarks && timeout 560 python3 decode_context.py --shape deepseek-v4-flash \
    --layers "$layers" --expert-format mxfp4 --cache "$cache" --strategy "${V4_STRATEGY:-hybrid}" \
    --batch 1 --batch 4 --contexts 0 32768 131072 --steps 16 --warmup 80 \
    --rounds "${V4_ROUNDS:-3}" --out "$out/v4-context.md" 2>&1 | tail -30
  ;;
esac
