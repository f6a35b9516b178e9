from freetoken.model_config import IndexerConfig
from freetoken.models.families import deepseek_v3
from freetoken.models.family import Family


def indexer_config(raw: dict, n_heads: int, interleave: bool, full: tuple[bool, ...]):
    """DeepSeek Sparse Attention's indexer as V3.2 and GLM-5 configure it."""
    return IndexerConfig(
        n_heads=int(raw.get("index_n_heads", n_heads)),
        head_dim=int(raw.get("index_head_dim", 128)),
        topk=int(raw.get("index_topk", 2048)),
        rope_interleave=interleave,
        full=full,
    )


def parse_config(raw: dict):
    # DeepSeek-V3.2 (-Exp): DeepSeek-V3 with DeepSeek Sparse Attention, an indexer in every
    # layer whose RoPE takes the halves (the attention's own takes pairs); the query always
    # low-rank. Its next-token-prediction layer (layer `num_hidden_layers`) is read for MTP
    # drafts only (deepseek_v3.py).
    layers = int(raw["num_hidden_layers"])
    indexer = indexer_config(raw, 64, interleave=False, full=(True,) * layers)
    return deepseek_v3.parse_config(raw, "deepseek_v32", indexer=indexer)


FAMILY = Family("deepseek_v32", ("DeepseekV32ForCausalLM",), parse_config)
