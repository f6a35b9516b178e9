from freetoken.model_config import (
    LinearAttentionConfig,
    decoder_config,
    linear_attention_pattern,
    routed_experts,
    sparse_layer_pattern,
)
from freetoken.models.family import Family


def parse_config(
    raw: dict,
    family: str = "qwen3_next",
    separate_projections: bool = False,
    norm_topk_prob: bool | None = None,
):
    # Qwen3-Next: gated DeltaNet layers with full attention every 4th layer, gated attention
    # output, zero-centered norms, partial RoPE (a quarter of each head unless the config says
    # otherwise) and a sigmoid-gated shared expert.
    raw = {"partial_rotary_factor": 0.25, **raw}
    return decoder_config(
        raw,
        family,
        qk_norm="per_head",
        moe=routed_experts(raw, shared_expert_gated=True, norm_topk_prob=norm_topk_prob),
        moe_layers=sparse_layer_pattern(raw),
        linear_layers=linear_attention_pattern(raw, default_interval=4),
        linear_attention=LinearAttentionConfig(
            num_key_heads=int(raw["linear_num_key_heads"]),
            num_value_heads=int(raw["linear_num_value_heads"]),
            key_head_dim=int(raw["linear_key_head_dim"]),
            value_head_dim=int(raw["linear_value_head_dim"]),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
            separate_projections=separate_projections,
        ),
        attn_output_gate=True,
        zero_centered_norm=True,
        mtp_layers=int(raw.get("mtp_num_hidden_layers", 0)),
    )


# The next-token-prediction layer under `mtp.`: its decoder block (`mtp.layers.0.`, a full
# attention layer) is read as layer `num_hidden_layers`, `fc` over the normed embedding and
# hidden state as `eh_proj` (ModelConfig.with_mtp)
MTP_RENAMES = (
    (r"^mtp\.fc\.", "model.own.mtp.eh_proj."),
    (r"^mtp\.pre_fc_norm_embedding\.", "model.own.mtp.enorm."),
    (r"^mtp\.pre_fc_norm_hidden\.", "model.own.mtp.hnorm."),
    (r"^mtp\.norm\.", "model.own.mtp.norm."),
)


def mtp_block_renames(raw: dict) -> tuple[tuple[str, str], ...]:
    """`mtp.layers.0.` as the layer after the model's last (its text config's, where nested)."""
    layers = raw.get("text_config", raw)["num_hidden_layers"]
    return ((r"^mtp\.layers\.0\.", f"model.layers.{int(layers)}."),)


FAMILY = Family(
    "qwen3_next",
    ("Qwen3NextForCausalLM",),
    parse_config,
    renames=MTP_RENAMES,
    config_renames=mtp_block_renames,
)
