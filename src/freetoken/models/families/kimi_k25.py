from freetoken.errors import UnsupportedModelError
from freetoken.models.families import deepseek_v3
from freetoken.models.family import Family


def parse_config(raw: dict):
    # Kimi-K2.5 / K2.6: an image-text model whose text model is DeepSeek-V3's (`text_config`,
    # weights under `language_model.`); its vision tower and projector are not read.
    text = raw["text_config"]
    if "quantization_config" in text and "quantization_config" not in raw:
        method = text["quantization_config"].get("quant_method")
        raise UnsupportedModelError(
            f"Kimi-K2.x text model quantized with {method!r} (in text_config): not read yet; "
            "use a bf16 or FP8 conversion of the release"
        )
    outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    text = {k: v for k, v in text.items() if k != "architectures"}  # (the outer one names it)
    return deepseek_v3.parse_config({**outer, **text}, "kimi_k25")


FAMILY = Family(
    "kimi_k25",
    # (the release's own code names the class without the underscore)
    ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration"),
    parse_config,
    renames=(
        (r"^language_model\.model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^model\.language_model\.", "model."),  # (transformers' names in memory)
    ),
)
