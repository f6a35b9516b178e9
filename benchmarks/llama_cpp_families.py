"""Decode tok/s of freetoken beside llama.cpp on the same random checkpoint, family by family:
Kimi-Linear, MiniMax-M2, Gemma-4 MoE, Kimi-K2.6 (issue 45), DeepSeek-V4 and GLM-5 (issue 43).

    python benchmarks/llama_cpp_families.py --converter /tmp/conv \\
        --llama-bench /tmp/lb/bin/llama-bench --work /tmp/fam --out results.json \\
        [--family kimi-linear ...] [--jobs 6 --gguf-dir /dev/shm] [--tiny --device cpu]

For each family: a random checkpoint in its release's layout (names, config keys, tokenizer
files llama.cpp's converter reads: built from transformers' own model of the family on the meta
device, its save-time names, then written tensor by tensor), converted by llama.cpp's
`convert_hf_to_gguf.py` (--outtype bf16), timed by llama-bench (tg32 after its warm-up: all layers
on the GPU, `-ngl 99`, and the experts of the first N layers on the CPU, `-ncmoe N`), then by
freetoken reading the same checkpoint (decode_context.py's decode_speed: `fused`, every expert
on the GPU, and `hybrid` with an expert cache of the share of experts -ncmoe leaves on the GPU,
routing uniform at random as decode_offload.py explains). One markdown row per family; the
checkpoint and GGUF are deleted after each family (--keep keeps them).

The shapes are the releases' widths (hidden size, heads, expert width, top-k, vocabulary), a few
layers deep, with fewer routed experts than the releases and one copy of the embeddings where
llama.cpp takes that (FAMILIES says what differs per family): checkpoints of 3-6 GB, which the
converter (~100 MB/s on one core) takes under a minute each; decode at batch 1 reads top-k
experts a layer whatever their number, and the output layer whether tied or not. `--jobs N`
writes and converts N families side by side, times them one by one, then goes on to the next
N. `--tiny`: small widths of the same structure, to check on any machine that each family
converts and that llama.cpp loads and decodes it.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from checkpoint import RandomTensors
from decode_context import decode_speed, llama_bench
from decode_offload import SHAPES, contender_options, use_uniform_routing

# Tokenizers llama.cpp's converter accepts: Qwen's byte-level BPE (its pre-tokenizer is one the
# converter knows) for the families whose converter reads a GPT-2-style vocabulary, with GLM's
# special tokens added for GLM-5 (the converter looks them up); a SentencePiece-style BPE with
# byte fallback for Gemma-4 (its converter reads only that kind).
QWEN_VOCAB = 151936  # Qwen3's embedding rows (151669 tokens): the floor of a Qwen-tokenized model
GLM_TOKENS = ("[gMASK]", "<sop>", "<|user|>", "<|observation|>")


@dataclass(frozen=True)
class Spec:
    """One family's run: its shape (decode_offload.SHAPES), layers, routed experts kept (None:
    the release's count), -ncmoe, the tokenizer kind, the widths of its --tiny variant (16
    experts), and what differs from the release."""

    shape: str
    issue: int
    layers: int
    ncmoe: int
    experts: int | None = None
    tokenizer: str = "qwen"  # qwen, glm or gemma
    tiny: dict = field(default_factory=dict)
    changes: str = ""
    # One copy of the embeddings, the output layer reading it: the bytes a decode step reads
    # are the same, the vocabulary's bytes to write and convert half (2.3 GB of Kimi-K2.6's
    # 4.7). Where llama.cpp's loader takes it: for Kimi-Linear, MiniMax-M2 and DeepSeek-V4 it
    # wants output.weight.
    tie: bool = True


# (MLA widths of a tiny variant: DeepSeek-V3's structure at 256 wide)
_TINY_MLA = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
)

FAMILIES: dict[str, Spec] = {
    "kimi-linear": Spec(
        "kimi-linear-48b-a3b",
        45,
        layers=8,
        ncmoe=4,
        experts=16,
        tie=False,
        tiny={
            **_TINY_MLA,
            "q_lora_rank": None,
            "linear_attn_config": dict(num_heads=4, head_dim=64),
        },
        changes="16 of 256 experts; KDA x3, MLA, KDA x3, MLA, the first dense",
    ),
    "minimax-m2": Spec(
        "minimax-m2",
        45,
        layers=4,
        ncmoe=2,
        experts=16,
        tie=False,
        tiny=dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            rotary_dim=32,
            intermediate_size=128,
        ),
        changes="16 of 256 experts",
    ),
    "gemma-4-26b-a4b": Spec(
        "gemma-4-26b-a4b",
        45,
        layers=6,
        ncmoe=3,
        experts=16,
        tokenizer="gemma",
        tiny=dict(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=256,
            moe_intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            global_head_dim=128,
            num_global_key_value_heads=1,
            sliding_window=16,
        ),
        changes="16 of 128 experts; the text model alone (Gemma4ForCausalLM): 5 sliding layers "
        "and a full one; a stand-in tokenizer of its vocabulary's size",
    ),
    "kimi-k2.6": Spec(
        "kimi-k2.6",
        45,
        layers=3,
        ncmoe=2,
        experts=8,
        tiny=_TINY_MLA,
        changes="8 of 384 experts (its top-8: all of them every token), the first layer dense; "
        "bf16 experts (the release's are INT4, which freetoken does not read); a small vision "
        "tower (the converter takes the text model of KimiK25ForConditionalGeneration)",
    ),
    "deepseek-v4-flash": Spec(
        "deepseek-v4-flash",
        43,
        layers=6,
        ncmoe=3,
        experts=16,
        tie=False,
        tiny=dict(
            hidden_size=256,
            moe_intermediate_size=128,
            num_attention_heads=4,
            head_dim=128,
            qk_rope_head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=64,
            o_groups=2,
            o_lora_rank=64,
            index_n_heads=4,
            index_head_dim=64,
            index_topk=16,
            sliding_window=16,
        ),
        changes="16 of 256 experts, MXFP4 as released (the converter reads only that), the rest "
        "bf16; 3 hash-routed HCA layers, then CSA, HCA, CSA; vocabulary 151936 (Qwen's "
        "tokenizer) for 129280",
    ),
    "glm-5": Spec(
        "glm-5",
        43,
        layers=3,
        ncmoe=2,
        experts=8,
        tokenizer="glm",
        tiny={**_TINY_MLA, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 16},
        changes="8 of 256 experts (its top-8: all of them every token), the first layer dense",
    ),
}


def text_of(raw: dict) -> dict:
    """The text model's config: `text_config` of an image-text release, else the config."""
    return raw.get("text_config", raw)


EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


def family_config(spec: Spec, tiny: bool) -> dict:
    """config.json of the run's model (the release's keys; the bench's changes applied)."""
    raw = copy.deepcopy(SHAPES[spec.shape](spec.layers))
    text = text_of(raw)
    if tiny:
        for key, value in spec.tiny.items():
            if isinstance(value, dict):
                text[key] = {**text.get(key, {}), **value}
            else:
                text[key] = value
    experts = 16 if tiny else spec.experts
    if experts is not None:
        key = next((k for k in EXPERT_KEYS if k in text), "n_routed_experts")
        text[key] = experts
    if spec.tie:
        text["tie_word_embeddings"] = True
        if "text_config" in raw:
            raw["tie_word_embeddings"] = True
    if spec.tokenizer != "gemma":  # (Qwen's tokenizer: at least its 151936 rows)
        text["vocab_size"] = max(text.get("vocab_size", 0), QWEN_VOCAB)
    return raw


# transformers' classes of each architecture (config, model)
HF_CLASSES = {
    "KimiLinearForCausalLM": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "MiniMaxM2ForCausalLM": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    "Gemma4ForCausalLM": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    "KimiK25ForConditionalGeneration": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration"),
    "DeepseekV4ForCausalLM": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
}


def hf_model(raw: dict):
    """transformers' model of `raw` on the meta device (no memory) and its config."""
    import transformers

    config_cls, model_cls = HF_CLASSES[raw["architectures"][0]]
    if not hasattr(transformers, model_cls):
        raise RuntimeError(
            f"transformers {transformers.__version__} has no {model_cls}: carry a newer one"
        )
    # (a copy: a config class may change the nested dicts it is given)
    fields = {
        k: v for k, v in copy.deepcopy(raw).items() if k not in ("architectures", "model_type")
    }
    config = getattr(transformers, config_cls)(**fields)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    return model, config


