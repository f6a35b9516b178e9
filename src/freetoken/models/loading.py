"""Load a local checkpoint into the shared decoder: a Hugging Face safetensors directory, or
freetoken's own weight directory (weights/weight_dir.py), which `convert_checkpoint` writes
from one.

Before reading any weight, the load refuses a model free host memory cannot hold (sized from
the headers). The model is made empty (`DecoderModel.empty`: no random init), then filled
tensor by tensor under the family's names; per-expert tensors are stacked into the host pool's
banks (moe/store.py), kept quantized where the checkpoint stores them in a format the kernels
read (`expert_storage`); missing tensors are named."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from freetoken import native_preload
from freetoken.errors import CheckpointError, InsufficientMemoryError
from freetoken.kernels import cpu_team, triton_start
from freetoken.model_config import ModelConfig
from freetoken.models import gguf
from freetoken.models.decoder import DecoderModel
from freetoken.models.families import family_for
from freetoken.moe.store import BANK_NAMES, ExpertShape, HostExpertStore
from freetoken.progress import waiting
from freetoken.weights import dir_io, early_read, memory
from freetoken.weights import weight_dir as wd
from freetoken.weights.expert_format import (
    DENSE,
    K_MIXED,
    K_QUANTS,
    SPLIT_FORMATS,
    ExpertFormat,
    QuantizedWeight,
    bank_parts,
    expert_format,
)
from freetoken.weights.quantized import QuantizedParts
from freetoken.weights.safetensors_dir import CheckpointDir

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# One expert's projection in the per-expert layout every Hub checkpoint uses.
_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# All experts of a layer at once (the fused layout transformers 5 uses in memory).
_FUSED = re.compile(r"^layers\.(\d+)\.moe\.experts\.(gate_up_proj|down_proj)$")
_BIAS_BANK = re.compile(r"^layers\.(\d+)\.moe\.gate_up_proj_bias$")
# Headroom beyond the weights for activations, the KV cache and the Python process itself.
HOST_MEMORY_MARGIN = 512 * 2**20


@dataclass
class LoadedModel:
    model: DecoderModel  # everything but the routed experts, on the requested device
    config: ModelConfig
    path: Path
    raw_config: dict
    experts: HostExpertStore | None  # routed experts of every MoE layer, in host memory
    integrity: wd.IntegrityCheck | None = None  # a weight directory's checksums, being verified


def resolve_dtype(name: str | torch.dtype | None, config_dtype: str) -> torch.dtype:
    """`auto` (or None) follows the checkpoint's dtype; fp32 checkpoints stay fp32."""
    if isinstance(name, torch.dtype):
        return name
    key = config_dtype if name in (None, "auto") else name
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(f"unsupported dtype {key!r}; use one of {sorted(DTYPES)}") from None


