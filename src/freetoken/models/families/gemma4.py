import logging

from freetoken.errors import UnsupportedModelError
from freetoken.model_config import AttentionShape, decoder_config, parse_rope, routed_experts
from freetoken.models.family import Family

log = logging.getLogger(__name__)

# transformers' RoPE by layer kind where a config leaves it out
_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}


def parse_config(raw: dict):
    # Gemma-4 MoE (transformers' `gemma4_text` with `enable_moe_block`): sliding and full
    # layers (`layer_types`, the last one full), the full ones with their own head width
    # (`global_head_dim`), KV heads and RoPE ("proportional"), their values the key projection's
    # output where `attention_k_eq_v`; q/k norms per head, values normed without a weight,
    # softmax scale 1; norms after attention and after the feed-forward; in every layer a dense
    # MLP beside the experts (softmax top-k, renormalised, times a learned scale per expert);
    # a learned scalar per layer; embeddings times sqrt(hidden); final logits soft-capped. The
    # image-text release keeps this in `text_config`, its weights under `model.language_model.`.
    raw = _text_config(raw)
    n = int(raw["num_hidden_layers"])
    default = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    types = list(raw.get("layer_types") or default)
    types[-1] = "full_attention"  # (as transformers forces it)
    ropes = {
        k: parse_rope({"rope_parameters": v})
        for k, v in {**_ROPE, **(raw.get("rope_parameters") or {})}.items()
    }
    kv_heads = int(raw.get("num_key_value_heads", raw["num_attention_heads"]))
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    # A full layer's heads: `per_layer_config` where transformers saved one, by layer; else
    # `global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads`
    full = {"head_dim": int(raw.get("global_head_dim", 512))}
    if k_eq_v and raw.get("num_global_key_value_heads"):
        full["num_key_value_heads"] = int(raw["num_global_key_value_heads"])
    per_layer = raw.get("per_layer_config") or {
        str(i): full for i, t in enumerate(types) if t == "full_attention"
    }

    def shape(i: int, kind: str) -> AttentionShape:
        own = {
            "head_dim": raw.get("head_dim", 256),
            "num_key_value_heads": kv_heads,
            **per_layer.get(str(i), {}),
        }
        k_is_v = k_eq_v and kind == "full_attention"
        return AttentionShape(
            int(own["head_dim"]),
            int(own["num_key_value_heads"]),
            ropes[kind],
            values_from_keys=k_is_v,
        )

    shapes = tuple(shape(i, kind) for i, kind in enumerate(types))
    raw = {
        **raw,
        "layer_types": types,
        "num_experts_per_tok": raw["top_k_experts"],
        "shared_expert_intermediate_size": raw["intermediate_size"],
    }
    return decoder_config(
        raw,
        "gemma4",
        moe=routed_experts(raw, norm_topk_prob=True, fp32_gate_weights=True, scaled_router=True),
        hidden_act=raw.get("hidden_activation", "gelu_pytorch_tanh"),
        intermediate_size=0,  # (the dense MLP is the MoE block's: its `shared` expert)
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qk_norm="per_head",
        norm_scale_fp32=True,
        layer_attention=shapes,
        head_dim=shapes[0].head_dim,
        rope=shapes[0].rope,
        attn_scale=1.0,
        v_norm=True,
        sandwich_norms=True,
        layer_scalar=True,
        embed_scale=int(raw["hidden_size"]) ** 0.5,
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _text_config(raw: dict) -> dict:
    """The text model's config (an image-text release's `text_config`), refused unless it is
    the MoE form."""
    if "text_config" in raw:
        if raw.get("vision_config") or raw.get("audio_config"):
            log.info("Gemma-4: the text model is read; the vision and audio towers are not")
        outer = {k: v for k, v in raw.items() if not k.endswith("_config")}
        raw = {**outer, **raw["text_config"], "architectures": raw["architectures"]}
    dense = ("hidden_size_per_layer_input", "num_kv_shared_layers", "use_double_wide_mlp")
    unsupported = {k: raw[k] for k in dense if raw.get(k)}
    if raw.get("use_bidirectional_attention") == "all" or not raw.get("enable_moe_block"):
        unsupported = unsupported or {"enable_moe_block": False}
    if unsupported:
        raise UnsupportedModelError(
            f"Gemma-4 is supported in its MoE form (causal text), not with {unsupported}"
        )
    return raw


_L = r"^(model\.layers\.\d+)\."
FAMILY = Family(
    "gemma4",
    ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    parse_config,
    renames=(
        (r"^model\.language_model\.", "model."),  # (the image-text release's text model)
        (_L + r"post_attention_layernorm\.", r"\1.self_attn.post_norm."),
        (_L + r"pre_feedforward_layernorm\.", r"\1.post_attention_layernorm."),
        (_L + r"post_feedforward_layernorm\.", r"\1.own.ffn_post_norm."),
        (_L + r"post_feedforward_layernorm_1\.", r"\1.own.moe.shared_post_norm."),
        (_L + r"pre_feedforward_layernorm_2\.", r"\1.own.moe.experts_norm."),
        (_L + r"post_feedforward_layernorm_2\.", r"\1.own.moe.experts_post_norm."),
        (_L + r"layer_scalar$", r"\1.own.layer_scalar"),
        (_L + r"router\.proj\.", r"\1.mlp.gate."),
        (_L + r"router\.scale$", r"\1.own.moe.router_scale"),
        (_L + r"router\.per_expert_scale$", r"\1.own.moe.per_expert_scale"),
        (_L + r"experts\.", r"\1.mlp.experts."),
        (_L + r"mlp\.(gate|up|down)_proj\.", r"\1.mlp.shared_expert.\2_proj."),
    ),
)
