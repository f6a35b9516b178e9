"""The registry of model families: each family file declares its `FAMILY`, with the
`architectures` values of config.json it reads; this module lists the files once.

A new family is a file here and a line in FAMILY_MODULES.
"""

from __future__ import annotations

import importlib
from typing import Any

from freetoken.errors import UnsupportedModelError
from freetoken.models.family import Family

FAMILY_MODULES = (
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
    "deepseek_v4",
    "gpt_oss",
    "qwen3",
    "qwen2",
    "llama",
    "minimax_m2",
    "kimi_k25",
    "gemma4",
    "kimi_linear",
)
FAMILIES: tuple[Family, ...] = tuple(
    importlib.import_module(f"{__name__}.{name}").FAMILY for name in FAMILY_MODULES
)
ARCHITECTURES: dict[str, Family] = {
    arch: family for family in FAMILIES for arch in family.architectures
}


def family_for(raw_config: dict[str, Any]) -> Family:
    archs = raw_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch].for_config(raw_config)
    shown = ", ".join(archs) if archs else "none given"
    raise UnsupportedModelError(
        f"unsupported architecture ({shown}); supported: {', '.join(sorted(ARCHITECTURES))}"
    )