def load_model(
    path: str | Path,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    verify: bool = False,
    dequantize_experts: bool = False,
    dequantize_dense: bool = False,
    mtp: str = "off",
) -> LoadedModel:
    """`verify`: a weight directory's expert banks are checked against their checksums
    before this returns (else on a background thread, `LoadedModel.integrity`); the dense
    tensors always are. A safetensors checkpoint has no checksums. Routed experts a checkpoint
    stores quantized stay so (`expert_storage`) unless `dequantize_experts`; dense layers a GGUF
    conversion kept quantized stay so on the CPU (`dense_storage`) unless `dequantize_dense`.
    `mtp`: the next-token-prediction layer is read ("on": an MTPUnavailableError where the
    checkpoint has none; "auto": where it has one) or skipped ("off": no memory spent on it)."""
    if mtp not in MTP_CHOICES:
        raise ValueError(f"mtp must be one of {', '.join(MTP_CHOICES)}, not {mtp!r}")
    _start_device_in_background(torch.device(device))
    if wd.is_weight_dir(path):
        if mtp == "on":
            raise MTPUnavailableError(
                f"{path} is a weight directory, which holds no next-token-prediction (MTP) "
                "layer: load the safetensors checkpoint to draft with it"
            )
        return _load_weight_dir(Path(path), dtype, device, progress, verify, dequantize_experts)
    ckpt = CheckpointDir(path)
    family, cfg = _parse(ckpt.config, ckpt.path)
    cfg = _mtp_config(ckpt, family, cfg, mtp)
    dtype = resolve_dtype(dtype, cfg.torch_dtype)
    fmt, kept, down = expert_storage(ckpt, family, cfg, dequantize_experts)
    dense = frozenset() if dequantize_dense else dense_storage(ckpt, family, cfg, dtype, device)
    need = ckpt.nbytes(dtype, kept | dense)
    if down is not None:  # (k_mixed pads its blocks: the pool is larger than the file's experts)
        parts = [p for n in kept for p in ckpt.quantized.tensors[n].parts]
        stored = sum(ckpt.tensors[p].stored_bytes for p in parts)
        need += _pool_bytes(cfg, dtype, fmt, down) - stored
    # (a tied embedding kept for the head: its table is dequantized beside it)
    need += sum(
        ckpt.quantized.tensors[n].numel * dtype.itemsize
        for n in dense
        if family.canonical_name(n) == "embed.weight"
    )
    kept |= dense
    _admit(ckpt.path, need, dtype)
    if ckpt.quantized.tensors:
        log.info(
            "%s: %d tensors stored %s, %d of them routed experts and %d dense layers kept so; "
            "the others are dequantized to %s as they load: the model takes %s of host memory "
            "(%s on disk)",
            ckpt.path.name,
            len(ckpt.quantized.tensors),
            ckpt.quantized.method,
            len(kept) - len(dense),
            len(dense),
            str(dtype).removeprefix("torch."),
            memory.gib(ckpt.nbytes(dtype, kept)),
            memory.gib(ckpt.nbytes()),
        )
    model, store = _empty_model(cfg, dtype, fmt, down)
    _fill(model, store, ckpt, family, progress, kept)
    model = model.to(device)
    model.stack_projections()
    return LoadedModel(model.eval(), cfg, ckpt.path, ckpt.config, store)


MTP_CHOICES = ("off", "on", "auto")


class MTPUnavailableError(CheckpointError):
    """MTP drafting was asked for, but the checkpoint has no next-token-prediction layer that
    freetoken reads."""


def mtp_missing(ckpt: CheckpointDir, family, cfg: ModelConfig) -> str | None:
    """Why the checkpoint's MTP layer cannot be read, or None where it can: its config
    declares none (or one of a layout not read), or its tensors are not there (quantized
    and converted releases often leave them out)."""
    declared = ckpt.config.get("num_nextn_predict_layers") or ckpt.config.get(
        "mtp_num_hidden_layers"
    )
    if cfg.mtp_layers < 1 or cfg.compressed is not None or cfg.layer_attention:
        if declared:
            return f"freetoken does not read {cfg.family}'s next-token-prediction layer yet"
        return (
            f"{ckpt.path.name} has no next-token-prediction (MTP) layer: its config sets no "
            "num_nextn_predict_layers or mtp_num_hidden_layers"
        )
    names = (*ckpt.tensors, *ckpt.quantized.tensors)  # (the names tested first: cheaper)
    if not any(
        ("eh_proj" in n or ".fc." in n) and family.canonical_name(n) == "mtp.eh_proj.weight"
        for n in names
    ):
        return (
            f"{ckpt.path.name}'s config declares {cfg.mtp_layers} next-token-prediction (MTP) "
            "layer(s), but the checkpoint holds no tensor of one"
        )
    return None


def _mtp_config(ckpt: CheckpointDir, family, cfg: ModelConfig, mtp: str) -> ModelConfig:
    """`cfg` with its MTP layer where `mtp` asks for it and the checkpoint has one."""
    if mtp == "off":
        return cfg
    why = mtp_missing(ckpt, family, cfg)
    if why is None:
        return cfg.with_mtp()
    if mtp == "on":
        raise MTPUnavailableError(f"{why}; draft with --speculative ngram (or auto) instead")
    log.debug("no MTP layer read: %s", why)
    return cfg


def _start_device_in_background(device: torch.device) -> None:
    """Create the CUDA context on a thread while the weights load (0.5-2 s that the first
    copy to the device would otherwise wait for; torch's lazy initialisation is thread-safe
    and happens once), and compute Triton's once-a-process cache key (triton_start.py)."""
    if device.type == "cuda" and torch.cuda.is_available():
        threading.Thread(
            target=lambda: torch.empty(1, device=device), name="ft-device-init", daemon=True
        ).start()
        triton_start.begin()


