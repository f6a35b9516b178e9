"""Tiny random checkpoints of every supported family, built with transformers itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

# DeepSeek-V3's layout (multi-head latent attention, sigmoid group routing), and with DSA
_DEEPSEEK = dict(
    num_key_value_heads=4,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
_DSA = dict(_DEEPSEEK, index_topk=8, index_head_dim=16, index_n_heads=32)

# family -> (config class, model class, extra config fields)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=4.0),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[2],
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            use_qk_norm=True,
            attention_bias=True,
            partial_rotary_factor=0.5,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(_DEEPSEEK, num_hidden_layers=4, head_dim=8),
    ),
    # DeepSeek Sparse Attention: an indexer top-k of 8, which the tests' 40-token prompts
    # exceed, so each query reads only some of its earlier tokens. (32 index heads: a token
    # whose every head's ReLU'd score is 0 ties with the others so, and a tie at the k-th
    # place falls either way, in transformers' topk as in ours; with 8 heads, one in a few
    # hundred queries met one)
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(_DSA, num_hidden_layers=3),
    ),
    # (GLM-5: full and shared indexer layers; MLA's own norms keep eps 1e-6 beside the 1e-5)
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            _DSA,
            num_hidden_layers=4,
            rms_norm_eps=1e-5,
            indexer_types=["full", "shared", "full", "shared"],
        ),
    ),
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        # every attention kind; the window of 8, CSA's windows of 4 with its indexer keeping 3,
        # HCA's windows of 8 (the smallest the config allows is any): the tests' 40-token
        # prompts cross them all; a hash-routed layer first; YaRN on the compressed branches
        dict(
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            partial_rotary_factor=0.25,
            q_lora_rank=24,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=8,
            index_head_dim=16,
            index_topk=3,
            sliding_window=8,
            hc_mult=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        # a window of 8 that the tests' 40-token prompts cross, sliding and full layers in turn
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        # q/k norms over all heads, RoPE on half of each head (the release's `rotary_dim`)
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            rotary_dim=8,
        ),
    ),
    "kimi_k25": (
        "Kimi_K25Config",
        "Kimi_K25ForConditionalGeneration",
        # DeepSeek-V3's text model (as above) in `text_config`, beside a vision tower
        dict(
            text_config=dict(
                num_hidden_layers=4,
                num_key_value_heads=4,
                intermediate_size=96,
                moe_intermediate_size=32,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                routed_scaling_factor=2.827,
                q_lora_rank=24,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=12,
                head_dim=8,
            ),
            vision_config=dict(
                num_hidden_layers=1,
                hidden_size=32,
                intermediate_size=32,
                num_attention_heads=2,
                pos_emb_height=4,
                pos_emb_width=4,
            ),
            projection_hidden_size=32,
        ),
    ),
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        # the MoE form: sliding (a window of 8, which the tests' 40-token prompts cross) and
        # full layers in turn, the full ones with wider heads, one KV head, values from the
        # keys and proportional RoPE on a quarter of each head; a dense MLP beside the experts;
        # logits capped at 3 (the release's 30 would hardly touch the tiny model's)
        dict(
            num_hidden_layers=4,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=8,
            intermediate_size=48,
            enable_moe_block=True,
            num_experts=8,
            top_k_experts=2,
            moe_intermediate_size=32,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=3.0,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
        ),
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        # KDA layers around MLA ones without RoPE (transformers saves the release's layout:
        # `self_attn` for both, q/k/v convs apart, `block_sparse_moe` with w1/w2/w3 experts);
        # DeepSeek-V3's routing in 2 groups, the first layer dense
        dict(
            num_hidden_layers=4,
            num_key_value_heads=4,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            linear_num_heads=4,
            linear_head_dim=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        ),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, intermediate_size=96)),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        # q/k/v biases; a window of 8 on the layers from max_window_layers up, which the tests'
        # 40-token prompts cross
        dict(intermediate_size=96, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            intermediate_size=96,
            attention_bias=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}


# family -> its image-text release's (config class, model class, the other towers' fields): the
# family's text model in `text_config` beside them (build(..., image_text=True))
IMAGE_TEXT: dict[str, tuple[str, str, dict]] = {
    "gemma4": (
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        dict(
            vision_config=dict(
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
            ),
            audio_config=dict(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                output_proj_dims=32,
                subsampling_conv_channels=[8, 4],
            ),
        ),
    ),
}


def zero_centered_norm(family: str, name: str) -> bool:
    # Qwen3-Next, Qwen3.5: every RMSNorm but the gated one of their DeltaNet layers.
    return family in ("qwen3_next", "qwen3_5_moe") and "linear_attn.norm" not in name


def build(
    family: str,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    image_text: bool = False,
    **overrides,
) -> tuple[Path, torch.nn.Module]:
    """Save a tiny random checkpoint of `family` (`image_text`: of its image-text release,
    IMAGE_TEXT) and return (dir, the transformers model)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    fields = {**COMMON, **extra, **overrides}
    if image_text:
        cfg_cls, model_cls, towers = IMAGE_TEXT[family]
        extra, fields = towers, {**towers, "text_config": fields}
    if "text_config" in extra:  # (an image-text model: the text model's fields there)
        text = {**COMMON, **extra["text_config"], **overrides}
        tie = text.setdefault("tie_word_embeddings", False)
        fields = {**extra, "text_config": text, "tie_word_embeddings": tie}
    config = getattr(transformers, cfg_cls)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    # Random init has tiny std: scale everything up so the logits and the routing are far
    # from uniform and a wrong mapping cannot hide in rounding.
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (Gemma-4's router scales multiply as a norm's weight does)
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                # Scales near 1; a zero-centered norm (applied as 1 + weight) stores them - 1.
                one = 0.0 if zero_centered_norm(family, name) else 1.0
                p.copy_(one + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (zeros at init: give it a say)
                b.copy_(torch.randn_like(b) * 0.1)
            if name.endswith("layer_scalar"):  # (Gemma-4's, ones at init)
                b.copy_(1.0 + 0.2 * torch.randn_like(b))
            if name.endswith("tid2eid"):  # (DeepSeek-V4's hash routing: distinct experts)
                experts = config.num_local_experts
                b.copy_(torch.stack([torch.randperm(experts)[: b.shape[1]] for _ in b]))
    model = model.to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if family == "kimi_k25":
        release_layout(out_dir)
    return out_dir, model


def release_layout(out_dir: Path) -> None:
    """Kimi-K2.x's text layers as its release names them: transformers 5.25 saves them as
    `blocks` (reversing its load-time rename of the vision tower's `blocks` to `layers`)."""
    from safetensors.torch import load_file, save_file

    for f in out_dir.glob("*.safetensors"):
        tensors = load_file(f)
        save_file(
            {k.replace(".model.blocks.", ".model.layers."): v for k, v in tensors.items()},
            f,
            metadata={"format": "pt"},
        )
    for index in out_dir.glob("*.index.json"):
        index.write_text(index.read_text().replace(".model.blocks.", ".model.layers."))


def build_chat_model(family: str, out_dir: Path, **overrides) -> tuple[Path, torch.nn.Module]:
    """A tiny checkpoint of `family` with Qwen3's real tokenizer and chat template (so
    engine tests can render conversations and see their special tokens), as the demo has."""
    from freetoken.demo import DEMO_GENERATION_CONFIG
    from freetoken.qwen_vocab import QWEN3_VOCAB_SIZE, write_qwen_tokenizer

    eos = DEMO_GENERATION_CONFIG["eos_token_id"]
    path, model = build(
        family,
        out_dir,
        vocab_size=QWEN3_VOCAB_SIZE,
        tie_word_embeddings=True,
        eos_token_id=eos[0],
        bos_token_id=DEMO_GENERATION_CONFIG["bos_token_id"],
        **{"max_position_embeddings": 8192, **overrides},
    )
    write_qwen_tokenizer(path, model_max_length=model.config.max_position_embeddings)
    (path / "generation_config.json").write_text(json.dumps(DEMO_GENERATION_CONFIG))
    return path, model


# Families whose releases ship a next-token-prediction (MTP) layer freetoken reads, by layout:
# DeepSeek's (`model.layers.{N}.` beside `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`) or
# Qwen3-Next's (`mtp.layers.0.`, `mtp.fc`, `mtp.pre_fc_norm_embedding`, `..._hidden`, `mtp.norm`)
MTP_LAYOUT = {
    "deepseek_v3": "deepseek",
    "deepseek_v32": "deepseek",
    "glm_moe_dsa": "deepseek",
    "glm4_moe": "deepseek",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
}


def add_mtp(out_dir: Path, family: str, model: torch.nn.Module, seed: int = 1) -> dict:
    """Give a tiny checkpoint of `family` (`build`'s) a random MTP layer laid out as its
    release lays one out (transformers models none): its decoder block is layer 0 of a
    one-layer model of the family, saved by transformers and renamed (an MoE layer; Qwen3-Next:
    full attention). Returns the reference's parts: `block` (that one-layer model, its final
    norm the MTP's, its output head the model's), `enorm`, `hnorm`, `eh_proj` (weights)."""
    import tempfile

    from safetensors.torch import load_file, save_file

    cfg_cls, model_cls, extra = FAMILIES[family]
    layout = MTP_LAYOUT[family]
    n = model.config.num_hidden_layers
    one = dict(num_hidden_layers=1, first_k_dense_replace=0, mlp_only_layers=[])
    if "layer_types" in extra:
        one["layer_types"] = ["full_attention"]
    if "indexer_types" in extra:
        one["indexer_types"] = ["full"]
    fields = {**COMMON, **extra, **one, "vocab_size": model.config.vocab_size}
    fields["tie_word_embeddings"] = False
    torch.manual_seed(seed)
    block = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**fields))
    h = model.config.hidden_size
    zc = layout == "qwen3_next"
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if zc else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.08)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
        block.lm_head.weight.copy_(model.get_output_embeddings().weight)
    parts = {
        "enorm": (0.0 if zc else 1.0) + 0.1 * torch.randn(h),
        "hnorm": (0.0 if zc else 1.0) + 0.1 * torch.randn(h),
        "eh_proj": torch.randn(h, 2 * h) * 0.08,
    }
    dtype = next(model.parameters()).dtype
    block = block.to(dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        block.save_pretrained(tmp)
        saved = {}
        for f in Path(tmp).glob("*.safetensors"):
            saved.update(load_file(f))
    prefix = f"model.layers.{n}." if layout == "deepseek" else "mtp.layers.0."
    tensors = {
        prefix + k.removeprefix("model.layers.0."): v
        for k, v in saved.items()
        if k.startswith("model.layers.0.")
    }
    norm = saved["model.norm.weight"]
    if layout == "deepseek":
        tensors |= {
            f"model.layers.{n}.enorm.weight": parts["enorm"],
            f"model.layers.{n}.hnorm.weight": parts["hnorm"],
            f"model.layers.{n}.eh_proj.weight": parts["eh_proj"],
            f"model.layers.{n}.shared_head.norm.weight": norm,
            # (the release's copies of the model's embedding and head: not read again)
            f"model.layers.{n}.embed_tokens.weight": model.get_input_embeddings().weight,
            f"model.layers.{n}.shared_head.head.weight": model.get_output_embeddings().weight,
        }
    else:
        tensors |= {
            "mtp.pre_fc_norm_embedding.weight": parts["enorm"],
            "mtp.pre_fc_norm_hidden.weight": parts["hnorm"],
            "mtp.fc.weight": parts["eh_proj"],
            "mtp.norm.weight": norm,
        }
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}
    save_file(tensors, out_dir / "mtp.safetensors", metadata={"format": "pt"})
    index = out_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
        index.write_text(json.dumps(data))
    config = json.loads((out_dir / "config.json").read_text())
    key = "num_nextn_predict_layers" if layout == "deepseek" else "mtp_num_hidden_layers"
    config[key] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return {**{k: v.to(dtype) for k, v in parts.items()}, "block": block}
