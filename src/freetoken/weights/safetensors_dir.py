"""A Hugging Face checkpoint directory: config.json and safetensors weights, single or sharded.

Everything here reads only headers until asked for tensors, so the size of a model (and
whether it fits in memory) is known before a single weight is read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from freetoken.errors import CheckpointError

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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
                f"no *.safetensors weights in {self.path} (other weight formats such as "
                ".bin or .gguf are not supported; convert to safetensors)"
            )
        return files

    def _index_tensors(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for file in self.weight_files():
            for name, meta in _read_header(file).items():
                tensors[name] = TensorInfo(name, file, meta["dtype"], tuple(meta["shape"]))
        return tensors

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes the tensors take in memory, at `dtype` for floating tensors if given."""
        total = 0
        for t in self.tensors.values():
            size = DTYPE_BYTES.get(t.dtype, 4)
            if dtype is not None and t.dtype.startswith(("F", "BF")):
                size = torch.tensor([], dtype=dtype).element_size()
            total += t.numel * size
        return total

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