def _is_expert(name: str | None) -> bool:
    """Whether a canonical tensor name is a routed expert's weight (one expert's projection,
    or a layer's stacked projection)."""
    return name is not None and bool(_EXPERT.match(name) or _FUSED.match(name))


def expert_storage(
    ckpt: CheckpointDir, family, cfg: ModelConfig, dequantize: bool = False
) -> tuple[ExpertFormat, frozenset[str], ExpertFormat | None]:
    """How the host pool holds a checkpoint's routed experts: (format, the names of the
    quantized tensors kept so, the down projection's format where it differs). Kept where
    each projection's experts are stored in one format whose blocks the banks can lay out, or
    in K-quants (a projection whose tensors differ in type kept as k_mixed: a Q4_K_M file's
    down projections, beside gate and up in Q4_K or Q5_0); dense (dequantized at load, said
    why) else."""
    quantized = ckpt.quantized
    if cfg.moe is None or not quantized.tensors:
        return DENSE, frozenset(), None
    experts = {n: q for n, q in quantized.tensors.items() if _is_expert(family.canonical_name(n))}
    if not experts:
        return DENSE, frozenset(), None
    plain = [
        n for n in ckpt.tensors if n not in quantized.parts and _is_expert(family.canonical_name(n))
    ]
    formats = sorted({q.format for q in experts.values()})
    by_projection: dict[str, set[str]] = {"gate_up": set(), "down": set()}
    for name, q in experts.items():
        by_projection[_projection(family.canonical_name(name))].add(q.format)
    # a projection of several formats: K-quants only (k_mixed); the two projections may differ
    # but for the formats whose CPU routes read x split for the gate/up one's
    several = [
        kinds for kinds in by_projection.values() if len(kinds) > 1 and not kinds <= set(K_QUANTS)
    ]
    fmt, down, why = DENSE, None, None
    if dequantize:
        why = "asked to (--dequantize-experts)"
    elif several or (len(formats) > 1 and set(formats) & SPLIT_FORMATS):
        why = f"they are stored in several formats ({', '.join(formats)})"
    elif plain:
        why = f"some are not quantized ({plain[0]})"
    else:
        fmt, down = (
            expert_format(kinds.pop(), quantized.fp8_block) if len(kinds) == 1 else K_MIXED
            for kinds in by_projection.values()
        )
        h, i = cfg.hidden_size, cfg.moe.intermediate_size
        try:
            fmt.check(2 * i, h)
            down.check(h, i)
        except ValueError as e:
            fmt, why = DENSE, str(e)
        if fmt.quantized and not fmt.stacks(i):
            blocks = fmt.row_block
            fmt = DENSE
            why = f"{blocks}-row scale blocks straddle the gate and up projections (I = {i})"
    if why is not None:
        say = log.info if dequantize else log.warning
        say("routed experts stored %s are dequantized at load: %s", "/".join(formats), why)
        return DENSE, frozenset(), None
    return fmt, frozenset(experts), None if down == fmt else down


# Dense layers whose Linear may compute from a quantized weight (layers/linear.py): attention,
# dense MLPs, shared experts, the output head (not MLA's kv_b_proj, whose weight MLA reads)
_DENSE_LINEAR = re.compile(
    r"^(layers\.\d+\.(attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|moe\.shared\.(gate|up|down)_proj)"
    r"|lm_head)\.weight$"
)


def dense_storage(
    ckpt: CheckpointDir, family, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device
) -> frozenset[str]:
    """The quantized tensors of dense layers kept as stored (their Linear computes from them):
    a GGUF conversion's (models/gguf.py), on the CPU with the native kernel there, in a dtype
    it computes (bf16, fp32), in a format it reads, for a family that lays its tensors out as
    stored (no `to_layout`); a tied model's embedding too, for its output head (the table is
    dequantized from it). Elsewhere they are dequantized at load: dense weights on a GPU are
    best as bf16 today (no kernel there reads the blocks, and the memory is there)."""
    if (
        ckpt.quantized.method != "gguf"
        or torch.device(device).type != "cpu"
        or dtype not in (torch.bfloat16, torch.float32)
        or family.to_layout is not None
        or cpu_team.library() is None
    ):
        return frozenset()
    kept = set()
    for name, q in ckpt.quantized.tensors.items():
        canonical = family.canonical_name(name)
        head = canonical == "embed.weight" and cfg.tie_word_embeddings
        if canonical is None or not (head or _DENSE_LINEAR.match(canonical)) or len(q.shape) != 2:
            continue
        try:
            expert_format(q.format).check(*q.shape)
        except ValueError:
            continue
        kept.add(name)
    return frozenset(kept)


