# Sourced by the device scripts: the engine's environment on the GPU machine (its Python has no
# platformdirs, so the cache directory is named) and the output directory. Expects $out.
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FREETOKEN_CACHE_DIR=/tmp/freetoken-cache
mkdir -p "$out"
