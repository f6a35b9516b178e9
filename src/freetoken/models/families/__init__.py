"""Registry of model families keyed by the `architectures` value of config.json.

Family modules are imported only when a checkpoint asks for them.
"""

from __future__ import annotations

import importlib
from typing import Any

from freetoken.errors import UnsupportedModelError
from freetoken.models.family import Family

ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}


def family_for(raw_config: dict[str, Any]) -> Family:
    archs = raw_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            module = importlib.import_module(f"{__name__}.{ARCHITECTURES[arch]}")
            return module.FAMILY
    shown = ", ".join(archs) if archs else "none given"
    raise UnsupportedModelError(
        f"unsupported architecture ({shown}); supported: {', '.join(sorted(ARCHITECTURES))}"
    )