def _projection(name: str) -> str:
    """The bank ("gate_up" or "down") a canonical expert tensor's name goes to."""
    return "down" if name.endswith(("down_proj", "down_proj.weight")) else "gate_up"


def _parse(raw: dict, path: Path):
    family = family_for(raw)
    try:
        return family, family.parse_config(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'} is incomplete or invalid: {e!r}") from e


def _admit(path: Path, nbytes: int, dtype: torch.dtype) -> None:
    """Refuse, with what to do, a model host memory cannot hold."""
    needed = nbytes + HOST_MEMORY_MARGIN
    free = memory.available_host_bytes()
    if needed > free:
        limit = memory.cgroup_limit()
        where = f" (this container's memory limit is {memory.gib(limit)})" if limit else ""
        raise InsufficientMemoryError(
            f"{path.name} needs about {memory.gib(needed)} of host memory to load at "
            f"{str(dtype).removeprefix('torch.')}, but only {memory.gib(free)} is free{where}"
        )


def _empty_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    fmt: ExpertFormat = DENSE,
    down: ExpertFormat | None = None,
):
    model = DecoderModel.empty(cfg, dtype, "cpu")
    store = HostExpertStore.for_model(cfg, dtype, fmt, down) if cfg.moe is not None else None
    return model, store


# -- freetoken's weight directory (its files: weights/weight_dir.py, a model's tensors in it and
# their reads: weights/dir_io.py) ---------------------------------------------------------------


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    dtype: str = "auto",
    progress: bool | None = None,
    dequantize_experts: bool = False,
) -> Path:
    """Write `src` (a safetensors checkpoint, or a GGUF file: converted first, models/gguf.py)
    as a weight directory at `dst`: the model's parameters and the host pool's banks exactly as
    loading holds them (quantized experts kept so unless `dequantize_experts`)."""
    src, dst = gguf.resolve(src, progress), Path(dst)
    if wd.is_weight_dir(src):
        raise CheckpointError(f"{src} is a weight directory already")
    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty: give a new directory")
    # (dense layers dequantized: the directory holds every parameter as the model's dtype)
    loaded = load_model(
        src, dtype, "cpu", progress, dequantize_experts=dequantize_experts, dequantize_dense=True
    )
    write_weight_dir(loaded, dst, wd.copied_files(src), progress)
    return dst


def write_weight_dir(
    loaded: LoadedModel, dst: Path, copy: list[Path], progress: bool | None = None
) -> None:
    """`loaded`'s parameters and host pool (in CPU memory) as a weight directory at `dst`, with
    the files `copy` (config and tokenizer) beside them."""
    experts = loaded.experts
    dtype_name = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    meta = {"dtype": dtype_name, "source": loaded.path.name}
    if experts is not None and experts.format.quantized:
        meta |= dir_io.expert_meta(experts.format, experts.shape.down_format)
    banks = None if experts is None else experts.named_banks
    dir_io.write_model(dst, loaded.model.named_parameters(), banks, meta, copy, progress)
    if "quantization_config" in loaded.raw_config:
        # the directory holds the other weights dequantized (weights/quantized.py) and the
        # experts as `expert_format` in its index says: config.json no longer describes them
        raw = {k: v for k, v in loaded.raw_config.items() if k != "quantization_config"}
        (dst / "config.json").write_text(json.dumps(raw, indent=2))


def _load_weight_dir(
    path: Path, dtype, device, progress, verify: bool, dequantize_experts: bool = False
) -> LoadedModel:
    early = early_read.claim(path)  # (the files' reads begun at the start, if they were)
    cuda = torch.device(device).type == "cuda"
    pool_lock = None if early is None else early.pool_lock_for_load(cuda, dequantize_experts)
    try:
        return _read_weight_dir(
            path, dtype, device, progress, verify, dequantize_experts, early, pool_lock
        )
    except BaseException:
        if pool_lock is not None:  # (unlocked before its memory goes)
            pool_lock.release()
        raise


