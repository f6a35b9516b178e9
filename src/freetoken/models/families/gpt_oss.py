import torch

from freetoken.activations import SWIGLU_OAI, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from freetoken.errors import UnsupportedModelError
from freetoken.model_config import decoder_config, routed_experts
from freetoken.models.family import Family


def parse_config(raw: dict):
    # gpt-oss: attention sinks, sliding-window and full layers in turn (`layer_types`), biases
    # on q/k/v/o, YaRN; every layer MoE with a biased router (softmax over the top-k logits, the
    # same weights as a renormalized softmax) and biased experts with the clamped SwiGLU.
    alpha, limit = raw.get("swiglu_alpha", SWIGLU_OAI_ALPHA), raw.get("swiglu_limit", 7.0)
    if (alpha, limit) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
        raise UnsupportedModelError(
            f"gpt-oss with swiglu_alpha={alpha}, swiglu_limit={limit}: only the released "
            f"{SWIGLU_OAI_ALPHA} and {SWIGLU_OAI_LIMIT} are supported"
        )
    return decoder_config(
        raw,
        "gpt_oss",
        moe=routed_experts(
            raw,
            intermediate_key="intermediate_size",
            norm_topk_prob=True,
            expert_bias=True,
            router_bias=True,
        ),
        sliding=raw.get("sliding_window") is not None,
        hidden_act=SWIGLU_OAI,
        attn_sinks=True,
        norm_scale_fp32=True,
        intermediate_size=0,  # (no dense MLP: `intermediate_size` is the experts')
    )


def _de_interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss interleaves gate and up (gate at even positions): ours are gate half, up half."""
    return t.unflatten(dim, (-1, 2)).transpose(dim, dim + 1).flatten(dim, dim + 1).contiguous()


def to_layout(name: str, tensor: torch.Tensor, dequantized: bool) -> torch.Tensor:
    """Fused expert tensors in our banks' layout. transformers' bf16 layout is [E, in, out];
    the MXFP4 release's blocks (dequantized) are [E, out, in], as our banks are."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and not dequantized:
        tensor = tensor.transpose(1, 2)
    if name.endswith(("experts.gate_up_proj", "moe.gate_up_proj_bias")):
        return _de_interleave(tensor, 1)
    return tensor


FAMILY = Family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    parse_config,
    renames=((r"\.mlp\.router\.", ".mlp.gate."),),
    to_layout=to_layout,
)
