from freetoken.errors import UnsupportedModelError
from freetoken.model_config import MLAConfig, decoder_config, routed_experts
from freetoken.models.family import Family


def parse_config(raw: dict):
    # DeepSeek-V3 (V3.1, R1, and Kimi-K2, which reuse its architecture): multi-head latent
    # attention, sigmoid routing with a correction bias within the best `topk_group` of
    # `n_group` groups, scaled by `routed_scaling_factor`, fp32 gate weights, ungated shared
    # experts and the first `first_k_dense_replace` layers dense (GLM-4.5's MoE options:
    # models/families/glm4_moe.py). Missing keys take transformers' DeepseekV3Config defaults.
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(
            f"DeepSeek routing with scoring_func {scoring!r} is not supported (V3's sigmoid is)"
        )
    dense = int(raw.get("first_k_dense_replace", 3))
    moe = routed_experts(
        raw,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        fp32_gate_weights=True,
        scoring="sigmoid",
        num_groups=int(raw.get("n_group", 8)),
        topk_groups=int(raw.get("topk_group", 4)),
        routed_scaling=float(raw.get("routed_scaling_factor", 2.5)),
    )
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        q_lora_rank=int(q_lora) if q_lora else None,
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    return decoder_config(
        raw,
        "deepseek_v3",
        moe=moe,
        moe_layers=tuple(i >= dense for i in range(int(raw["num_hidden_layers"]))),
        mla=mla,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
    )


FAMILY = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), parse_config)
