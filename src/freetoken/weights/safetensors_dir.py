"""A Hugging Face checkpoint directory: config.json and safetensors weights, single or sharded.

Everything here reads only headers until asked for tensors, so the size of a model (and
whether it fits in memory) is known before a single weight is read.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from freetoken.errors import CheckpointError
from freetoken.weights.quantized import Dequantizer, QuantizedParts

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
}
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stored_bytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


def _read_header(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ValueError("file is shorter than a safetensors header")
            (length,) = struct.unpack("<Q", raw_len)
            if length > 100 * 2**20:
                raise ValueError(f"implausible header length {length}")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read safetensors file {path}: {e}") from e
    header.pop("__metadata__", None)
    return header


class CheckpointDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.config = self.read_config(self.path)
        self.tensors = self._index_tensors()
        # what is stored quantized (weights/quantized.py): dequantized as it is read
        self.quantized = Dequantizer(self.config, {n: t.shape for n, t in self.tensors.items()})

    @staticmethod
    def read_config(path: Path) -> dict[str, Any]:
        """A checkpoint directory's config.json (a weight directory's too)."""
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(
                f"{cfg_path} is missing: a Hugging Face checkpoint directory needs config.json"
            )
        try:
            config = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {cfg_path}: {e}") from e
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path} does not hold a JSON object")
        return config

    def weight_files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(f"cannot read {index}: {e}") from e
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(
                    f"{index.name} lists shards that are missing from {self.path}: "
                    + ", ".join(missing)
                )
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"no *.safetensors weights in {self.path} (.bin weights are not supported; "
                "convert them to safetensors; a GGUF file is given itself: --model FILE.gguf)"
            )
        return files

    def _index_tensors(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for file in self.weight_files():
            for name, meta in _read_header(file).items():
                tensors[name] = TensorInfo(name, file, meta["dtype"], tuple(meta["shape"]))
        return tensors

    def nbytes(self, dtype: torch.dtype | None = None, kept: Collection[str] = ()) -> int:
        """Bytes the tensors take as stored; with `dtype`, in memory once loaded: floating
        tensors at `dtype`, quantized ones dequantized to it but those named in `kept` (kept
        quantized: their parts' stored bytes)."""
        if dtype is None:
            return sum(t.stored_bytes for t in self.tensors.values())
        itemsize = torch.tensor([], dtype=dtype).element_size()
        total = 0
        for q in self.quantized.tensors.values():
            if q.name in kept:
                total += sum(self.tensors[p].stored_bytes for p in q.parts)
            else:
                total += q.numel * itemsize
        for t in self.tensors.values():
            if t.name in self.quantized.parts or t.name in self.quantized.unused:
                continue
            total += t.numel * (
                itemsize if t.dtype.startswith(("F", "BF")) else DTYPE_BYTES.get(t.dtype, 4)
            )
        return total

    def iter_weights(
        self,
        wanted: Callable[[str], bool] | None = None,
        keep: Callable[[str], bool] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedParts, int]]:
        """(name, tensor, bytes read) of every tensor, quantized ones dequantized (fp32) under
        the name of the weight they stand for where `wanted` takes that name, or as their
        parts where `keep` does (see Dequantizer.tensors_of). A quantized tensor's scales are
        read through one open handle per file (opening a file parses its whole header
        again)."""
        with contextlib.ExitStack() as files:
            handles: dict[Path, Any] = {}

            def get(name: str) -> torch.Tensor:
                info = self.tensors[name]
                try:
                    if info.file not in handles:
                        handles[info.file] = files.enter_context(
                            safe_open(info.file, framework="pt")
                        )
                    return handles[info.file].get_tensor(name)
                except (OSError, RuntimeError) as e:
                    raise CheckpointError(f"cannot read {name} from {info.file}: {e}") from e

            stream = ((info.name, tensor) for info, tensor in self.iter_tensors())
            for name, tensor in self.quantized.tensors_of(stream, get, wanted, keep):
                q = self.quantized.tensors.get(name)
                parts = q.parts if q is not None else (name,)
                yield name, tensor, sum(self.tensors[p].stored_bytes for p in parts)

    def iter_tensors(self) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
        """Yield every tensor, file by file (each file is memory-mapped once)."""
        by_file: dict[Path, list[TensorInfo]] = {}
        for t in self.tensors.values():
            by_file.setdefault(t.file, []).append(t)
        for file, infos in by_file.items():
            try:
                with safe_open(file, framework="pt") as f:
                    for info in infos:
                        yield info, f.get_tensor(info.name)
            except (OSError, RuntimeError) as e:
                raise CheckpointError(f"cannot read weights from {file}: {e}") from e
