from freetoken.models.families import qwen3_next
from freetoken.models.family import Family


def parse_config(raw: dict):
    # Qwen3.5-MoE (and Qwen3.6), text part: Qwen3-Next's layers, with the DeltaNet's q/k/v, z,
    # b and a from four projections in head order, every layer MoE, the top-k weights always
    # renormalised. Its text-only RoPE is Qwen3-Next's (the three position grids of mRoPE are
    # one for text). A multimodal checkpoint keeps the text model's config in `text_config`
    # and its weights under `model.language_model.`; its vision tower is not read.
    if "text_config" in raw:
        outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        raw = {**outer, **raw["text_config"]}
    return qwen3_next.parse_config(
        raw, "qwen3_5_moe", separate_projections=True, norm_topk_prob=True
    )


FAMILY = Family(
    "qwen3_5_moe",
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    parse_config,
    renames=((r"^model\.language_model\.", "model."), *qwen3_next.MTP_RENAMES),
    config_renames=qwen3_next.mtp_block_renames,
)
