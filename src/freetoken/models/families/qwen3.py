from freetoken.model_config import decoder_config
from freetoken.models.family import Family


def parse_config(raw: dict):
    return decoder_config(
        raw, "qwen3", qk_norm="per_head", sliding=bool(raw.get("use_sliding_window"))
    )


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), parse_config)
