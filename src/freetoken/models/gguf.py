"""GGUF files (llama.cpp's format): `--model FILE.gguf` is converted once into a checkpoint
directory in the cache, which the engine then loads as any other.

The conversion is transformers' (its GGUF reader: the config from the file's hyper-parameters,
the tokenizer and chat template from its metadata, every tensor dequantized by the `gguf`
package and renamed to transformers' names); freetoken writes what it returns as config.json,
tokenizer files and safetensors, in bf16 (fp32 where the file holds only F32 tensors). The
experts are thus dequantized: a quantized GGUF takes its bf16 size in host memory and on disk.
Families transformers reads from GGUF: Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE,
gpt-oss (and others freetoken does not serve).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from freetoken import paths
from freetoken.errors import CheckpointError
from freetoken.weights import memory

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
DONE = "freetoken-gguf.json"  # written last: a directory without it is incomplete


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == SUFFIX and Path(path).is_file()


def resolve(path: str | Path) -> Path:
    """`path` itself, or for a GGUF file the checkpoint directory it converts to."""
    return checkpoint_of(path) if is_gguf(path) else Path(path)


def checkpoint_of(path: str | Path) -> Path:
    """The checkpoint directory converted from the GGUF file at `path` (made on first use,
    kept in the cache directory, keyed by the file's path, size and time)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    dst = paths.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (dst / DONE).is_file():
        return dst
    log.warning("converting %s once into %s (later starts read it from there)", path, dst)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert(path, tmp)
        (tmp / DONE).write_text(json.dumps({"source": str(path), "size": stat.st_size}))
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _convert(path: Path, dst: Path) -> None:
    try:
        from gguf import GGUFReader
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        raise CheckpointError(
            f"reading {path.name} needs the gguf package: pip install gguf ({e})"
        ) from e
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)
        fields = dict(parsed["config"])
        model_type = fields.pop("model_type")
        reader = GGUFReader(str(path))
        arch = str(reader.fields["general.architecture"].contents())
        key_length = reader.fields.get(f"{arch}.attention.key_length")
        if key_length is not None and "head_dim" not in fields:  # (Qwen3's: not in its map)
            fields["head_dim"] = int(key_length.contents())
        config = AutoConfig.for_model(model_type, **fields)
        quantized = any(t.tensor_type.name != "F32" for t in reader.tensors)
        dtype = torch.bfloat16 if quantized else torch.float32
        _check_room(path, dst, sum(int(t.n_elements) for t in reader.tensors) * dtype.itemsize)
        with torch.device("meta"):  # (the structure names the tensors; nothing allocated)
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
        tensors = tensors["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (KeyError, ValueError, OSError, NotImplementedError) as e:
        raise CheckpointError(f"cannot read {path} as a GGUF checkpoint: {e}") from e
    config.dtype = dtype
    config.architectures = [type(skeleton).__name__]  # (what the family is looked up by)
    config.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    eos = fields.get("eos_token_id")
    if eos is not None:  # (the turn's end token for the engine's stop list)
        (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    save_file({name: t.to(dtype).contiguous() for name, t in tensors.items()},
              str(dst / "model.safetensors"))  # fmt: skip


def _check_room(path: Path, dst: Path, nbytes: int) -> None:
    """Refuse, before dequantizing anything, a conversion that host memory (which holds every
    dequantized tensor at once) or the cache's disk cannot take."""
    for free, where in ((memory.available_host_bytes(), "host memory"),
                        (shutil.disk_usage(dst).free, str(dst))):  # fmt: skip
        if nbytes > free:
            raise CheckpointError(
                f"{path.name} dequantizes to {memory.gib(nbytes)}, more than the "
                f"{memory.gib(free)} free in {where}: freetoken keeps GGUF experts in their "
                "quantized types only in a later version; convert a smaller file, or the "
                "checkpoint this GGUF came from (ft checkpoint convert)"
            )