def _read_weight_dir(
    path: Path,
    dtype,
    device,
    progress,
    verify: bool,
    dequantize_experts: bool,
    early: early_read.EarlyRead | None,
    pool_lock: memory.PageLock | None,
) -> LoadedModel:
    """The model in weight directory `path`: checked, built on the meta device, its pool's
    banks placed (`_place_banks`), read (dir_io.DirLoad), copied to `device`, checked."""
    cuda = torch.device(device).type == "cuda"
    weights = wd.WeightDir(path)
    raw = CheckpointDir.read_config(path)
    _, cfg = _parse(raw, path)
    stored = _stored_dtype(weights, dtype, cfg, path)
    fmt, down = dir_io.stored_formats(weights)
    dequantize = dequantize_experts and fmt.quantized and cfg.moe is not None
    need = weights.nbytes + (_pool_bytes(cfg, stored, DENSE) if dequantize else 0)
    if early is not None:  # (what it has read is in memory already: no longer free)
        need -= early.done_bytes
    _admit(path, need, stored)
    log.debug("index and config read")
    _log_native_preload()
    model = DecoderModel.on_meta(cfg, stored)
    load = dir_io.DirLoad(weights, early, progress)
    load.pairs(dir_io.PARAM, model.named_parameters())  # (all there)
    store = HostExpertStore.for_model(cfg, stored, fmt, down) if cfg.moe is not None else None
    log.debug("model built on the meta device, the pool's banks allocated")
    banks = [] if store is None else load.pairs(dir_io.BANK, store.named_banks.items())
    banks = _place_banks(load, store, banks, cuda, pool_lock)  # (no lock where dequantized)

    def materialize() -> list:
        model.materialize("cpu")
        return load.pairs(dir_io.PARAM, model.named_parameters())

    dense = load.read(banks, materialize)
    with load.checking_dense(dense):
        if cuda and load.early_dense:  # copied from page-locked memory: at the link's speed
            with load.dense_locked():
                model.to(device, non_blocking=True)
                torch.cuda.synchronize(device)
        else:
            model.to(device)
        log.debug("model on %s", device)
    integrity = load.check_banks(banks, now=verify or dequantize)  # (dequantized: checked first)
    if dequantize:
        log.info("routed experts stored %s are dequantized at load: asked to", fmt.name)
        store = _dequantized(store, cfg)
    model.stack_projections()
    return LoadedModel(model.eval(), cfg, path, raw, store, integrity)


def _stored_dtype(weights: wd.WeightDir, dtype, cfg: ModelConfig, path: Path) -> torch.dtype:
    """The dtype `weights` holds, refused unless it is the one asked for (`dtype`)."""
    stored = DTYPES.get(weights.meta.get("dtype", ""))
    want = resolve_dtype(dtype, weights.meta.get("dtype", cfg.torch_dtype))
    if stored is None or want != stored:
        raise CheckpointError(
            f"{path} holds {weights.meta.get('dtype')} weights; load it with --dtype auto, or "
            f"convert the checkpoint again with --dtype {str(want).removeprefix('torch.')}"
        )
    return stored


def _log_native_preload() -> None:
    """What the start's native preload did GIL-free (native_preload.py), if it ran."""
    if (preload := native_preload.started()) is not None:
        log.debug(
            "native preload %s: %s",
            "done" if preload.wait(0) else "still running",
            ", ".join(f"{k} {v:.3f} s" for k, v in preload.timings.items()),
        )


def _place_banks(
    load: dir_io.DirLoad,
    store: HostExpertStore | None,
    banks: list,
    cuda: bool,
    pool_lock: memory.PageLock | None,
) -> list:
    """The pool's banks made the tensors that hold their bytes where there are such
    (`DirLoad.place_banks`: the early read's memory, whose page lock the store adopts, or the
    page cache's pages); `pool_lock` released where it is not the banks' memory after all.
    The (entry, bank) pairs to read and check."""
    placed = load.place_banks(banks, cuda)
    if placed is not None:
        for entry, view in placed:
            store.named_banks[entry.name.removeprefix(dir_io.BANK)] = view
        # (mapped from the page cache, read-only: where the lock fails, `pin` copies the pool
        # into memory of its own first, as for a CPU start's mapping)
        store.mapped = load.banks_mapped
        banks = placed
    if load.early_banks and pool_lock is not None:
        store.adopt_page_lock(pool_lock)
    elif pool_lock is not None:
        pool_lock.release()
    return banks