def saved_shapes(model) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors transformers' save_pretrained would write (its names, after reverting its
    load-time conversions), with shapes and dtypes: tied weights left out."""
    from transformers.core_model_loading import revert_weight_conversion

    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    if model.config.get_text_config().tie_word_embeddings:  # (not all models list it)
        tied |= {k for k in model.state_dict() if k.endswith("lm_head.weight")}
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    return {k: (tuple(v.shape), v.dtype) for k, v in revert_weight_conversion(model, state).items()}


def release_layout(raw: dict, shapes: dict) -> dict:
    """transformers' saved names and dtypes changed to what the release (and llama.cpp's
    converter) has, where they differ: Kimi-Linear's dense layers under `mlp`; Kimi-K2.x's text
    layers as `layers`; DeepSeek-V4's own names without `model.`, its experts MXFP4 (int8 e2m1
    pairs [N, K / 2] with e8m0 scales [N, K / 32] under `X.scale`), its attention's norm
    `attn.kv_norm` (transformers saves `attn.norm`, reversing a rename that also covers the
    compressors' `norm`), hyper-connections, sinks, compressor positions and router biases
    fp32."""
    arch = raw["architectures"][0]
    out = {}
    for name, (shape, dtype) in shapes.items():
        dtype = dtype if not dtype.is_floating_point else torch.bfloat16
        if arch == "KimiLinearForCausalLM":
            name = re.sub(r"\.block_sparse_moe\.(gate|up|down)_proj\.", r".mlp.\1_proj.", name)
        elif arch == "KimiK25ForConditionalGeneration":
            name = name.replace(".model.blocks.", ".model.layers.")
        elif arch == "DeepseekV4ForCausalLM":
            name = re.sub(r"^model\.hc_head\.hc_", "hc_head_", name)
            name = {"model.embed_tokens.weight": "embed.weight"}.get(name, name)
            name = name.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")
            if re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", name):
                n, k = shape
                out[name] = ((n, k // 2), torch.int8)
                out[name.removesuffix(".weight") + ".scale"] = ((n, k // 32), torch.float8_e8m0fnu)
                continue
            if re.search(r"(^|\.)hc_|attn_sink$|\.ape$|ffn\.gate\.bias$", name):
                dtype = torch.float32
        out[name] = (shape, dtype)
    return out


def random_tensor(fill: RandomTensors, name: str, shape, dtype, num_experts: int):
    """Random values that keep the model finite: ones for norms and scales, experts for
    DeepSeek-V4's hash-routing table, random codes and scales near 2^-7 for MXFP4."""
    if dtype == torch.int8:
        return fill(name + "_blocks", shape).view(torch.int8)
    if dtype == torch.float8_e8m0fnu:
        return fill(name + "_scales", shape).view(torch.float8_e8m0fnu)
    if not dtype.is_floating_point:
        return torch.randint(0, num_experts, shape, generator=fill.gen, dtype=dtype)
    if name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
        return torch.ones(shape, dtype=dtype)
    return fill(name, shape).to(dtype)


def write_checkpoint(raw: dict, out: Path, tokenizer: Path | None, kind: str) -> int:
    """A random checkpoint of `raw` in its release's layout at `out`, one safetensors file a
    layer; returns its bytes."""
    from safetensors.torch import save_file

    model, config = hf_model(raw)
    shapes = release_layout(raw, saved_shapes(model))
    text = text_of(raw)
    num_experts = next(text[k] for k in EXPERT_KEYS if k in text)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict] = {}
    for name, spec in shapes.items():
        layer = re.search(r"layers\.(\d+)\.", name)
        files.setdefault(f"layer-{int(layer[1]):03d}" if layer else "rest", {})[name] = spec
    fill, weight_map, total = RandomTensors(), {}, 0
    for file, specs in sorted(files.items()):
        tensors = {
            n: random_tensor(fill, n, shape, dtype, num_experts)
            for n, (shape, dtype) in specs.items()
        }
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / f"{file}.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f"{file}.safetensors"))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(release_config(raw, config), indent=1))
    write_tokenizer(out, kind, text["vocab_size"], tokenizer)
    return total


