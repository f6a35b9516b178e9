"""A dense GGUF model made into a Mixture-of-Experts one with the same output: `ft checkpoint
moe-from-dense SRC.gguf DST.gguf --experts 8 --top-k 2`. Trained MoE weights small enough to
test with cannot be installed here; trained dense ones can, and an MoE made of them runs every
strategy, the expert cache, the fills and the CPU kernel on trained weights, with the dense
model as an exact reference.

Each layer's MLP becomes E routed experts that are byte-for-byte copies of its gate, up and down
tensors, in the file's own types (the real Q4_K / Q6_K / Q8_0 / Q5_0 blocks: nothing is
dequantized or quantized again), behind an F32 router choosing the top k, whose weights are
renormalised to sum to one: the MoE's output is the dense MLP's times weights that sum to one,
the dense model's up to fp32 rounding of that sum.

The router has real locality: the dense model (transformers, fp32) runs over a real text (the
source of a standard-library Python module unless `text` is given), each layer's MLP inputs
(after the post-attention norm) are clustered into E directions by seeded spherical k-means,
each dimension scaled by the inverse of its RMS over the text first (a few dimensions of
trained models carry outliers that would otherwise decide every direction), and a layer's
router rows are its centroids (that scaling folded in) times the one factor that puts the
median gap between the k-th and the (k+1)-th logit at `GAP`: tokens of one kind route alike,
and the expert cache sees routing with structure, not uniform noise (`routing_stats`;
benchmarks/moe_routing.py measures it on a held-out text).

The file is llama.cpp's `qwen2moe` architecture (freetoken's qwen2_moe family), read by
freetoken's GGUF path (models/gguf.py -> transformers' GGUF conversion) and by llama.cpp (whose
`-ncmoe N` keeps the experts of the first N layers on the CPU), so both run the same file:
- llama.cpp requires the shared expert's four tensors and `output.weight` (no tied
  embeddings): the shared expert is F32 zeros of width `SHARED_WIDTH` behind a zero gate (its
  output exactly zero), and a tied source's embedding is copied as `output.weight`.
- Neither transformers nor llama.cpp reads a qwen2moe file's renormalisation: transformers'
  Qwen2MoeConfig defaults `norm_topk_prob` to False, llama.cpp's qwen2moe graph never
  renormalises. The file says `expert_weights_norm = true` (llama.cpp's key), which
  models/gguf.py reads as `norm_topk_prob`; llama.cpp ignores it, so its output is the dense
  model's times the top-k's share of the softmax over all E, short of one by about (E - k)
  e^-gap: 1e-7 at the median token, more where a token lies between clusters. Fine for speed
  figures, not for exactness.
- Sources: `qwen2` maps directly (NEOX RoPE, q/k/v biases); `llama` files store attn_q and
  attn_k rows permuted for llama.cpp's interleaved RoPE, which qwen2moe does not use: their rows
  are permuted back (exact for any block type: a block runs along a row) and zero q/k/v biases
  added. Rope scaling is refused (qwen2moe has none).

Time, measured on the 2-core machine while other jobs shared it (load 5-10; an idle machine is
faster): SmolLM2-135M (Q4_1, 30 layers, 0.4 GB out) 74-151 s, of which reading and dequantizing
the dense model is 19-35 s and its run over 2,048 tokens 26 s; Qwen2.5-Coder-0.5B (Q4_K_M, 24
layers, 2.0 GB out) 258 s, 6.9 GB of host memory at the peak. The writing is a few seconds.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from freetoken import paths
from freetoken.errors import CheckpointError
from freetoken.progress import waiting

log = logging.getLogger(__name__)

VERSION = 1  # the files' layout and fit: `cached` makes a file of an older one again
TARGET = "qwen2moe"
SOURCES = ("llama", "qwen2")
# The zero shared expert's width: llama.cpp takes 0 as "the dense width" (n_ff), so the least
# it and freetoken both take is 1 (F32 rows: no block size to fill).
SHARED_WIDTH = 1
GAP = 16.0  # the median gap between the k-th and (k+1)-th router logit on the fitting text
FIT_TOKENS = 2048
KMEANS_ROUNDS = 20
PROJECTIONS = ("gate", "up", "down")


@dataclass
class Routing:
    """A layer's router rows [E, H] (fp32) per layer, and what they were fitted on."""

    routers: list[torch.Tensor]
    top_k: int
    tokens: int


