from freetoken.model_config import decoder_config
from freetoken.models.family import Family


def parse_config(raw: dict):
    # Qwen2 and Qwen2.5 (Coder and Math included): q/k/v biases and none on o_proj; the sliding
    # window, where a config turns it on, from `max_window_layers` up (transformers 5 writes
    # the answer as `layer_types`).
    return decoder_config(
        raw,
        "qwen2",
        qkv_bias=True,
        o_bias=False,
        sliding=bool(raw.get("use_sliding_window")),
    )


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), parse_config)
