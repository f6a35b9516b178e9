"""GGUF files (llama.cpp's format): `--model FILE.gguf` is converted once into a checkpoint
directory in the cache, which the engine then loads as any other.

The conversion is transformers' (its GGUF reader: the config from the file's hyper-parameters,
the tokenizer and chat template from its metadata, each tensor dequantized by the `gguf`
package and renamed to transformers' names), but for the routed experts: where every expert
tensor of the file is of one type the kernels read (or the gate and up projections of one and
the down projections of another), they are written as stored (exactly: the same values), and
weights/quantized.py reads them; the host pool, the fills and the kernels keep them so:

    Q8_0    32 int8 codes and an fp16 scale a block   `X_q8_0`, `X_q8_0_scales` (8.5 bits)
    Q4_K,   super-blocks of 256: fp16 scales, 6- or   `X_q4_k` (the blocks' 128 bytes of low
    Q5_K,   8-bit sub-block scales, 4-6 bit codes     4 bits), `X_q4_k_scales` (their other
    Q6_K                                              bytes: 4.5, 5.5, 6.56 bits)
    Q4_0,   blocks of 32: an fp16 scale (and an fp16    `X_q4_0` (the blocks' 16 bytes of low
    Q4_1,   min: Q4_1, Q5_1), 4-bit codes (and their  4 bits), `X_q4_0_scales` (their other
    Q5_0,   fifth bits: Q5_0, Q5_1)                   bytes: 4.5, 5.0, 5.5, 6.0 bits)
    Q5_1
    MXFP4   32 e2m1 codes and an e8m0 scale a block   `X_blocks`, `X_scales`, as gpt-oss's
            (llama.cpp's MXFP4_MOE files)             release (its codes reordered: GGUF
                                                      packs values j and j + 16 in a byte,
                                                      freetoken 2j and 2j + 1; 4.25 bits)

K-quant experts of several types (Q4_K_M and Q5_K_M files: some layers' down projections Q6_K)
are kept too, each tensor in its own type; the host pool holds such a projection as k_mixed
(weights/expert_format.py: every block's other bytes padded to Q6_K's, with its type). So are
the gate and up projections of one type beside such down projections (Qwen2.5's Q4_K_M files:
gate and up Q5_0).
The dense layers' 2-D weights (attention q/k/v/o, dense MLPs and shared experts, the output
head) of those types are kept as stored too, each as its parts beside its name (`_dense_parts`:
`model.layers.0.mlp.down_proj.weight_q4_k`, ...; rows in the order transformers' processor gives
them), and so is the token embedding of a model whose head is tied to it (no `output.weight`);
the loader keeps them so on the CPU, where a Linear computes from the blocks (a decode step then
streams the file's bytes, not 2-4x as many of bf16), and dequantizes them elsewhere (and the
embedding's table). The embedding of a model with its own head stays a dequantized table.
freetoken writes the rest as config.json, tokenizer files and safetensors, each dequantized
tensor in the narrowest of bf16, fp16 and fp32 that holds its values exactly (`_exact`), so an
engine computing in fp32 computes with the very values the file's blocks define (a Q4_1 or Q8_0
block's fp16 scale times its codes needs fp32: bf16 rounded 75% of a Q4_1 file's values and 97%
of a Q8_0 one's). Routed experts of other GGUF types, or of other mixes of types, are
dequantized to bf16 (the bulk of such a file, 2-4x its size in host memory and on disk as
it is; fp32 would double that; an fp32 engine reads them so rounded).
Families transformers reads from GGUF: Llama, Mistral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE,
gpt-oss (and others freetoken does not serve).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from freetoken import paths
from freetoken.errors import CheckpointError
from freetoken.models import gguf_header
from freetoken.progress import waiting
from freetoken.weights import memory
from freetoken.weights.quantized import K_QUANT_REST, LEGACY_REST

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
DONE = "freetoken-gguf.json"  # written last: a directory without it is incomplete
# The conversion's layout: a directory of another (an earlier release's) is converted again.
FORMAT = 3  # 3: dense layers kept as stored (2: dequantized, stored exactly; 1: in bf16)
# A layer's routed experts as llama.cpp stores them: [experts, rows, columns] each.
EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# Dense layers' weights a Linear computes from the blocks (attention, dense MLPs, shared experts,
# the output head)
DENSE_TENSOR = re.compile(
    r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down)(_shexp)?)\.weight"
    r"|output\.weight"
)
K_TYPES = tuple(name.upper() for name in K_QUANT_REST)  # Q4_K, Q5_K, Q6_K
LEGACY_TYPES = tuple(name.upper() for name in LEGACY_REST)  # Q4_0, Q4_1, Q5_0, Q5_1
# GGUF types whose experts are kept as stored -> the suffixes of their parts' names (codes,
# scales), as weights/quantized.py recognises them
KEPT_TYPES = {
    "Q8_0": ("_q8_0", "_q8_0_scales"),
    "MXFP4": ("_blocks", "_scales"),
    **{k: (f"_{k.lower()}", f"_{k.lower()}_scales") for k in (*K_TYPES, *LEGACY_TYPES)},
}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == SUFFIX and Path(path).is_file()


def resolve(path: str | Path, progress: bool | None = None) -> Path:
    """`path` itself, or for a GGUF file the checkpoint directory it converts to."""
    return checkpoint_of(path, progress) if is_gguf(path) else Path(path)


def checkpoint_of(path: str | Path, progress: bool | None = None) -> Path:
    """The checkpoint directory converted from the GGUF file at `path` (made on first use,
    kept in the cache directory, keyed by the file's path, size and time); `progress`: a bar
    over the file's tensors while it converts (None: on a terminal)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    dst = paths.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if _converted(dst):
        return dst
    gguf_header.check(path)  # (a file that cannot serve refused in ~0.1 s, not after a conversion)
    log.info("converting %s once into %s (later starts read it from there)", path, dst)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with waiting(f"converting {path.name} once (later starts read the conversion)"):
            _convert(path, tmp, progress)
        (tmp / DONE).write_text(
            json.dumps({"source": str(path), "size": stat.st_size, "format": FORMAT})
        )
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _converted(dst: Path) -> bool:
    """Whether `dst` holds a finished conversion in this release's layout."""
    try:
        return json.loads((dst / DONE).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _convert(path: Path, dst: Path, progress: bool | None = None) -> None:
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        raise CheckpointError(
            f"reading {path.name} needs the gguf package: pip install gguf ({e})"
        ) from e
    try:
        with _parsed_once(reader_class(), path) as reader:
            parsed = load_gguf_checkpoint(str(path), return_tensors=False)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        fields = dict(parsed["config"])
        config, arch = transformers_config(reader, fields)
        quantized = any(t.tensor_type.name != "F32" for t in reader.tensors)
        # (the engine's dtype under "auto"; each tensor is stored as `_stored` says)
        dtype = torch.bfloat16 if quantized else torch.float32
        kept = _kept_experts(reader) | _kept_dense(reader)
        _check_room(path, dst, sum(_stored_bytes(t, kept) for t in reader.tensors))
        with torch.device("meta"):  # (the structure names the tensors; nothing allocated)
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = _tensors(reader, arch, parsed["config"], skeleton, kept, progress)
    except (KeyError, ValueError, OSError, NotImplementedError) as e:
        raise CheckpointError(f"cannot read {path} as a GGUF checkpoint: {e}") from e
    config.dtype = dtype
    config.architectures = [type(skeleton).__name__]  # (what the family is looked up by)
    config.save_pretrained(dst)
    if kept:  # (weights/quantized.py's reader for the parts kept as stored)
        raw = json.loads((dst / "config.json").read_text())
        raw["quantization_config"] = {"quant_method": "gguf"}
        (dst / "config.json").write_text(json.dumps(raw, indent=2))
    tokenizer.save_pretrained(dst)
    eos = fields.get("eos_token_id")
    if eos is not None:  # (the turn's end token for the engine's stop list)
        (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    stored = {name: _stored(name, t) for name, t in tensors.items()}
    save_file({name: t.contiguous() for name, t in stored.items()}, str(dst / "model.safetensors"))


def transformers_config(reader, fields: dict):
    """(transformers' config, llama.cpp's architecture name) of the GGUF file `reader` reads,
    from `fields`, transformers' reading of its hyper-parameters, and the keys its map leaves
    out: Qwen3's head_dim, qwen2moe's expert widths, and whether the top-k weights are
    renormalised (which llama.cpp's qwen2moe never reads but models/moe_from_dense.py's files
    state)."""
    from transformers import AutoConfig

    fields = dict(fields)
    model_type = fields.pop("model_type")
    arch = str(reader.fields["general.architecture"].contents())
    for key, name, kind in (
        ("attention.key_length", "head_dim", int),
        ("expert_feed_forward_length", "moe_intermediate_size", int),
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", int),
        ("expert_weights_norm", "norm_topk_prob", bool),
    ):
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None and name not in fields:
            fields[name] = kind(field.contents())
    return AutoConfig.for_model(model_type, **fields), arch


@contextmanager
def _one_name_map():
    """transformers' `get_gguf_hf_weights_map` builds the gguf package's name map afresh for
    every module of the model it recurses into (397 for SmolLM2-135M: 12 s of a conversion);
    while this is open, one per architecture and depth is built, and kept."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@functools.cache
def reader_class():
    """`gguf.GGUFReader` reading through a plain ndarray view of its map: the package slices
    an `np.memmap` for every value, and each slice of a memmap runs its Python
    `__array_finalize__`: a 151,936-token vocabulary parsed in 13.2 s, 5.7 s through the
    plain view (Qwen2.5-Coder-0.5B's file on the 2-core machine). The arrays are the same
    bytes; the map stays open through their bases."""
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return PlainViewReader


@contextmanager
def _parsed_once(reader_class, path: Path):
    """The file's reader, parsed once for the whole conversion: transformers' GGUF helpers
    (the config, then the tokenizer, which reads the config again) each construct their own
    `gguf.GGUFReader`, and each parse of a 151,936-entry vocabulary takes 5-6 s (three were 17 s
    of a 22 s conversion). While this is open, the gguf package hands them this one; the reader
    only maps the file, so sharing it is safe."""
    import gguf

    reader = reader_class(str(path))
    target = path.resolve()

    def shared(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == target:
            return reader
        return reader_class(file, *args, **kwargs)

    original, gguf.GGUFReader = gguf.GGUFReader, shared
    try:
        yield reader
    finally:
        gguf.GGUFReader = original


def _stored(name: str, t: torch.Tensor) -> torch.Tensor:
    """A converted tensor as written: kept parts and dequantized routed experts (bf16 already:
    `_tensors`) as they are, the rest `_exact`."""
    if name.endswith(_KEPT_SUFFIXES) or t.dtype == torch.bfloat16:
        return t  # (the experts are the bulk of a file: no fp32 copy of them to compare)
    return _exact(t)


def _stored_bytes(t, kept: set[str]) -> int:
    """The most bytes file tensor `t` takes once converted (`_stored`)."""
    if t.name in kept:
        return int(t.n_bytes)
    half = EXPERT_TENSOR.fullmatch(t.name) or t.tensor_type.name in ("F16", "BF16")
    return int(t.n_elements) * (2 if half else 4)


def _exact(t: torch.Tensor) -> torch.Tensor:
    """A dequantized tensor (fp32) in the narrowest float type that holds its values exactly:
    bf16 (the GPU's compute type), fp16 (F16 files), else fp32 (a quantized block's scale times
    its codes: an fp16 scale's 11 significant bits times codes of 4-8 bits)."""
    t = t.float()
    for narrow in (torch.bfloat16, torch.float16):
        n = t.to(narrow)
        if torch.equal(n.float(), t):
            return n
    return t


_KEPT_SUFFIXES = tuple(suffix for suffixes in KEPT_TYPES.values() for suffix in suffixes)


def _kept_experts(reader) -> set[str]:
    """The names of the expert tensors kept as stored: all of them where each projection's are
    of one type the kernels read, or all K-quants (Q4_K_M and Q5_K_M files: some layers' down
    projections Q6_K; the loader keeps such a projection as k_mixed), with each layer's gate
    and up of one type (they are stacked in one bank row), and the two projections' types a
    pair the kernels take together (MXFP4 beside no other); else none (a mix would be
    dequantized at load anyway)."""
    experts = [t for t in reader.tensors if EXPERT_TENSOR.fullmatch(t.name)]
    types = {t.tensor_type.name for t in experts}
    gate_up: dict[str, set[str]] = {}  # layer -> its gate's and up's types
    by_projection: dict[str, set[str]] = {"gate_up": set(), "down": set()}
    for t in experts:
        m = EXPERT_TENSOR.fullmatch(t.name)
        kind = t.tensor_type.name
        by_projection["down" if m[2] == "down" else "gate_up"].add(kind)
        if m[2] != "down":
            gate_up.setdefault(m[1], set()).add(kind)
    stackable = all(len(kinds) == 1 for kinds in gate_up.values())
    kept = all(
        (len(kinds) == 1 and kinds <= set(KEPT_TYPES)) or kinds <= set(K_TYPES)
        for kinds in by_projection.values()
    )
    if kept and stackable and (len(types) == 1 or "MXFP4" not in types):
        return {t.name for t in experts}
    if experts:
        kinds = "/".join(sorted(types))
        why = (
            f"a layer's gate and up projections differ in type ({kinds})"
            if not stackable
            else f"they are of several types ({kinds})"
            if len(types) > 1
            else f"the kernels do not take {kinds} as stored"
        )
        log.warning(
            "the routed experts are dequantized to bf16: %s (kept as stored: each "
            "projection's experts all of one of %s, or all K-quants)",
            why,
            ", ".join(KEPT_TYPES),
        )
    return set()


def _kept_dense(reader) -> set[str]:
    """The names of the dense layers' 2-D weights kept as stored: those of a type the kernels
    read (KEPT_TYPES), and, where the file has no output head (the model ties it to the
    embedding), the token embedding for the head (the loader dequantizes the table from it)."""
    names = {t.name for t in reader.tensors}
    return {
        t.name
        for t in reader.tensors
        if (
            DENSE_TENSOR.fullmatch(t.name)
            or (t.name == "token_embd.weight" and "output.weight" not in names)
        )
        and len(t.shape) == 2
        and t.tensor_type.name in KEPT_TYPES
    }


def _dense_parts(t, processor, names: dict[str, str], out: dict) -> bool:
    """A dense layer's weight of a kept type as its parts under transformers' name, its rows in
    the order the architecture's processor gives them (Llama's q and k projections: permuted
    back from llama.cpp's rotary layout; a block spans columns, so rows move whole). False,
    with nothing written, where the processor does more than order the rows (then dequantized)."""
    rows = t.data.shape[0]
    index = np.arange(rows, dtype=np.float64)[:, None]  # (each row's number, through it)
    probe = processor.process(
        weights=index, name=t.name, tensor_key_mapping=names, parsed_parameters={"tensors": {}}
    )
    order = np.asarray(probe.weights).reshape(-1)
    if (
        probe.name not in names
        or order.shape != (rows,)
        or not np.array_equal(np.sort(order), np.arange(rows))
    ):
        return False
    order = order.astype(np.int64)
    kind = t.tensor_type.name
    for suffix, value in zip(KEPT_TYPES[kind], _PARTS[kind](t.data), strict=True):
        out[names[probe.name] + suffix] = torch.from_numpy(np.ascontiguousarray(value[order]))
    return True


def _tensors(
    reader, arch: str, config: dict, skeleton, kept: set[str], progress: bool | None = None
) -> dict:
    """Every tensor of the file under transformers' names: dequantized and laid out by
    transformers' GGUF tensor processor for the architecture (as its own loader does), the
    `kept` experts as their parts (`_expert_parts`), the other routed experts in bf16."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    with _one_name_map():
        names = get_gguf_hf_weights_map(skeleton, processor)
    parsed = {"tensors": {}}  # (the processors write merged tensors here)
    out = parsed["tensors"]
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(
        total=sum(int(t.n_bytes) for t in reader.tensors),
        unit="B",
        unit_scale=True,
        desc="Converting",
        disable=not show,
    ) as bar:
        for t in reader.tensors:
            if t.name in kept and EXPERT_TENSOR.fullmatch(t.name):
                _expert_parts(t, names, out)
            elif not (t.name in kept and _dense_parts(t, processor, names, out)):
                _dequantized(t, processor, names, parsed, dequantize)
            bar.update(int(t.n_bytes))
    return out


def _dequantized(t, processor, names: dict[str, str], parsed: dict, dequantize) -> None:
    """File tensor `t` dequantized into `parsed["tensors"]` under transformers' name by the
    architecture's processor (which merges some: a layer's gate and up experts into one), a
    routed expert's in bf16 at once (the bulk of the file; a merge's later part is cast as it
    is copied in)."""
    out = parsed["tensors"]
    before = {name: id(value) for name, value in out.items()}
    result = processor.process(
        weights=dequantize(t.data, t.tensor_type),
        name=t.name,
        tensor_key_mapping=names,
        parsed_parameters=parsed,
    )
    if result.name in names:  # (None: merged by the processor; else not the model's)
        out[names[result.name]] = torch.from_numpy(np.copy(result.weights))
    if EXPERT_TENSOR.fullmatch(t.name):
        for name, value in out.items():
            if before.get(name) != id(value) and value.dtype != torch.bfloat16:
                out[name] = value.to(torch.bfloat16)


def _expert_parts(t, names: dict[str, str], out: dict) -> None:
    """A layer's expert tensor of a kept type as its parts under the fused names (the gate and
    up projections stacked, gate first, as transformers lays `gate_up_proj` out)."""
    m = EXPERT_TENSOR.fullmatch(t.name)
    base = names[f"blk.{m[1]}.ffn_{m[2]}_exps"]
    kind = t.tensor_type.name
    for suffix, value in zip(KEPT_TYPES[kind], _PARTS[kind](t.data), strict=True):
        value = torch.from_numpy(value)
        if m[2] == "down":
            out[base + suffix] = value
            continue
        rows = value.shape[1]
        whole = out.setdefault(
            base + suffix, value.new_zeros(value.shape[0], 2 * rows, *value.shape[2:])
        )
        (whole[:, :rows] if m[2] == "gate" else whole[:, rows:]).copy_(value)


def _q8_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks (bytes [..., K / 32 * 34]: an fp16 scale, then 32 int8 codes, a block) ->
    (codes int8 [..., K], scales fp16 [..., K / 32])."""
    blocks = data.reshape(*data.shape[:-1], -1, 34)
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return codes.reshape(*data.shape[:-1], -1), np.ascontiguousarray(scales)


def _mxfp4(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 blocks (bytes [..., K / 32 * 17]: an e8m0 scale, then 16 bytes whose low
    nibbles are values 0-15 and high nibbles values 16-31) -> (blocks uint8 [..., K / 32, 16]
    with value 2j in byte j's low nibble and 2j + 1 in its high one, scales uint8 [..., K / 32]).
    The same e2m1 codes and scales: ggml's table holds twice the e2m1 values and its scale
    half of 2^(e - 127), whose product is the e2m1 value times 2^(e - 127) as in OCP MX."""
    blocks = data.reshape(*data.shape[:-1], -1, 17)
    codes = blocks[..., 1:]
    values = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)  # [..., G, 32] in order
    packed = values[..., 0::2] | (values[..., 1::2] << 4)
    return np.ascontiguousarray(packed), np.ascontiguousarray(blocks[..., 0])


def _k_quant(kind: str):
    """K-quant super-blocks (bytes [..., K / 256 * B]) -> (their low-4-bit code bytes [..., K /
    2], their other bytes [..., K / 256 * (B - 128)]), each block's in its order
    (weights/quantized.py's `k_quant_values` reads them so)."""
    rest = K_QUANT_REST[kind.lower()]

    def split(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks = data.reshape(*data.shape[:-1], -1, 128 + rest)
        # Q6_K starts with its codes; Q4_K and Q5_K end with them
        codes, other = (
            (blocks[..., :128], blocks[..., 128:])
            if kind == "Q6_K"
            else (blocks[..., rest:], blocks[..., :rest])
        )
        lead = data.shape[:-1]
        return (
            np.ascontiguousarray(codes).reshape(*lead, -1),
            np.ascontiguousarray(other).reshape(*lead, -1),
        )

    return split


def _legacy(kind: str):
    """Legacy blocks of 32 (bytes [..., K / 32 * B]: an fp16 d, Q4_1's and Q5_1's fp16 m, Q5_0's
    and Q5_1's 4 bytes of fifth bits, then 16 bytes of low 4 bits) -> (their code bytes [...,
    K / 2], their other bytes [..., K / 32 * (B - 16)]), as weights/quantized.py's
    `legacy_values` reads them."""
    rest = LEGACY_REST[kind.lower()]

    def split(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks = data.reshape(*data.shape[:-1], -1, 16 + rest)
        lead = data.shape[:-1]
        return (
            np.ascontiguousarray(blocks[..., rest:]).reshape(*lead, -1),
            np.ascontiguousarray(blocks[..., :rest]).reshape(*lead, -1),
        )

    return split


# KEPT_TYPES' blocks -> (codes, scales)
_PARTS = {
    "Q8_0": _q8_0,
    "MXFP4": _mxfp4,
    **{k: _k_quant(k) for k in K_TYPES},
    **{k: _legacy(k) for k in LEGACY_TYPES},
}


def _check_room(path: Path, dst: Path, nbytes: int) -> None:
    """Refuse, before dequantizing anything, a conversion that host memory (which holds every
    dequantized tensor at once) or the cache's disk cannot take."""
    for free, where in (
        (memory.available_host_bytes(), "host memory"),
        (shutil.disk_usage(dst).free, str(dst)),
    ):
        if nbytes > free:
            raise CheckpointError(
                f"{path.name} converts to {memory.gib(nbytes)}, more than the "
                f"{memory.gib(free)} free in {where}: freetoken keeps GGUF experts as stored "
                f"only in {', '.join(KEPT_TYPES)} (others are dequantized); use a file "
                "of those, a smaller one, or the checkpoint this GGUF came from"
            )
