"""A GGUF file's header walked directly, to judge the file before anything converts it: its
architecture, and where its tensors' data ends (a shorter file is truncated).

gguf.GGUFReader builds every metadata value as numpy arrays: 5-6 s for Qwen's 151,936-token
vocabulary and its merges. This walk reads the few values it needs and steps over the others,
a string array by its lengths alone (Qwen2.5-Coder-0.5B's header: about 0.1 s).

The layout (llama.cpp's gguf.md, versions 2 and 3): "GGUF", the version (uint32), the tensor
and metadata counts (uint64); each metadata pair a key (a string: uint64 length, bytes), a type
(uint32) and its value (an array: element type uint32, count uint64, elements); then each
tensor's name, dimension count (uint32), dimensions (uint64 each), type (uint32) and offset
(uint64) into the data, which starts at the next multiple of `general.alignment` (32 unless
given). Files written big-endian say so by their version's byte order.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from freetoken.errors import CheckpointError, UnsupportedModelError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # (those the gguf package reads)
_STRING, _ARRAY = 8, 9
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# GGUF architectures transformers converts (modeling_gguf_pytorch_utils: its config mapping's
# keys, "qwen2moe", "qwen3moe" and "gpt-oss" renamed) -> the class it makes of them; those whose
# class a family of freetoken reads are served (`served`; "mistral" would need a Mistral family).
CONVERTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, object]  # its single values (arrays, the vocabulary's, stepped over)
    tensor_types: dict[str, int]  # each tensor's GGML type (gguf.GGMLQuantizationType's values)
    data_end: int  # the offset in the file where the last tensor's data ends
    file_size: int

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


def served() -> list[str]:
    """The GGUF architectures freetoken serves: transformers converts them, a family reads them."""
    from freetoken.models.families import ARCHITECTURES

    return sorted(arch for arch, cls in CONVERTED.items() if cls in ARCHITECTURES)


def check(path: Path) -> Header:
    """The header of the GGUF file at `path`, refusing in one line (before any conversion) a file
    that is not GGUF, is cut short, or holds an architecture freetoken does not serve."""
    header = read(path)
    arch = header.architecture
    if arch not in served():
        raise UnsupportedModelError(
            f"{path.name} holds a model of GGUF architecture {arch or '(none given)'}, which "
            f"freetoken does not serve; GGUF architectures served: {', '.join(served())}"
        )
    check_complete(path, header)
    return header


def read(path: Path) -> Header:
    """The header of the GGUF file at `path`; a file that is not GGUF, or a header cut short,
    raises CheckpointError in one line (the tensor data is only measured: `check_complete`)."""
    with open(path, "rb") as f:
        head, size = f.read(4), os.fstat(f.fileno()).st_size
        if head != MAGIC:
            raise CheckpointError(
                f"{path.name} is not a GGUF file: it begins {head!r}, not {MAGIC!r}"
            )
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _Walk(buf, path).header(size)
            except (struct.error, IndexError, UnicodeDecodeError, OverflowError):
                raise CheckpointError(
                    f"{path.name} is truncated or damaged: its header does not fit in its "
                    f"{size:,} bytes (an interrupted download or copy?)"
                ) from None


def check_complete(path: Path, header: Header) -> None:
    if header.file_size < header.data_end:
        raise CheckpointError(
            f"{path.name} is truncated: {header.file_size:,} bytes, but its tensors' data ends "
            f"at {header.data_end:,} (an interrupted download or copy?)"
        )


class _Walk:
    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos, self.order = buf, path, 4, "<"

    def _take(self, fmt: str):
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._take("Q")
        if self.pos + n > len(self.buf):
            raise IndexError
        text = bytes(self.buf[self.pos : self.pos + n]).decode()
        self.pos += n
        return text

    def _skip(self, kind: int) -> None:
        """Step over a value of type `kind`, building nothing."""
        if kind in _FIXED:
            self.pos += struct.calcsize(_FIXED[kind])
        elif kind == _STRING:
            self.pos += 8 + self._take_at("Q")
        elif kind == _ARRAY:
            item, count = self._take("I"), self._take("Q")
            if item in _FIXED:
                self.pos += count * struct.calcsize(_FIXED[item])
            elif item == _STRING:  # (a vocabulary: each element's length, nothing else read)
                unpack, buf, pos = struct.Struct(self.order + "Q").unpack_from, self.buf, self.pos
                for _ in range(count):
                    pos += 8 + unpack(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self._skip(item)
        else:
            raise CheckpointError(f"{self.path.name}: unknown GGUF metadata type {kind}")
        if self.pos > len(self.buf):
            raise IndexError

    def _take_at(self, fmt: str):
        return struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]

    def _value(self, kind: int):
        if kind in _FIXED:
            return self._take(_FIXED[kind])
        if kind == _STRING:
            return self._string()
        self._skip(kind)
        return None

    def header(self, size: int) -> Header:
        version = self._take("I")
        if version & 0xFFFF == 0:  # (written big-endian: the version's bytes read backwards)
            self.order, self.pos = ">", 4
            version = self._take("I")
        if version not in VERSIONS:
            raise CheckpointError(
                f"{self.path.name} is GGUF version {version}; versions 2 and 3 are read "
                "(convert it again with a current llama.cpp)"
            )
        tensors, pairs = self._take("Q"), self._take("Q")
        if tensors > size or pairs > size:
            raise IndexError
        metadata: dict[str, object] = {}
        for _ in range(pairs):
            key, kind = self._string(), self._take("I")
            if kind != _ARRAY:
                metadata[key] = self._value(kind)
            else:
                self._skip(kind)
        types: dict[str, int] = {}
        end = self._tensor_data_end(tensors, int(metadata.get("general.alignment") or 32), types)
        return Header(version, metadata, types, end, size)

    def _tensor_data_end(self, count: int, alignment: int, types: dict[str, int]) -> int:
        """Where the tensors' data ends; each tensor's type recorded in `types`."""
        from gguf.constants import GGML_QUANT_SIZES  # (block and byte sizes of each type)

        sizes = {int(kind): v for kind, v in GGML_QUANT_SIZES.items()}
        last = 0
        for _ in range(count):
            name = self._string()
            dims = [self._take("Q") for _ in range(self._take("I"))]
            kind, offset = self._take("I"), self._take("Q")
            types[name] = kind
            if kind not in sizes:
                raise CheckpointError(
                    f"{self.path.name}: tensor {name} has GGUF type {kind}, which this gguf "
                    "package does not know (a newer one may: pip install -U gguf)"
                )
            block, nbytes = sizes[kind]
            elements = 1
            for d in dims:
                elements *= d
            last = max(last, offset + elements // block * nbytes)
        start = -(-self.pos // alignment) * alignment
        return start + last
