from freetoken.model_config import decoder_config, routed_experts, sparse_layer_pattern
from freetoken.models.family import Family


def parse_config(raw: dict):
    # Qwen2 always has q/k/v biases and none on o_proj; its shared expert is scaled by
    # sigmoid(shared_expert_gate(x)).
    return decoder_config(
        raw,
        "qwen2_moe",
        qkv_bias=bool(raw.get("qkv_bias", True)),
        o_bias=False,
        moe=routed_experts(raw, shared_expert_gated=True),
        moe_layers=sparse_layer_pattern(raw),
        sliding=bool(raw.get("use_sliding_window")),
    )


FAMILY = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), parse_config)
