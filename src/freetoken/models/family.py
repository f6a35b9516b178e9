"""What a model family declares: how to read its config and how its weights are named.

Everything else (the layers, the decoder, the loader) is shared. A family file is a few lines.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken.model_config import ModelConfig

# Hugging Face names of the common decoder layout -> our parameter names. Families whose
# checkpoints use other names first rewrite them to this layout with their own `renames`.
COMMON_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "lm_head."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"layers.\1.attn."),
    (r"^model\.layers\.(\d+)\.linear_attn\.", r"layers.\1.linear_attn."),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.weight$", r"layers.\1.moe.router.weight"),
    # (GLM-4.5, DeepSeek-V3: a sigmoid router's correction bias; their shared experts)
    (
        r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$",
        r"layers.\1.moe.correction_bias",
    ),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.", r"layers.\1.moe.shared."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.", r"layers.\1.moe.shared_gate."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.", r"layers.\1.moe.shared."),
    # (gpt-oss: a router bias; expert biases, whole banks)
    (r"^model\.layers\.(\d+)\.mlp\.gate\.bias$", r"layers.\1.moe.router.bias"),
    (
        r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_bias$",
        r"layers.\1.moe.\2_bias",
    ),
    (r"^model\.layers\.(\d+)\.mlp\.experts\.", r"layers.\1.moe.experts."),
    (r"^model\.layers\.(\d+)\.mlp\.", r"layers.\1.mlp."),
    # (DeepSeek-V3, GLM-4.5, GLM-5: the next-token-prediction layer's own tensors beside its
    # decoder block, `model.layers.{num_hidden_layers}.*`; its `embed_tokens` and
    # `shared_head.head` are the model's own, not read again. In the model only with MTP
    # drafting on: ModelConfig.with_mtp)
    (r"^model\.layers\.\d+\.(enorm|hnorm|eh_proj)\.", r"mtp.\1."),
    (r"^model\.layers\.\d+\.shared_head\.norm\.", "mtp.norm."),
    # (what only one family has, DeepSeek-V4's or Gemma-4's, its renames naming it already)
    (r"^model\.layers\.(\d+)\.own\.", r"layers.\1."),
    (r"^model\.own\.", ""),
)

# Checkpoint tensors that hold nothing we need (precomputed RoPE tables).
IGNORED = re.compile(r"rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    parse_config: Callable[[dict[str, Any]], ModelConfig]
    renames: tuple[tuple[str, str], ...] = ()
    # (canonical name, tensor, whether it was dequantized) -> the tensor in our layout, for
    # families whose checkpoints lay a tensor out otherwise (gpt-oss: transposed, interleaved)
    to_layout: Callable[[str, Any, bool], Any] | None = None
    # config.json -> more renames, for checkpoints whose names depend on the config
    # (Kimi-Linear: `self_attn` is the linear attention in the layers its config lists)
    config_renames: Callable[[dict[str, Any]], tuple[tuple[str, str], ...]] | None = None

    def for_config(self, raw_config: dict[str, Any]) -> Family:
        """This family with the renames its checkpoint's config implies."""
        if self.config_renames is None:
            return self
        renames = (*self.config_renames(raw_config), *self.renames)
        return dataclasses.replace(self, renames=renames, config_renames=None)

    def canonical_name(self, hf_name: str) -> str | None:
        """Our parameter name for a checkpoint tensor name, or None if it is not ours."""
        if IGNORED.search(hf_name):
            return None
        name = hf_name
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        for pattern, repl in COMMON_RENAMES:
            new, hits = re.subn(pattern, repl, name)
            if hits:
                return new
        return None
