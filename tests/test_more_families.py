"""What the exactness tests do not cover of the families of issue 45 (MiniMax-M2, Kimi-K2.6,
Kimi-Linear, Gemma-4): configs as the releases spell them, their tensor names, formats and
layouts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.engine.runner import ModelRunner, kv_bytes_per_token
from freetoken.errors import UnsupportedModelError
from freetoken.models.families import family_for
from freetoken.models.loading import expert_storage, load_model
from freetoken.weights.safetensors_dir import CheckpointDir
from test_quantized import fp8_blocks
from tiny_models import build

# config.json of MiniMaxAI/MiniMax-M2 as released (its keys that the model reads)
MINIMAX_M2 = dict(
    architectures=["MiniMaxM2ForCausalLM"],
    head_dim=128,
    hidden_size=3072,
    intermediate_size=1536,
    num_attention_heads=48,
    num_key_value_heads=8,
    num_hidden_layers=62,
    num_local_experts=256,
    num_experts_per_tok=8,
    rotary_dim=64,
    rope_theta=5000000,
    vocab_size=200064,
    rms_norm_eps=1e-6,
    scoring_func="sigmoid",
    use_routing_bias=True,
    qk_norm_type="per_layer",
    max_position_embeddings=196608,
)


# config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct as released (its keys that the model
# reads; transformers' attribute_map names the DeepSeek-V3 keys they stand for)
KIMI_LINEAR = dict(
    architectures=["KimiLinearForCausalLM"],
    model_type="kimi_linear",
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=27,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=72,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    mla_use_nope=True,
    linear_attn_config=dict(
        kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
        num_heads=32,
        head_dim=128,
        short_conv_kernel_size=4,
    ),
    num_experts=256,
    num_experts_per_token=8,
    num_shared_experts=1,
    moe_intermediate_size=1024,
    moe_router_activation_func="sigmoid",
    moe_renormalize=True,
    routed_scaling_factor=2.446,
    first_k_dense_replace=1,
    num_expert_group=1,
    topk_group=1,
    model_max_length=1048576,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    vocab_size=163840,
    tie_word_embeddings=False,
)


def logits(path) -> torch.Tensor:
    runner = ModelRunner(load_model(path, dtype="float32"), kv_cache_tokens=128, page_size=8)
    seq = runner.new_sequence()
    out = [runner.forward([seq], [list(range(3, 30))], all_logits=True)]
    for token in (5, 17, 40):
        out.append(runner.forward([seq], [[token]], all_logits=True))
    return torch.cat(out)


def test_minimax_m2_reads_its_released_config():
    family = family_for(MINIMAX_M2)
    cfg = family.parse_config(MINIMAX_M2)
    assert cfg.rope.partial_rotary_factor == 0.5 and cfg.rope.theta == 5e6  # (`rotary_dim`)
    assert cfg.qk_norm == "full" and cfg.intermediate_size == 0 and all(cfg.moe_layers)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (256, 8, 1536)
    assert moe.scoring == "sigmoid" and moe.norm_topk_prob and moe.routed_scaling == 1.0
    assert moe.num_groups == 1 and moe.shared_expert_intermediate_size == 0
    name = family.canonical_name("model.layers.7.block_sparse_moe.e_score_correction_bias")
    assert name == "layers.7.moe.correction_bias"
    assert family.canonical_name("model.layers.7.block_sparse_moe.experts.3.w3.weight") == (
        "layers.7.moe.experts.3.up_proj.weight"
    )


def test_minimax_m2_fp8_experts_stay_fp8(tmp_path):
    """The release's layout: FP8 experts (Mixtral's w1/w2/w3) with block scales, the router
    and its correction bias unquantized; experts are kept fp8 and give the logits of their
    dequantized weights."""
    src, _ = build("minimax_m2", tmp_path / "src")
    stored, plain = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("w1.weight", "w2.weight", "w3.weight", "_proj.weight")):
            parts, plain[name] = fp8_blocks(t, (16, 16))
            stored.update({name.removesuffix(".weight") + s: p for s, p in parts.items()})
        else:
            stored[name] = plain[name] = t
    config = json.loads((src / "config.json").read_text())
    quant = dict(
        quant_method="fp8",
        fmt="float8_e4m3fn",
        weight_block_size=[16, 16],
        modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"],
    )
    variants = (("fp8", stored, {"quantization_config": quant}), ("plain", plain, {}))
    for label, weights, extra in variants:
        (tmp_path / label).mkdir()
        save_file(weights, tmp_path / label / "model.safetensors")
        (tmp_path / label / "config.json").write_text(json.dumps({**config, **extra}))
    ckpt = CheckpointDir(tmp_path / "fp8")
    family = family_for(ckpt.config)
    fmt, kept, _ = expert_storage(ckpt, family, family.parse_config(ckpt.config))
    assert fmt.name == "fp8" and len(kept) == 3 * 3 * 8  # layers x projections x experts
    assert (logits(tmp_path / "fp8") - logits(tmp_path / "plain")).abs().max() < 1e-4


def test_kimi_k25_reads_its_text_model_under_language_model():
    raw = dict(
        architectures=["KimiK25ForConditionalGeneration"],
        text_config=dict(
            architectures=["DeepseekV3ForCausalLM"],
            model_type="kimi_k2",
            hidden_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=160,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            q_lora_rank=24,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            first_k_dense_replace=1,
            tie_word_embeddings=False,
        ),
        vision_config=dict(hidden_size=32),
        tie_word_embeddings=True,
    )
    family = family_for(raw)
    cfg = family.parse_config(raw)
    assert cfg.family == "kimi_k25" and cfg.mla is not None and not cfg.tie_word_embeddings
    assert cfg.moe.routed_scaling == 2.827 and cfg.moe.num_groups == 1
    assert cfg.architecture == "KimiK25ForConditionalGeneration"
    for stored, ours in (
        (
            "language_model.model.layers.1.mlp.experts.5.up_proj.weight",
            "layers.1.moe.experts.5.up_proj.weight",
        ),
        ("language_model.lm_head.weight", "lm_head.weight"),
        ("language_model.model.embed_tokens.weight", "embed.weight"),
        ("vision_tower.encoder.blocks.0.wqkv.weight", None),
        ("mm_projector.proj.0.weight", None),
    ):
        assert family.canonical_name(stored) == ours
    # the release's INT4 experts (compressed-tensors, in text_config): refused, saying so
    raw["text_config"]["quantization_config"] = dict(quant_method="compressed-tensors")
    with pytest.raises(UnsupportedModelError, match="compressed-tensors"):
        family.parse_config(raw)


# config.json of google/gemma-4-26B-A4B-it as released (its text model's keys that the model
# reads; `rope_parameters` as transformers writes its defaults)
GEMMA4_26B = dict(
    architectures=["Gemma4ForConditionalGeneration"],
    tie_word_embeddings=True,
    vision_config=dict(hidden_size=1152),
    audio_config=None,
    text_config=dict(
        hidden_size=2816,
        num_hidden_layers=30,
        vocab_size=262144,
        intermediate_size=2112,
        moe_intermediate_size=704,
        num_experts=128,
        top_k_experts=8,
        enable_moe_block=True,
        sliding_window=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        num_global_key_value_heads=2,
        global_head_dim=512,
        attention_k_eq_v=True,
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
        max_position_embeddings=262144,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
        use_bidirectional_attention="vision",
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)
        ],
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(
                rope_type="proportional", partial_rotary_factor=0.25, rope_theta=1000000.0
            ),
        ),
    ),
)


def test_gemma4_reads_its_released_config():
    family = family_for(GEMMA4_26B)
    cfg = family.parse_config(GEMMA4_26B)
    assert cfg.family == "gemma4" and cfg.tie_word_embeddings and cfg.sliding_window == 1024
    sliding, full = cfg.attention_shape(0), cfg.attention_shape(5)
    assert (sliding.head_dim, sliding.num_kv_heads, sliding.values_from_keys) == (256, 8, False)
    assert (full.head_dim, full.num_kv_heads, full.values_from_keys) == (512, 2, True)
    assert full.rope.type == "proportional" and full.rope.theta == 1e6
    assert cfg.sliding_layers.count(False) == 5 and not cfg.sliding_layers[-1]
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 704)
    assert moe.shared_expert_intermediate_size == 2112 and moe.scaled_router
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.final_logit_softcapping == 30.0
    assert cfg.attn_scale == 1.0 and cfg.embed_scale == 2816**0.5
    # KV a token: 25 sliding layers of 8 x 256, 5 full ones of 2 x 512, K and V, in bf16
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * (25 * 8 * 256 + 5 * 2 * 512) * 2
    for stored, ours in (
        ("model.language_model.layers.5.router.proj.weight", "layers.5.moe.router.weight"),
        ("model.language_model.layers.5.router.per_expert_scale", "layers.5.moe.per_expert_scale"),
        ("model.language_model.layers.5.experts.gate_up_proj", "layers.5.moe.experts.gate_up_proj"),
        ("model.language_model.layers.5.mlp.up_proj.weight", "layers.5.moe.shared.up_proj.weight"),
        (
            "model.language_model.layers.5.post_attention_layernorm.weight",
            "layers.5.attn.post_norm.weight",
        ),
        (
            "model.language_model.layers.5.pre_feedforward_layernorm.weight",
            "layers.5.mlp_norm.weight",
        ),
        (
            "model.language_model.layers.5.pre_feedforward_layernorm_2.weight",
            "layers.5.moe.experts_norm.weight",
        ),
        ("model.language_model.layers.5.layer_scalar", "layers.5.layer_scalar"),
        ("model.vision_tower.encoder.layers.0.post_attention_layernorm.weight", None),
        ("model.embed_vision.embedding_projection.weight", None),
    ):
        assert family.canonical_name(stored) == ours
    # its dense releases (per-layer embeddings, shared KV) are refused, saying so
    dense = dict(GEMMA4_26B["text_config"], enable_moe_block=False, architectures=["x"])
    with pytest.raises(UnsupportedModelError, match="MoE form"):
        family.parse_config(dense)


def test_gemma4_image_text_release_reads_its_text_model(tmp_path, caplog):
    """The image-text release's layout (`model.language_model.*` beside the vision and audio
    towers): the towers are not read, and the text model gives transformers' logits."""
    path, hf = build("gemma4", tmp_path / "m", image_text=True)
    with caplog.at_level("INFO"):
        ours = logits(path)
    assert "vision and audio towers are not" in caplog.text
    assert "ignored" in caplog.text and "model.audio_tower." in caplog.text
    ids = [*range(3, 30), 5, 17, 40]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_kimi_linear_reads_its_released_config_and_names():
    family = family_for(KIMI_LINEAR)
    cfg = family.parse_config(KIMI_LINEAR)
    full = (3, 7, 11, 15, 19, 23, 26)  # (the release counts layers from 1)
    assert cfg.linear_layers == tuple(i not in full for i in range(27))
    la = cfg.linear_attention
    assert la.kda and (la.num_key_heads, la.num_value_heads, la.key_head_dim) == (32, 32, 128)
    assert la.conv_kernel == 4 and la.conv_dim == 3 * 32 * 128
    assert not cfg.mla.rope and cfg.mla.kv_lora_rank == 512 and cfg.mla.q_lora_rank is None
    assert cfg.moe_layers == (False,) + (True,) * 26 and cfg.max_position_embeddings == 1 << 20
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (256, 8, 1024)
    assert moe.scoring == "sigmoid" and moe.norm_topk_prob and moe.routed_scaling == 2.446
    assert moe.num_groups == 1 and moe.shared_expert_intermediate_size == 1024
    for stored, ours in (
        # `self_attn` is the KDA in a KDA layer, MLA in a full-attention one
        ("model.layers.0.self_attn.q_conv1d.weight", "layers.0.linear_attn.q_conv1d.weight"),
        ("model.layers.2.self_attn.q_proj.weight", "layers.2.linear_attn.q_proj.weight"),
        ("model.layers.3.self_attn.q_proj.weight", "layers.3.attn.q_proj.weight"),
        ("model.layers.26.self_attn.o_proj.weight", "layers.26.attn.o_proj.weight"),
        ("model.layers.25.self_attn.o_proj.weight", "layers.25.linear_attn.out_proj.weight"),
        ("model.layers.25.self_attn.o_norm.weight", "layers.25.linear_attn.norm.weight"),
        ("model.layers.25.self_attn.b_proj.weight", "layers.25.linear_attn.in_proj_b.weight"),
        ("model.layers.25.self_attn.A_log", "layers.25.linear_attn.A_log"),
        ("model.layers.0.mlp.gate_proj.weight", "layers.0.mlp.gate_proj.weight"),
        (
            "model.layers.5.block_sparse_moe.experts.7.w3.weight",
            "layers.5.moe.experts.7.up_proj.weight",
        ),
        (
            "model.layers.5.block_sparse_moe.gate.e_score_correction_bias",
            "layers.5.moe.correction_bias",
        ),
        (
            "model.layers.5.block_sparse_moe.shared_experts.down_proj.weight",
            "layers.5.moe.shared.down_proj.weight",
        ),
    ):
        assert family.canonical_name(stored) == ours
    with pytest.raises(UnsupportedModelError, match="mla_use_nope"):
        family.parse_config({**KIMI_LINEAR, "mla_use_nope": False})
