from freetoken.errors import UnsupportedModelError
from freetoken.model_config import (
    IndexerConfig,
    MLAConfig,
    decoder_config,
    leading_dense_pattern,
    sigmoid_routed_experts,
)
from freetoken.models.family import Family


def parse_config(
    raw: dict,
    family: str = "deepseek_v3",
    groups: tuple[int, int] = (8, 4),
    indexer: IndexerConfig | None = None,
):
    # DeepSeek-V3 (V3.1, R1, and Kimi-K2, which reuse its architecture): multi-head latent
    # attention, sigmoid routing with a correction bias within the best `topk_group` of
    # `n_group` groups, scaled by `routed_scaling_factor`, fp32 gate weights, ungated shared
    # experts and the first `first_k_dense_replace` layers dense (as GLM-4.5:
    # model_config.sigmoid_routed_experts). Missing keys take transformers' defaults. DeepSeek-
    # V3.2 and GLM-5 (deepseek_v32.py, glm_moe_dsa.py) are this with a sparse attention
    # `indexer` and their own defaults (`groups`: n_group, topk_group). Their
    # next-token-prediction layer, `model.layers.{num_hidden_layers}` (family.py's renames),
    # is read for MTP drafts only (ModelConfig.with_mtp).
    scoring = raw.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(
            f"DeepSeek routing with scoring_func {scoring!r} is not supported (V3's sigmoid is)"
        )
    q_lora = raw.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        q_lora_rank=int(q_lora) if q_lora else None,
        # (V3.2 and GLM-5 interleave always: transformers drops the key for them)
        rope_interleave=bool(raw.get("rope_interleave", True)) if indexer is None else True,
        indexer=indexer,
    )
    mlp_types = raw.get("mlp_layer_types")
    return decoder_config(
        raw,
        family,
        moe=sigmoid_routed_experts(raw, groups=groups[0], topk_groups=groups[1], scaling=2.5),
        moe_layers=(
            tuple(t == "sparse" for t in mlp_types)
            if mlp_types
            else leading_dense_pattern(raw, default=3)
        ),
        mla=mla,
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


FAMILY = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), parse_config)