def _pool_bytes(
    cfg: ModelConfig, dtype: torch.dtype, fmt: ExpertFormat, down: ExpertFormat | None = None
) -> int:
    """Host memory of the expert pool of `cfg` in `fmt` (the down projection in `down`)."""
    return cfg.num_moe_layers * cfg.moe.num_experts * ExpertShape.of(cfg, dtype, fmt, down).nbytes


def _dequantized(store: HostExpertStore, cfg: ModelConfig) -> HostExpertStore:
    """A dense pool of `store`'s experts, dequantized to the model's dtype layer by layer."""
    dense = HostExpertStore.for_model(cfg, store.shape.dtype)
    w, dtype = store.weights, store.shape.dtype
    for layer in range(store.num_layers):
        rows = store.layer_rows(layer)
        dense.w_gate_up[rows] = w.gate_up.dequantize(rows, dtype)
        dense.w_down[rows] = w.down.dequantize(rows, dtype)
    if store.b_gate_up is not None:
        dense.b_gate_up.copy_(store.b_gate_up)
    return dense


def _fill(
    model: DecoderModel,
    store: HostExpertStore | None,
    ckpt: CheckpointDir,
    family,
    progress: bool | None,
    kept: frozenset[str] = frozenset(),
) -> None:
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    if store is not None:
        # The expert banks are filled in place in the host pool, one layer's rows at a time.
        for i in range(store.num_layers):
            rows = store.layer_rows(i)
            for name, bank in store.named_banks.items():
                params[f"moe.{i}.{name}"] = bank[rows]
    moe_index = {layer: i for i, layer in enumerate(model.config.moe_layer_ids)}
    filled: set[str] = set()
    unused: list[str] = []
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(
        total=ckpt.nbytes(), unit="B", unit_scale=True, desc="Loading weights", disable=not show
    )
    # (off a terminal: a line now and every few seconds, for a log)
    said = contextlib.nullcontext() if show else waiting("loading weights")
    with torch.no_grad(), bar, said:

        def wanted(stored: str) -> bool:  # (what the model has: no dequantizing the rest)
            name = family.canonical_name(stored)
            return name is not None and _target(name, params, moe_index) is not None

        for stored, tensor, nbytes in ckpt.iter_weights(wanted, kept.__contains__):
            bar.update(nbytes)
            name = family.canonical_name(stored)
            target = _target(name, params, moe_index) if name else None
            if target is None:
                unused.append(stored)
                continue
            key = target[0]
            if isinstance(tensor, QuantizedParts) and not _is_expert(name):
                _keep_dense(model, name, tensor, stored)
                filled.add(key)
                continue
            # a tensor kept quantized fills a bank per part (codes, scales), each as stored
            if isinstance(tensor, QuantizedParts):
                parts = bank_parts(tensor, store.formats[_projection(name)])
            else:
                parts = {"w": tensor}
            for part, value in parts.items():
                dest = target[1] if part == "w" else _target(name, params, moe_index, part)[1]
                if family.to_layout is not None:
                    value = family.to_layout(name, value, stored in ckpt.quantized.tensors)
                if tuple(dest.shape) != tuple(value.shape):
                    what = stored if part == "w" else f"{stored} ({part} part)"
                    raise CheckpointError(
                        f"tensor {what} has shape {tuple(value.shape)}, but the config "
                        f"implies {tuple(dest.shape)}"
                    )
                dest.copy_(value)
            filled.add(key)

    missing = sorted(
        {n for n in params if n.rpartition(".")[2] not in BANK_NAMES} - filled
    ) + _missing_experts(model.config, store, filled)
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise CheckpointError(f"checkpoint {ckpt.path} is missing tensors: {shown}")
    _report_unused(unused, family, model.config)


