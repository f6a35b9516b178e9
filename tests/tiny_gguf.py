"""Tiny GGUF files for tests: a transformers checkpoint (tiny_models.build_chat_model's, with the
Qwen tokenizer, or build_byte_qwen3's, with a byte-level one) written as llama.cpp lays a Qwen3
or Qwen3-MoE model out (its tensor names, hyper-parameters and GPT-2 style tokenizer metadata;
a layer's experts stacked in one tensor per projection), each tensor in F32 or quantized by the
`gguf` package."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

NAMES = {  # transformers' name (after model.layers.N.) -> llama.cpp's (after blk.N.)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # (the router: F32, as llama.cpp keeps it)
}
MIXED_K = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # (write_qwen3_gguf's experts: their base type)
# (write_qwen3_gguf's experts: Qwen2.5's Q4_K_M files, whose gate and up projections are Q5_0)
GATE_UP_Q5_0 = {"Q5_0_Q4_K_M": "Q4_K_M"}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def qwen3_writer(cfg: dict, tokenizer: Path | str | None, out: Path):
    """A `gguf.GGUFWriter` at `out` holding a Qwen3 (or, with experts, Qwen3-MoE) model's
    hyper-parameters from its config.json `cfg`, and as llama.cpp stores them the Qwen
    tokenizer and chat template of the directory `tokenizer` (tokenizer.json,
    tokenizer_config.json: 151k tokens' metadata, seconds for the gguf package to parse),
    "byte" for `add_byte_tokenizer`'s (a `BYTE_VOCAB`-token `cfg`), or None for none (tests of
    the tensors alone); the caller adds the tensors."""
    import gguf

    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # (transformers 5 saves the
    # latter)
    w = gguf.GGUFWriter(str(out), "qwen3" if experts is None else "qwen3moe")
    w.add_name("tiny-qwen3")
    if experts is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    add_hyper_parameters(w, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if tokenizer is None:
        return w
    if tokenizer == "byte":
        if cfg["vocab_size"] != BYTE_VOCAB:
            raise ValueError(f"the byte tokenizer needs a {BYTE_VOCAB}-token checkpoint")
        add_byte_tokenizer(w)
        return w
    tok = json.loads((tokenizer / "tokenizer.json").read_text())
    tok_config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    # tokenizer: every id up to the model's vocabulary (unused rows as padding tokens)
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    by_id = {i: t for t, i in vocab.items()}
    size = cfg["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    types = [
        gguf.TokenType.CONTROL
        if i in special
        else gguf.TokenType.USER_DEFINED
        if i not in by_id
        else gguf.TokenType.NORMAL
        for i in range(size)
    ]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(vocab[tok_config["eos_token"]])
    w.add_bos_token_id(cfg.get("bos_token_id") or vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_config["chat_template"])
    return w


def add_hyper_parameters(w, cfg: dict) -> None:
    """A decoder's shape from its config.json `cfg` on GGUF writer `w`, as llama.cpp names it."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(
        float(cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"])
    )
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def gguf_name(name: str) -> str:
    """llama.cpp's name of transformers' tensor `name` (a weight or a bias)."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name.startswith("blk.") or name in top:
        return top.get(name, name)
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    stem, kind = rest.rsplit(".", 1)  # (kind: weight | bias)
    return f"blk.{layer}.{NAMES[stem + '.weight'].removesuffix('.weight')}.{kind}"


def add_quantized(w, name: str, value: np.ndarray, kind: str) -> bool:
    """Tensor `value` added to `w` in GGUF type `kind` where the gguf package writes it and its
    rows are whole blocks; False (nothing added) where not."""
    import gguf

    if kind == "F32" or value.ndim < 2 or value.shape[-1] % 32:
        return False
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = gguf.quants.quantize(value, qtype)
    w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    return True


def finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def random_k_blocks(kind: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random K-quant super-blocks for a tensor of logical `shape` (the last a multiple of 256),
    as bytes [..., K / 256 * block bytes]: any codes and sub-block scales, fp16 scales that give
    weights of ~0.01."""
    import gguf

    size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)][1]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, size), dtype=np.uint8)
    if kind == "Q6_K":  # d last
        blocks[..., 208:210] = np.array([1e-5], np.float16).view(np.uint8)
    else:  # d, dmin first
        blocks[..., 0:2] = np.array([2e-5], np.float16).view(np.uint8)
        blocks[..., 2:4] = np.array([1e-5], np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def write_qwen3_gguf(
    checkpoint: Path,
    out: Path,
    quantize: str = "F32",
    experts: str | None = None,
    tokenizer: str | None = "byte",
) -> Path:
    """`checkpoint`: a Qwen3ForCausalLM or Qwen3MoeForCausalLM (every layer MoE, as llama.cpp's
    qwen3moe has them) directory; `tokenizer`: "byte" (a `BYTE_VOCAB`-token checkpoint,
    build_byte_qwen3's: add_byte_tokenizer), "qwen" (the Qwen tokenizer and chat template in
    the checkpoint's directory, build_chat_model's: 151k tokens' metadata, seconds to parse) or
    None (none, for tests of the tensors alone); `quantize`: F32, or a type the gguf
    package writes (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4) for the weights whose rows
    are whole blocks (the norms and the router stay F32, as llama.cpp keeps them); `experts`:
    the routed experts' type where it differs (llama.cpp's MXFP4_MOE: MXFP4 experts, Q8_0
    else; Q4_K, Q5_K, Q6_K: random blocks, widths of 256s; Q4_K_M, Q5_K_M: Q4_K or Q5_K but
    the down projections of even layers Q6_K, as llama.cpp gives some layers more bits;
    Q5_0_Q4_K_M: the gate and up projections Q5_0, the down ones as Q4_K_M's, as Qwen2.5's
    Q4_K_M files)."""
    import gguf

    cfg = json.loads((checkpoint / "config.json").read_text())
    if tokenizer not in ("byte", "qwen", None):
        raise ValueError(f"tokenizer: 'byte', 'qwen' or None, not {tokenizer!r}")
    w = qwen3_writer(cfg, checkpoint if tokenizer == "qwen" else tokenizer, out)
    weights = load_file(str(checkpoint / "model.safetensors"))
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, proj) -> expert -> w
    for name in list(weights):
        if m := EXPERT.fullmatch(name):
            stacks.setdefault((m[1], m[3]), {})[int(m[2])] = weights.pop(name)
    for (layer, proj), each in stacks.items():
        weights[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([each[e] for e in sorted(each)])
    for name, value in weights.items():
        value = value.astype(np.float32)
        gname = gguf_name(name)
        kind = (experts or quantize) if "_exps" in gname else quantize
        if kind in GATE_UP_Q5_0:
            kind = GATE_UP_Q5_0[kind] if "ffn_down" in gname else "Q5_0"
        if kind in MIXED_K:
            layer = int(gname.split(".")[1])
            kind = "Q6_K" if "ffn_down" in gname and layer % 2 == 0 else MIXED_K[kind]
        if kind in K_QUANTS:  # (the gguf package cannot quantize to them: random blocks)
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            data = random_k_blocks(kind, value.shape, np.random.default_rng(len(gname)))
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
        elif "ffn_gate_inp" in gname or not add_quantized(w, gname, value, kind):
            w.add_tensor(gname, value)
    return finish(w, out)


# A byte-level vocabulary: 256 bytes, a few merges (indentation, two common pairs) and ChatML's
# three control tokens: a real tokenizer for files whose tests convert them several times (a
# 151k-token vocabulary costs the gguf package seconds a parse).
BYTE_MERGES = (("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("s", "e"), ("i", "n"))
BYTE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB = 256 + len(BYTE_MERGES) + len(BYTE_SPECIALS)
BYTE_BOS, BYTE_EOS = BYTE_VOCAB - 3, BYTE_VOCAB - 1  # <|endoftext|>, <|im_end|>
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_byte_tokenizer(w) -> None:
    """`BYTE_VOCAB` tokens' metadata on GGUF writer `w`, as llama.cpp stores a GPT-2 style
    tokenizer."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    tokens = [spelling[b] for b in range(256)] + ["".join(m) for m in BYTE_MERGES]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens + list(BYTE_SPECIALS))
    w.add_token_types(
        [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(BYTE_SPECIALS)
    )
    w.add_token_merges([" ".join(m) for m in BYTE_MERGES])
    w.add_bos_token_id(BYTE_BOS)
    w.add_eos_token_id(BYTE_EOS)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def build_byte_qwen3(family: str, out_dir: Path, **overrides):
    """A tiny "qwen3" or "qwen3_moe" checkpoint (tiny_models.build) of `BYTE_VOCAB` tokens, its
    head tied and its bos / eos the byte tokenizer's, for write_qwen3_gguf's byte tokenizer
    (no tokenizer files: the GGUF file carries them). Returns (dir, the transformers model)."""
    from tiny_models import build

    return build(
        family,
        out_dir,
        vocab_size=BYTE_VOCAB,
        tie_word_embeddings=True,
        bos_token_id=BYTE_BOS,
        eos_token_id=BYTE_EOS,
        **overrides,
    )


def llama_permuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """Rows of attn_q / attn_k as llama.cpp's converter writes a llama model's (for its
    interleaved RoPE): each head's first- and second-half rows interleaved in pairs."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_dense_gguf(checkpoint: Path, out: Path, arch: str, quantize: str = "Q8_0") -> Path:
    """`checkpoint`: a Qwen2ForCausalLM (`arch` "qwen2") or LlamaForCausalLM ("llama", attn_q
    and attn_k rows permuted as llama.cpp stores them) directory of `BYTE_VOCAB` tokens, without
    rope scaling or a sliding window, written as llama.cpp lays it out with the byte tokenizer;
    weights whose rows are whole blocks in `quantize`, the rest (norms, biases) F32."""
    import gguf

    cfg = json.loads((checkpoint / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{arch}")
    add_hyper_parameters(w, cfg)
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    add_byte_tokenizer(w)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    for name, value in load_file(str(checkpoint / "model.safetensors")).items():
        value = value.astype(np.float32)
        gname = gguf_name(name)
        tensor = gname.split(".")[-2]
        if arch == "llama" and tensor in heads:
            value = llama_permuted(value, heads[tensor])
        if not add_quantized(w, gname, np.ascontiguousarray(value), quantize):
            w.add_tensor(gname, np.ascontiguousarray(value))
    return finish(w, out)
