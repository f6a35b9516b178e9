import dataclasses

from freetoken.errors import UnsupportedModelError
from freetoken.model_config import LinearAttentionConfig
from freetoken.models.families import deepseek_v3, mixtral
from freetoken.models.family import Family

# Kimi-Linear's config.json spells DeepSeek-V3's keys its own way (transformers' attribute_map)
_DEEPSEEK_KEYS = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "num_shared_experts": "n_shared_experts",
    "moe_router_activation_func": "scoring_func",
    "model_max_length": "max_position_embeddings",
}


def linear_layers(raw: dict) -> tuple[bool, ...]:
    """KDA layers: `layer_types`, else the release's 1-based `linear_attn_config` lists, else
    transformers' default (full attention at layers 4, 8, ...)."""
    n, lin = int(raw["num_hidden_layers"]), raw.get("linear_attn_config") or {}
    if raw.get("layer_types"):
        return tuple(t == "linear_attention" for t in raw["layer_types"])
    if "kda_layers" in lin and "full_attn_layers" in lin:
        return tuple(i + 1 in lin["kda_layers"] for i in range(n))
    return tuple(not (i and i % 4 == 0) for i in range(n))


def parse_config(raw: dict):
    # Kimi-Linear: Kimi Delta Attention layers (layers/gated_deltanet.py, `kda`) between MLA
    # layers without RoPE (`mla_use_nope`, which transformers assumes); DeepSeek-V3's MoE
    # (sigmoid routing, one group by default, shared experts, the first layer dense) with its
    # own defaults.
    if raw.get("mla_use_nope") is False:
        raise UnsupportedModelError("Kimi-Linear with RoPE in its MLA (mla_use_nope false)")
    renamed = {ds: raw[k] for k, ds in _DEEPSEEK_KEYS.items() if k in raw}
    ds = {
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446,
        "n_group": 1,
        "topk_group": 1,
        **raw,
        **renamed,
    }
    cfg = deepseek_v3.parse_config(ds, "kimi_linear", groups=(1, 1))
    lin = raw.get("linear_attn_config") or {}
    heads = int(lin.get("num_heads", raw.get("linear_num_heads", 32)))
    dim = int(lin.get("head_dim", raw.get("linear_head_dim", 128)))
    kernel = int(lin.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4)))
    kda = LinearAttentionConfig(heads, heads, dim, dim, kernel, kda=True)
    return dataclasses.replace(
        cfg,
        linear_layers=linear_layers(raw),
        linear_attention=kda,
        mla=dataclasses.replace(cfg.mla, rope=False),
    )


def _kda_renames(raw: dict) -> tuple[tuple[str, str], ...]:
    ids = "|".join(str(i) for i, kda in enumerate(linear_layers(raw)) if kda)
    if not ids:
        return ()
    return ((rf"^model\.layers\.({ids})\.self_attn\.", r"model.layers.\1.linear_attn."),)


def _to_layout(name: str, value, dequantized: bool):
    return value.reshape(-1) if name.endswith("linear_attn.A_log") else value  # (1, 1, H, 1)


FAMILY = Family(
    "kimi_linear",
    ("KimiLinearForCausalLM",),
    parse_config,
    renames=(
        (r"\.linear_attn\.o_norm\.", ".linear_attn.norm."),
        (r"\.linear_attn\.o_proj\.", ".linear_attn.out_proj."),
        (r"\.linear_attn\.b_proj\.", ".linear_attn.in_proj_b."),
        *mixtral.FAMILY.renames,  # (the router and w1/w2/w3 experts; then the rest of it)
        (r"\.block_sparse_moe\.", ".mlp."),
    ),
    to_layout=_to_layout,
    config_renames=_kda_renames,
)
