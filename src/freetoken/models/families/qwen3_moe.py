from freetoken.model_config import decoder_config, routed_experts, sparse_layer_pattern
from freetoken.models.family import Family


def parse_config(raw: dict):
    return decoder_config(
        raw,
        "qwen3_moe",
        qk_norm="per_head",
        moe=routed_experts(raw),
        moe_layers=sparse_layer_pattern(raw),
        sliding=bool(raw.get("use_sliding_window")),
    )


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), parse_config)
