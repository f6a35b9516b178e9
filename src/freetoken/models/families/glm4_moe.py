from freetoken.model_config import decoder_config, leading_dense_pattern, sigmoid_routed_experts
from freetoken.models.family import Family


def parse_config(raw: dict):
    # GLM-4.5 / 4.6 / 4.7 MoE: q/k/v biases (none on o_proj), optional per-head qk-norm, RoPE
    # on the first half of each head unless the config says otherwise, the first
    # `first_k_dense_replace` layers dense, sigmoid routing with a correction bias and
    # group-limited choice, scaled by `routed_scaling_factor`, fp32 gate weights, and an
    # ungated shared expert of `n_shared_experts` experts' width.
    raw = {"partial_rotary_factor": 0.5, **raw}
    return decoder_config(
        raw,
        "glm4_moe",
        o_bias=False,
        qk_norm="per_head" if raw.get("use_qk_norm") else "none",
        moe=sigmoid_routed_experts(raw),
        moe_layers=leading_dense_pattern(raw, default=1),
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


FAMILY = Family("glm4_moe", ("Glm4MoeForCausalLM",), parse_config)
