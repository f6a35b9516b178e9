"""An F32 copy of a GGUF file: the same metadata (tokenizer, chat template, hyper-parameters),
every tensor dequantized by the `gguf` package. llama.cpp then multiplies in fp32 too (its
quantized kernels round the activations to 8 bits: Q8_0 / Q8_1 blocks), so freetoken and
llama.cpp run the same arithmetic on the file's values and their greedy tokens can be compared
without that rounding between them (gguf_vs_llama_cpp.py).

    python benchmarks/gguf_f32_copy.py SRC.gguf DST.gguf
"""

from __future__ import annotations

import argparse
import sys

import gguf
import numpy as np


def f32_copy(src: str, dst: str) -> int:
    """Write the copy; returns how many tensors were dequantized."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # (the writer's own)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    dequantized = 0
    for t in reader.tensors:
        values = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
        dequantized += t.tensor_type != gguf.GGMLQuantizationType.F32
        writer.add_tensor(t.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args()
    n = f32_copy(args.src, args.dst)
    print(f"{args.dst}: {n} tensors dequantized to F32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
