from freetoken.model_config import decoder_config
from freetoken.models.family import Family


def parse_config(raw: dict):
    return decoder_config(raw, "llama")


FAMILY = Family("llama", ("LlamaForCausalLM",), parse_config)
