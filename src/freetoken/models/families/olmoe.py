from freetoken.model_config import decoder_config, routed_experts
from freetoken.models.family import Family


def parse_config(raw: dict):
    # OLMoE normalizes q and k over all heads at once and may clamp q/k/v.
    clip = raw.get("clip_qkv")
    return decoder_config(
        raw,
        "olmoe",
        qk_norm="full",
        clip_qkv=float(clip) if clip is not None else None,
        moe=routed_experts(raw, intermediate_key="intermediate_size"),
    )


FAMILY = Family("olmoe", ("OlmoeForCausalLM",), parse_config)