def release_config(raw: dict, config) -> dict:
    """config.json: transformers' full config (the defaults the converter reads too) under the
    release's own keys; DeepSeek-V4's spelled as its release spells them (compress_ratios,
    num_hash_layers), which is what llama.cpp's converter reads."""
    out = {**config.to_dict(), **raw, "torch_dtype": "bfloat16"}
    if raw["architectures"] == ["DeepseekV4ForCausalLM"]:
        ratio = {"sliding_attention": 0, **out["compress_rates"]}
        out["compress_ratios"] = [ratio[k] for k in out["layer_types"]] + [0]  # (+ MTP's)
        out["num_hash_layers"] = out["mlp_layer_types"].count("hash_moe")
    return out


def write_tokenizer(out: Path, kind: str, vocab: int, tokenizer: Path | None) -> None:
    if kind == "gemma":
        write_gemma_style_tokenizer(out, vocab)
        return
    if tokenizer is not None:
        for file in tokenizer.iterdir():
            shutil.copy(file, out / file.name)
    else:
        from freetoken.qwen_vocab import write_qwen_tokenizer

        write_qwen_tokenizer(out, model_max_length=131072)
    if kind == "glm":  # GLM's special tokens, after Qwen's (in both files that list them)
        spec = json.loads((out / "tokenizer.json").read_text())
        config = json.loads((out / "tokenizer_config.json").read_text())
        first = max(t["id"] for t in spec["added_tokens"]) + 1
        for i, content in enumerate(GLM_TOKENS):
            token = dict(
                content=content,
                single_word=False,
                lstrip=False,
                rstrip=False,
                normalized=False,
                special=True,
            )
            spec["added_tokens"].append({"id": first + i, **token})
            config.setdefault("added_tokens_decoder", {})[str(first + i)] = token
        (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
        (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))