def default_text() -> str:
    """The fitting text when none is given: a standard-library module's source (Python code,
    the kind of text freetoken's users send)."""
    import argparse

    return Path(inspect.getsourcefile(argparse)).read_text()


def convert(
    src: str | Path,
    dst: str | Path,
    experts: int = 8,
    top_k: int = 2,
    text: str | None = None,
    fit_tokens: int = FIT_TOKENS,
    progress: bool | None = None,
) -> Path:
    """Write the MoE made of dense GGUF file `src` at `dst` (see the module's docstring);
    `text`: the router's fitting text (default: `default_text`), of which the first
    `fit_tokens` tokens are used; `progress`: bars on stderr (None: on a terminal)."""
    from freetoken.models.gguf import reader_class

    src, dst = Path(src), Path(dst)
    if not 1 <= top_k <= experts:
        raise CheckpointError(f"--top-k must be between 1 and --experts ({experts}), not {top_k}")
    try:
        reader = reader_class()(str(src))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {src} as a GGUF file: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in SOURCES:
        raise CheckpointError(
            f"{src.name} is a {arch!r} model; moe-from-dense makes MoEs of "
            f"{' and '.join(SOURCES)} GGUF files"
        )
    if any(
        k.startswith(f"{arch}.rope.scaling")
        and k.endswith("type")
        and _field(reader, k) not in ("none", "")
        for k in reader.fields
    ):
        raise CheckpointError(f"{src.name} scales its RoPE, which {TARGET} has no key for")
    if any(t.name.endswith("_exps.weight") for t in reader.tensors):
        raise CheckpointError(f"{src.name} already has routed experts")
    show = sys.stderr.isatty() if progress is None else progress
    _, inputs = mlp_inputs(src, text if text is not None else default_text(), fit_tokens)
    routing = fit_routers(inputs, experts, top_k)
    _write(reader, arch, dst, routing, show)
    return dst


