from freetoken.models.families import deepseek_v3
from freetoken.models.families.deepseek_v32 import indexer_config
from freetoken.models.family import Family


def indexer_layers(raw: dict) -> tuple[bool, ...]:
    """Per layer, whether it runs its own indexer ("full") or reuses the last full layer's
    top-k ("shared"): `indexer_types`, else the `index_topk_pattern` string ("FSS..."), else
    every `index_topk_freq`-th layer from `index_skip_topk_offset` - 1 on (transformers')."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq = max(int(raw.get("index_topk_freq", 1)), 1)
        offset = int(raw.get("index_skip_topk_offset", 2))
        return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(layers))
    return tuple(t == "full" for t in types)


def parse_config(raw: dict):
    # GLM-5.x (glm_moe_dsa): DeepSeek-V3.2's layers (MLA, low-rank query, DSA; sigmoid
    # routing in one group by default) with the indexer's RoPE in pairs too, and some layers'
    # indexers "shared": they reuse the last full layer's choice. Its next-token-prediction
    # layer (layer `num_hidden_layers`, a full indexer) is read for MTP drafts only.
    indexer = indexer_config(raw, 32, interleave=True, full=indexer_layers(raw))
    return deepseek_v3.parse_config(raw, "glm_moe_dsa", groups=(1, 1), indexer=indexer)


FAMILY = Family("glm_moe_dsa", ("GlmMoeDsaForCausalLM",), parse_config)
