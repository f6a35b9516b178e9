# Sourced by the side-by-side scripts: the engine's environment on the GPU machine, and
# llama.cpp's llama-bench (/tmp/lb/bin) and GGUF converter (/tmp/conv) unpacked from .carry/
# (see shared/tools/llama.cpp/README.md). Expects $out, the output directory.
. benchmarks/engine_env.sh
mkdir -p /tmp/lb /tmp/conv
tar xJf .carry/llama-bench-cuda-sm90.tar.xz -C /tmp/lb
tar xJf .carry/gguf-convert.tar.xz -C /tmp/conv