def cached(src: str | Path, experts: int = 8, top_k: int = 2, progress: bool | None = None) -> Path:
    """The MoE made of `src` with the default fitting text, made once and kept in the cache
    directory (keyed by the file's path, size and time, the shape and this converter's
    `VERSION`), as tests, benchmarks and the demo use it."""
    src = Path(src).resolve()
    stat = src.stat()
    key = hashlib.sha256(
        f"{src}|{stat.st_size}|{stat.st_mtime_ns}|{experts}|{top_k}|{VERSION}".encode()
    ).hexdigest()[:16]
    dst = paths.cache_dir() / "moe-from-dense" / f"{src.stem}-{experts}x-top{top_k}-{key}.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    try:
        convert(src, tmp, experts, top_k, progress=progress)
        tmp.rename(dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def mlp_inputs(src: Path, text: str, tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """The first `tokens` tokens of `text` under `src`'s tokenizer, and each layer's MLP inputs
    over them ([T, H] fp32 each), from transformers' fp32 run of the dense GGUF model."""
    with waiting(f"running {src.name} over {tokens} tokens to fit the routers"):
        model, tokenizer = reference_model(src)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        if len(ids) < 64:
            raise CheckpointError(
                f"the fitting text has {len(ids)} tokens; give one of at least 64"
            )
        return ids, layer_inputs(model, ids)


def reference_model(src: Path):
    """(transformers' model of GGUF file `src` in fp32, its tokenizer): the tensors as
    models/gguf.py's conversion dequantizes them (transformers' own GGUF loading needs
    accelerate, which freetoken does not)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from freetoken.models import gguf

    src = Path(src).resolve()
    with gguf._parsed_once(gguf.reader_class(), src) as reader:
        parsed = load_gguf_checkpoint(str(src), return_tensors=False)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        config, arch = gguf.transformers_config(reader, parsed["config"])
        config.dtype = torch.float32
        with no_init_weights():  # (every weight is loaded: no random draws, seconds)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = gguf._tensors(reader, arch, parsed["config"], model, set(), progress=False)
    state = {k: tensors.pop(k).float() for k in list(tensors)}  # (one copy at a time)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        kind = type(model).__name__
        raise CheckpointError(
            f"{src.name}: tensors missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} for transformers' {kind}"
        )
    model.tie_weights()
    return model.eval(), tokenizer


def layer_inputs(model, ids: list[int]) -> list[torch.Tensor]:
    """Each decoder layer's MLP inputs [T, H] (fp32) as transformers' `model` runs `ids`."""
    captured: list[torch.Tensor] = []
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda _m, args: captured.append(args[0][0].detach().float().clone())
        )
        for layer in model.model.layers
    ]
    try:
        with torch.inference_mode():  # (the decoder alone: no [T, vocab] logits)
            model.model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def fit_routers(inputs: list[torch.Tensor], experts: int, top_k: int, seed: int = 0) -> Routing:
    """A router per layer fitted to its MLP inputs `inputs` [T, H] (see the module's
    docstring); deterministic for a seed."""
    routers = []
    for layer, x in enumerate(inputs):
        scale = x.pow(2).mean(0).sqrt().clamp_min(1e-6).reciprocal()  # (per dimension)
        z = torch.nn.functional.normalize(x * scale, dim=-1)
        centroids = _spherical_kmeans(z, experts, torch.Generator().manual_seed(seed + layer))
        rows = centroids * scale  # logits = centroids . (scale * x)
        top = (x @ rows.T).topk(min(top_k + 1, experts), dim=-1).values
        gap = (top[:, top_k - 1] - top[:, top_k]).median() if top_k < experts else None
        factor = GAP / float(gap) if gap is not None and gap > 0 else 1.0
        routers.append((rows * factor).float().contiguous())
    return Routing(routers, top_k, inputs[0].shape[0] if inputs else 0)


def _spherical_kmeans(z: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k unit centroids of the unit rows `z`: k-means++ seeding, then `KMEANS_ROUNDS` rounds
    of assigning each row to its nearest centroid (largest dot product) and renormalising the
    means; an emptied cluster takes the row farthest from its centroid."""
    first = int(torch.randint(len(z), (1,), generator=gen))
    chosen = [first]
    for _ in range(1, k):
        far = (1 - (z @ z[chosen].T).max(-1).values).clamp_min(0)
        chosen.append(int(torch.multinomial(far + 1e-12, 1, generator=gen)))
    c = z[chosen].clone()
    for _ in range(KMEANS_ROUNDS):
        sim = z @ c.T
        assign = sim.argmax(-1)
        onehot = torch.nn.functional.one_hot(assign, k).to(z.dtype)
        sums, counts = onehot.T @ z, onehot.sum(0)  # (index_add_ is 50x slower on CPU)
        for e in (counts == 0).nonzero().flatten().tolist():
            worst = int(sim.max(-1).values.argmin())
            sums[e] = z[worst]
            sim[worst] = 2  # (taken)
        c = torch.nn.functional.normalize(sums, dim=-1)
    return c


def routing_stats(inputs: list[torch.Tensor], routing: Routing) -> dict:
    """How `routing` routes the tokens whose MLP inputs are `inputs`: the share of tokens whose
    top-k set equals the previous token's, the experts' loads (shares of all routes, per layer:
    min and max), and the softmax mass outside the top k (what llama.cpp, which does not
    renormalise, leaves out), beside uniform random top-k routing's expectation; and the share
    whose first choice is the previous token's."""
    from math import comb

    k = routing.top_k
    same, first, loads, outside = [], [], [], []
    for x, rows in zip(inputs, routing.routers, strict=True):
        logits = x @ rows.T
        ranked = logits.topk(k, dim=-1).indices
        first.append((ranked[1:, 0] == ranked[:-1, 0]).float().mean().item())
        top = ranked.sort(-1).values
        same.append((top[1:] == top[:-1]).all(-1).float().mean().item())
        counts = torch.bincount(top.flatten(), minlength=rows.shape[0]).float()
        loads.append(counts / counts.sum())
        p = logits.softmax(-1)
        outside.append((1 - p.topk(k, dim=-1).values.sum(-1)).mean().item())
    experts = routing.routers[0].shape[0]
    loads = torch.stack(loads)
    return {
        "same_set_as_previous": float(np.mean(same)),
        "same_set_uniform": 1 / comb(experts, k),
        "same_first_as_previous": float(np.mean(first)),
        "same_first_uniform": 1 / experts,
        "load_min": float(loads.min(-1).values.mean()),
        "load_max": float(loads.max(-1).values.mean()),
        "load_uniform": 1 / experts,
        "mass_outside_top_k": float(np.mean(outside)),
    }


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a llama file's attn_q / attn_k (or their bias) in transformers' order: llama.cpp's
    converter wrote each head's rows (first half, second half) interleaved as pairs."""
    shape = rows.shape
    return np.ascontiguousarray(
        rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def _write(reader, arch: str, dst: Path, routing: Routing, show: bool) -> None:
    """The MoE file: the source's metadata under qwen2moe's keys, its tensors copied (the MLPs
    as E experts each), the routers, zero shared experts, and what qwen2moe needs besides."""
    import gguf

    experts = routing.routers[0].shape[0]
    ffn = int(_field(reader, f"{arch}.feed_forward_length"))
    plan = _plan(reader, arch, routing)
    w = gguf.GGUFWriter(str(dst), TARGET)
    for key, value, vtype, sub in _metadata(reader, arch):
        w.add_key_value(key, value, vtype, sub)
    w.add_expert_count(experts)
    w.add_expert_used_count(routing.top_k)
    w.add_expert_feed_forward_length(ffn)
    w.add_expert_shared_feed_forward_length(SHARED_WIDTH)
    w.add_expert_weights_norm(True)
    total = 0
    for name, item in plan:
        if isinstance(item, np.ndarray):
            w.add_tensor_info(name, item.shape, item.dtype, item.nbytes)
            total += item.nbytes
            continue
        t, copies, data = item
        data = np.asarray(t.data) if data is None else data
        shape = data.shape if copies == 1 else (copies, *data.shape)
        w.add_tensor_info(name, shape, data.dtype, data.nbytes * copies, raw_dtype=t.tensor_type)
        total += data.nbytes * copies
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with tqdm(total=total, unit="B", unit_scale=True, desc="Writing", disable=not show) as bar:
        for _, item in plan:
            if isinstance(item, np.ndarray):
                out = item
            else:
                t, copies, data = item
                data = np.asarray(t.data) if data is None else data
                # (one layer's experts at a time: the largest tensor is E copies of one MLP's)
                out = (
                    data
                    if copies == 1
                    else np.ascontiguousarray(np.broadcast_to(data, (copies, *data.shape)))
                )
            w.write_tensor_data(out)
            bar.update(out.nbytes)
    w.close()


def _plan(reader, arch: str, routing: Routing) -> list[tuple[str, object]]:
    """The MoE file's tensors in its order: (name, an array, or (source tensor, copies, its
    data where changed))."""
    experts = routing.routers[0].shape[0]
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    layers = int(_field(reader, f"{arch}.block_count"))
    head_dim = hidden // heads
    tensors = {t.name: t for t in reader.tensors}
    plan: list[tuple[str, object]] = []  # (name, array or (tensor, copies)) in the file's order

    def copy(t, data=None, name=None):
        plan.append((name or t.name, (t, 1, data)))

    for t in reader.tensors:
        name = t.name
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            plan.append((f"blk.{parts[1]}.{parts[2]}_exps.weight", (t, experts, None)))
            continue
        if arch == "llama" and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            n = heads if parts[2] == "attn_q" else kv_heads
            copy(t, _unpermute(np.asarray(t.data), n))
            continue
        copy(t)
    for i in range(layers):
        for proj, rows in (
            ("q", heads * head_dim),
            ("k", kv_heads * head_dim),
            ("v", kv_heads * head_dim),
        ):
            if f"blk.{i}.attn_{proj}.bias" not in tensors:
                plan.append((f"blk.{i}.attn_{proj}.bias", np.zeros(rows, np.float32)))
        plan.append((f"blk.{i}.ffn_gate_inp.weight", routing.routers[i].numpy()))
        plan.append((f"blk.{i}.ffn_gate_inp_shexp.weight", np.zeros(hidden, np.float32)))
        for proj, shape in (
            ("gate", (SHARED_WIDTH, hidden)),
            ("up", (SHARED_WIDTH, hidden)),
            ("down", (hidden, SHARED_WIDTH)),
        ):
            plan.append((f"blk.{i}.ffn_{proj}_shexp.weight", np.zeros(shape, np.float32)))
    if "output.weight" not in tensors:  # (llama.cpp's qwen2moe has no tied embeddings)
        copy(tensors["token_embd.weight"], name="output.weight")
    return plan


def _metadata(reader, arch: str):
    """The source's key-value pairs for the MoE file: `{arch}.*` renamed to qwen2moe's keys, the
    GGUF header's own and the architecture left to the writer; (key, value, type, item type)."""
    import gguf

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key.startswith(f"{arch}."):
            key = f"{TARGET}.{key.removeprefix(arch + '.')}"
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key == "general.name":
            value = f"{value} (MoE from dense)"
        yield key, value, vtype, sub
