from freetoken.model_config import decoder_config, routed_experts
from freetoken.models.families import mixtral
from freetoken.models.family import Family


def parse_config(raw: dict):
    # MiniMax-M2 (M2, M2.1): q/k norms over all heads at once (OLMoE's), RoPE on the first
    # `rotary_dim` of each head (the release's spelling of partial_rotary_factor), every layer
    # MoE with sigmoid routing and a correction bias (no groups, weights always renormalized,
    # fp32), experts sized by `intermediate_size`, Mixtral's tensor names.
    if raw.get("rotary_dim") and "partial_rotary_factor" not in raw:
        raw = {**raw, "partial_rotary_factor": int(raw["rotary_dim"]) / int(raw["head_dim"])}
    return decoder_config(
        raw,
        "minimax_m2",
        qk_norm="full",
        moe=routed_experts(
            raw,
            intermediate_key="intermediate_size",
            norm_topk_prob=True,
            fp32_gate_weights=True,
            scoring="sigmoid",
        ),
        intermediate_size=0,  # (no dense MLP: `intermediate_size` is the experts')
    )


FAMILY = Family(
    "minimax_m2",
    ("MiniMaxM2ForCausalLM",),
    parse_config,
    renames=(
        (r"\.block_sparse_moe\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
        *mixtral.FAMILY.renames,
    ),
)