def _report_unused(unused: list[str], family, cfg: ModelConfig) -> None:
    """Say which checkpoint tensors the model did not read: its MTP layer's, unless read
    (which leaves its copies of the embedding and output head unread), then any others."""
    mtp = [n for n in unused if _of_mtp_layer(n, family.canonical_name(n), cfg)]
    if mtp and not cfg.mtp:
        log.info(
            "the checkpoint's next-token-prediction (MTP) layer is not read (%d tensors): "
            "--speculative mtp drafts with it",
            len(mtp),
        )
    unused = [n for n in unused if n not in set(mtp)]
    if unused:
        log.warning(
            "ignored %d checkpoint tensors not used by the model, e.g. %s", len(unused), unused[0]
        )


def _of_mtp_layer(stored: str, name: str | None, cfg: ModelConfig) -> bool:
    """Whether a checkpoint tensor is one of its MTP layers' (DeepSeek's layout: the layers
    from `num_hidden_layers` on; Qwen3-Next's: under `mtp.`)."""
    if cfg.mtp_layers < 1:
        return False
    layer = re.match(r"^(?:model\.)?layers\.(\d+)\.", stored)
    return (
        stored.startswith("mtp.")
        or (name or "").startswith("mtp.")
        or (layer is not None and int(layer[1]) >= cfg.num_layers)
    )


def _keep_dense(model: DecoderModel, name: str, stored: QuantizedParts, what: str) -> None:
    """A dense layer's quantized tensor (`dense_storage`) given to its Linear; a tied model's
    embedding dequantized into the table and given to a new output head."""
    try:
        weight = QuantizedWeight.of(stored)
        if name == "embed.weight":
            table = model.embed.weight
            if tuple(table.shape) != weight.shape:
                raise ValueError(f"the embedding is {tuple(table.shape)}")
            table.copy_(weight.dequantize(table.dtype))
            model.head_from(weight)
        else:
            model.get_submodule(name.removesuffix(".weight")).keep_quantized(weight)
    except ValueError as e:
        raise CheckpointError(f"tensor {what} ({stored.format}): {e}") from e


def _target(
    name: str, params: dict[str, torch.Tensor], moe_index: dict[int, int], part: str = "w"
) -> tuple[str, torch.Tensor] | None:
    """Where a canonical tensor goes: (coverage key, destination view), None if nowhere. An
    expert's quantized parts go to their own banks (`part`: "w" codes, "s" scales, "g" per-row
    scales), in the same rows."""
    if m := _EXPERT.match(name):
        layer, expert, proj = int(m[1]), int(m[2]), m[3]
        if layer not in moe_index:
            return None
        bank = params[
            f"moe.{moe_index[layer]}.{part}_" + ("down" if proj == "down_proj" else "gate_up")
        ]
        if expert >= bank.shape[0]:
            return None
        if proj == "down_proj":
            return name, bank[expert]
        half = bank.shape[1] // 2
        return name, bank[expert, :half] if proj == "gate_proj" else bank[expert, half:]
    if m := _BIAS_BANK.match(name):  # (a whole layer's gate/up biases: gpt-oss)
        key = f"moe.{moe_index[int(m[1])]}.b_gate_up" if int(m[1]) in moe_index else None
        return (f"layers.{m[1]}.moe.b_gate_up", params[key]) if key in params else None
    if m := _FUSED.match(name):
        if int(m[1]) not in moe_index:
            return None
        bank = "gate_up" if m[2] == "gate_up_proj" else "down"
        key = f"layers.{m[1]}.moe.w_{bank}"
        return key, params[f"moe.{moe_index[int(m[1])]}.{part}_{bank}"]
    return (name, params[name]) if name in params else None


def _missing_experts(
    cfg: ModelConfig, store: HostExpertStore | None, filled: set[str]
) -> list[str]:
    """Expert projections no checkpoint tensor filled, in the per-expert naming (whole banks
    count as filled when the checkpoint used the fused layout)."""
    if store is None:
        return []
    missing = []
    for layer in cfg.moe_layer_ids:
        for bank, projs in (("w_gate_up", ("gate_proj", "up_proj")), ("w_down", ("down_proj",))):
            if f"layers.{layer}.moe.{bank}" in filled:
                continue
            for e in range(store.num_experts):
                missing += [
                    key
                    for p in projs
                    if (key := f"layers.{layer}.moe.experts.{e}.{p}.weight") not in filled
                ]
        if store.b_gate_up is not None and f"layers.{layer}.moe.b_gate_up" not in filled:
            missing.append(f"layers.{layer}.moe.gate_up_proj_bias")
    return missing
