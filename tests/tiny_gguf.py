"""Tiny GGUF files for tests: a transformers checkpoint (tiny_models.build_chat_model) written as
llama.cpp lays a Qwen3 or Qwen3-MoE model out (its tensor names, hyper-parameters and GPT-2
style tokenizer metadata; a layer's experts stacked in one tensor per projection), each tensor
in F32 or quantized to Q8_0 by the `gguf` package."""

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


def qwen3_writer(cfg: dict, tokenizer: Path | None, out: Path):
    """A `gguf.GGUFWriter` at `out` holding a Qwen3 (or, with experts, Qwen3-MoE) model's
    hyper-parameters from its config.json `cfg`, and the Qwen tokenizer and chat template of
    the directory `tokenizer` (tokenizer.json, tokenizer_config.json), as llama.cpp stores them
    (None: no tokenizer, for tests of the tensors alone: reading 151k tokens' metadata costs
    the gguf package seconds); the caller adds the tensors."""
    import gguf

    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # (transformers 5 saves the
    # latter)
    w = gguf.GGUFWriter(str(out), "qwen3" if experts is None else "qwen3moe")
    w.add_name("tiny-qwen3")
    if experts is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg["rope_theta"] if "rope_theta" in cfg else
                               cfg["rope_parameters"]["rope_theta"]))  # fmt: skip
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if tokenizer is None:
        return w
    tok = json.loads((tokenizer / "tokenizer.json").read_text())
    tok_config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    # tokenizer: every id up to the model's vocabulary (unused rows as padding tokens)
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    by_id = {i: t for t, i in vocab.items()}
    size = cfg["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    types = [gguf.TokenType.CONTROL if i in special else
             gguf.TokenType.USER_DEFINED if i not in by_id else gguf.TokenType.NORMAL
             for i in range(size)]  # fmt: skip
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


def write_qwen3_gguf(checkpoint: Path, out: Path, quantize: str = "F32",
                     experts: str | None = None, tokenizer: bool = True) -> Path:  # fmt: skip
    """`checkpoint`: a Qwen3ForCausalLM or Qwen3MoeForCausalLM (every layer MoE, as llama.cpp's
    qwen3moe has them) directory with the Qwen tokenizer; `quantize`: F32, or a type the gguf
    package writes (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4) for the weights whose rows
    are whole blocks (the norms and the router stay F32, as llama.cpp keeps them); `experts`:
    the routed experts' type where it differs (llama.cpp's MXFP4_MOE: MXFP4 experts, Q8_0
    else; Q4_K, Q5_K, Q6_K: random blocks, widths of 256s; Q4_K_M, Q5_K_M: Q4_K or Q5_K but
    the down projections of even layers Q6_K, as llama.cpp gives some layers more bits;
    Q5_0_Q4_K_M: the gate and up projections Q5_0, the down ones as Q4_K_M's, as Qwen2.5's
    Q4_K_M files)."""
    import gguf

    cfg = json.loads((checkpoint / "config.json").read_text())
    w = qwen3_writer(cfg, checkpoint if tokenizer else None, out)
    weights = load_file(str(checkpoint / "model.safetensors"))
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, proj) -> expert -> w
    for name in list(weights):
        if m := EXPERT.fullmatch(name):
            stacks.setdefault((m[1], m[3]), {})[int(m[2])] = weights.pop(name)
    for (layer, proj), each in stacks.items():
        weights[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([each[e] for e in sorted(each)])
    for name, value in weights.items():
        value = value.astype(np.float32)
        if name.startswith("blk."):
            gname = name
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{NAMES[rest]}"
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
        elif (kind != "F32" and value.ndim >= 2 and value.shape[-1] % 32 == 0
                and "ffn_gate_inp" not in gname):  # fmt: skip
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            data = gguf.quants.quantize(value, qtype)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
