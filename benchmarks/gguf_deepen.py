"""A deeper GGUF from a shallow one: blocks repeated cyclically up to `--layers`, every other
tensor and all metadata copied (the block count changed), so llama.cpp can run a full-depth
random model without a full-depth checkpoint and its conversion (a 48-layer Qwen3-30B-A3B
shape is 61 GB: writing it and converting it would each take minutes and the disk twice).

    PYTHONPATH=gguf-py python3 benchmarks/gguf_deepen.py IN.gguf OUT.gguf --layers 48

Needs llama.cpp's gguf-py (in the converter's tarball, see shared/tools/llama.cpp/README.md).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import gguf

BLOCK = re.compile(r"^blk\.(\d+)\.")


def deepen(src: Path, dst: Path, layers: int) -> None:
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    have = reader.get_field(count_key).contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    blocks: dict[int, list] = {}
    others = []
    for tensor in reader.tensors:
        m = BLOCK.match(tensor.name)
        (blocks.setdefault(int(m[1]), []) if m else others).append(tensor)
    if sorted(blocks) != list(range(have)):
        raise SystemExit(f"{src}: blocks {sorted(blocks)} do not match block_count {have}")
    plan = [(t.name, t) for t in others]
    for layer in range(layers):
        for t in blocks[layer % have]:
            plan.append((BLOCK.sub(f"blk.{layer}.", t.name), t))
    for name, t in plan:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in plan:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    start = time.perf_counter()
    deepen(args.src, args.dst, args.layers)
    size = args.dst.stat().st_size
    print(
        f"{args.dst}: {args.layers} layers, {size / 1e9:.1f} GB in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
