from freetoken.model_config import decoder_config, routed_experts
from freetoken.models.family import Family


def parse_config(raw: dict):
    # Mixtral always renormalizes its top-k weights, keeps them in fp32, and sizes its
    # experts by `intermediate_size`.
    return decoder_config(
        raw,
        "mixtral",
        moe=routed_experts(
            raw, intermediate_key="intermediate_size", norm_topk_prob=True, fp32_gate_weights=True
        ),
        sliding=raw.get("sliding_window") is not None,
    )


FAMILY = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    parse_config,
    renames=(
        (r"\.block_sparse_moe\.gate\.", ".mlp.gate."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
        (r"\.block_sparse_moe\.experts\.", ".mlp.experts."),
    ),
)