def write_gemma_style_tokenizer(out: Path, vocab: int) -> None:
    """A SentencePiece-style BPE of exactly `vocab` tokens, as Gemma's: `<pad>`, `<eos>`,
    `<bos>`, `<unk>` (Gemma-4's ids 0-3), the 256 byte-fallback tokens, then pieces of one,
    two and three symbols with the merges that make them. Not Gemma's vocabulary (nothing here
    reads text): its kind and size."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)]
    symbols = ["\u2581"] + [chr(c) for c in range(0x21, 0x7F)]
    tokens += symbols
    pairs = ((a, b) for a in symbols for b in symbols)
    triples = ((a + b, c) for a in symbols for b in symbols for c in symbols)
    merges = list(itertools.islice(itertools.chain(pairs, triples), vocab - len(tokens)))
    tokens += [a + b for a, b in merges]
    if len(tokens) < vocab:
        raise ValueError(f"a stand-in vocabulary of {vocab} tokens is larger than this makes")
    model = BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=True,
        model_max_length=131072,
    )
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def convert(converter: Path, checkpoint: Path, gguf: Path, log: Path) -> float:
    """llama.cpp's converter on `checkpoint` (--outtype bf16); the seconds it took. Raises with
    the log's tail if it fails."""
    # (its own gguf-py first: a `gguf` package installed may be older than the converter)
    path = os.pathsep.join(filter(None, [str(converter / "gguf-py"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    command = [sys.executable, "convert_hf_to_gguf.py", str(checkpoint), "--outtype", "bf16"]
    began = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(
            [*command, "--outfile", str(gguf)], cwd=converter, env=env, stdout=f, stderr=f
        )
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-4:]
        raise RuntimeError("conversion failed: " + " / ".join(tail))
    return time.perf_counter() - began


def gpu_share(cfg, ncmoe: int) -> float:
    """The share of routed experts -ncmoe N leaves on the GPU (those of MoE layers >= N)."""
    layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    return sum(i >= ncmoe for i in layers) / len(layers)


def prepare(name: str, args) -> dict:
    """Write family `name`'s checkpoint and convert it to GGUF (in a process of its own where
    families are prepared side by side: the converter runs on one core); its row so far."""
    spec = FAMILIES[name]
    raw = family_config(spec, args.tiny)
    text = text_of(raw)
    row: dict = {
        "family": name,
        "issue": spec.issue,
        "architecture": raw["architectures"][0],
        "layers": text["num_hidden_layers"],
        "experts": next(text[k] for k in EXPERT_KEYS if k in text),
        "tied": bool(text.get("tie_word_embeddings")),
        "changes": spec.changes,
    }
    ckpt, gguf = paths(name, args)
    began = time.perf_counter()
    row["checkpoint_bytes"] = write_checkpoint(raw, ckpt, args.tokenizer, spec.tokenizer)
    row["write_s"] = time.perf_counter() - began
    print(f"{name}: checkpoint {row['checkpoint_bytes'] / 1e9:.2f} GB in {row['write_s']:.0f} s")
    try:
        row["convert_s"] = convert(args.converter, ckpt, gguf, args.work / f"{name}.convert.log")
        row["gguf_bytes"] = gguf.stat().st_size
        print(f"{name}: converted in {row['convert_s']:.0f} s, {row['gguf_bytes'] / 1e9:.2f} GB")
    except RuntimeError as e:
        row["error"] = str(e)
        print(f"{name}: {e}", flush=True)
    return row


def paths(name: str, args) -> tuple[Path, Path]:
    """The family's checkpoint directory and GGUF file."""
    return args.work / name, (args.gguf_dir or args.work) / f"{name}.gguf"


def bench(row: dict, args, device: torch.device) -> dict:
    """llama-bench on the family's GGUF file, then freetoken on its checkpoint; `row` completed."""
    from freetoken.models.loading import load_model

    spec = FAMILIES[row["family"]]
    ckpt, gguf = paths(row["family"], args)
    llama = {}
    if "error" not in row and args.llama_bench:
        threads = ["-t", str(args.threads)]
        configs = [("all", ["-ngl", "99", *threads])]
        configs.append(("ncmoe", ["-ngl", "99", "-ncmoe", str(spec.ncmoe), *threads]))
        for label, extra in configs if device.type == "cuda" else [("all", threads)]:
            llama[label] = llama_bench(args.llama_bench, gguf, [0], extra, label).get(0)
            if llama[label] is None:
                row["llama_cpp_error"] = load_error(args.llama_bench, gguf)
                print(f"{row['family']}: llama.cpp: {row['llama_cpp_error']}", flush=True)
    loaded = load_model(ckpt, "bfloat16", device)
    share = gpu_share(loaded.config, spec.ncmoe)
    slots = int(loaded.experts.num_pairs * share)
    row.update(ncmoe=spec.ncmoe, gpu_share=share, cache_slots=slots)
    ours = {}
    for label, strategy, cache in (("all", "fused", None), ("ncmoe", "hybrid", str(slots))):
        if strategy != "fused":
            use_uniform_routing(loaded)  # (after the fused run: it keeps the model's router)
        options = contender_options(strategy, cache_size=cache)
        r = decode_speed(loaded, options, 1, 0, args.warmup, args.steps, args.rounds, device)
        ours[label] = r["tokens_per_s"]
    row["llama_cpp"], row["freetoken"] = llama, ours
    del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def load_error(binary: str, gguf: Path) -> str:
    """What llama.cpp says when it refuses a file (llama-bench says it only with -v)."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
    command = [binary, "-m", str(gguf), "-p", "0", "-n", "1", "-r", "1", "-v"]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    return " / ".join(errors[:2]) or done.stderr[-300:]


def clean(name: str, args) -> None:
    if not args.keep:
        ckpt, gguf = paths(name, args)
        shutil.rmtree(ckpt, ignore_errors=True)
        gguf.unlink(missing_ok=True)


def failed(name: str, e: BaseException) -> dict:
    print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
    return {"family": name, "issue": FAMILIES[name].issue, "skipped": f"{type(e).__name__}: {e}"}


def run_all(names: list[str], args, device: torch.device) -> list[dict]:
    """Every family's row. Families go in groups of --jobs: a group's checkpoints are written
    and converted side by side (each in a process of its own), then its families are timed one
    after another with nothing else running, then deleted (a group on disk at a time). Once
    --budget-s has passed, the families left are skipped."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    rows: list[dict] = []
    for first in range(0, len(names), args.jobs):
        group = names[first : first + args.jobs]
        if args.budget_s and time.perf_counter() - args.began > args.budget_s:
            rows += [
                {"family": n, "issue": FAMILIES[n].issue, "skipped": "out of time"} for n in group
            ]
            continue
        prepared = {}
        if len(group) == 1:
            try:
                prepared[group[0]] = prepare(group[0], args)
            except Exception as e:
                prepared[group[0]] = failed(group[0], e)
        else:
            with ProcessPoolExecutor(len(group), mp_context=get_context("spawn")) as pool:
                futures = {name: pool.submit(prepare, name, args) for name in group}
                for name, future in futures.items():
                    try:
                        prepared[name] = future.result()
                    except Exception as e:
                        prepared[name] = failed(name, e)
            print(f"prepared {', '.join(group)} at {time.perf_counter() - args.began:.0f} s")
        for name in group:
            row = prepared[name]
            if "skipped" not in row:
                if args.budget_s and time.perf_counter() - args.began > args.budget_s:
                    row = {"family": name, "issue": row["issue"], "skipped": "out of time"}
                else:
                    row = timed(row, args, device)
            clean(name, args)
            rows.append(row)
            write_report(rows, args, device)
    return rows


def timed(row: dict, args, device: torch.device) -> dict:
    """bench(row), or the row of its failure (one family's failure is a row; the rest run)."""
    try:
        row = bench(row, args, device)
        print(json.dumps(row), flush=True)
        return row
    except Exception as e:
        return failed(row["family"], e)


def table(rows: list[dict], device: torch.device) -> list[str]:
    def tps(v):
        return "-" if v is None else f"{v:.1f}"

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    offload = device.type == "cuda"
    lines = [
        "| family | issue | layers | experts | checkpoint GB | llama.cpp all | freetoken fused "
        "| ratio |" + (" llama.cpp -ncmoe N | freetoken hybrid | ratio |" if offload else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|---|" if offload else ""),
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['family']} | {r['issue']} | skipped: {r['skipped']} |")
            continue
        llama, ours = r.get("llama_cpp", {}), r.get("freetoken", {})
        cells = [
            r["family"],
            str(r["issue"]),
            str(r["layers"]),
            str(r["experts"]),
            f"{r['checkpoint_bytes'] / 1e9:.1f}",
            tps(llama.get("all")),
            tps(ours.get("all")),
            ratio(ours.get("all"), llama.get("all")),
        ]
        if offload:
            cells += [
                f"{tps(llama.get('ncmoe'))} (N={r['ncmoe']})",
                f"{tps(ours.get('ncmoe'))} ({r['gpu_share']:.0%} cached)",
                ratio(ours.get("ncmoe"), llama.get("ncmoe")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES))
    ap.add_argument("--converter", type=Path, required=True, help="the unpacked gguf-convert")
    ap.add_argument("--llama-bench", help="the llama-bench binary")
    ap.add_argument("--tokenizer", type=Path, help="Qwen3's tokenizer files (else built here)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/llama-families"))
    ap.add_argument("--out", type=Path, help="the rows as JSON (and a .md table beside)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small widths, for a smoke test")
    ap.add_argument("--keep", action="store_true", help="keep each checkpoint and GGUF file")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-bench -t on CPU")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=48)  # (hybrid settles its way in ~34)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gguf-dir", type=Path, help="where the GGUF files go (default: --work)")
    ap.add_argument(
        "--jobs", type=int, default=1, help="families prepared side by side (and on disk at once)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=0, help="skip the families left after this many seconds"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    args.work.mkdir(parents=True, exist_ok=True)
    args.began = time.perf_counter()
    args.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = run_all(args.family or list(FAMILIES), args, device)
    print(write_report(rows, args, device))
    return 0


def write_report(rows: list[dict], args, device: torch.device) -> str:
    """The table of the rows so far, written to --out (JSON and .md) after each family: a call
    cut short keeps what it measured."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    notes = [f"- {r['family']}: {r['changes']}" for r in rows if r.get("changes")]
    notes += [
        f"- {r['family']}, llama.cpp: {r['llama_cpp_error']}"
        for r in rows
        if r.get("llama_cpp_error")
    ]
    notes += [f"- {r['family']}, conversion: {r['error']}" for r in rows if r.get("error")]
    lines = [
        f"# llama_cpp_families: {'tiny' if args.tiny else 'bench'} shapes on {args.device_name}",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit: {commit}; "
        f"{time.perf_counter() - args.began:.0f} s in all",
        f"- decode tok/s at batch 1, context 0: llama-bench tg32 (-r 1); freetoken's median of "
        f"{args.rounds} rounds of {args.steps} steps after {args.warmup}; ratio freetoken / "
        "llama.cpp; random bf16 weights (DeepSeek-V4's experts MXFP4), tokens at random, "
        "freetoken's hybrid routed uniformly at random",
        "",
        *table(rows, device),
        "",
        *notes,
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
        args.out.with_suffix(".md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
