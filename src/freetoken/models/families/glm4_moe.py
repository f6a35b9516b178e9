from freetoken.model_config import decoder_config, routed_experts
from freetoken.models.family import Family


def parse_config(raw: dict):
    # GLM-4.5 / 4.6 / 4.7 MoE: q/k/v biases (none on o_proj), optional per-head qk-norm, RoPE
    # on the first half of each head unless the config says otherwise, the first
    # `first_k_dense_replace` layers dense, sigmoid routing with a correction bias and
    # group-limited choice, scaled by `routed_scaling_factor`, fp32 gate weights, and an
    # ungated shared expert of `n_shared_experts` experts' width.
    raw = {"partial_rotary_factor": 0.5, **raw}
    dense = int(raw.get("first_k_dense_replace", 1))
    moe = routed_experts(
        raw,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        fp32_gate_weights=True,
        scoring="sigmoid",
        num_groups=int(raw.get("n_group", 1)),
        topk_groups=int(raw.get("topk_group", 1)),
        routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
    )
    return decoder_config(
        raw,
        "glm4_moe",
        o_bias=False,
        qk_norm="per_head" if raw.get("use_qk_norm") else "none",
        moe=moe,
        moe_layers=tuple(i >= dense for i in range(int(raw["num_hidden_layers"]))),
    )


FAMILY = Family("glm4_moe", ("Glm4MoeForCausalLM",), parse_config)
