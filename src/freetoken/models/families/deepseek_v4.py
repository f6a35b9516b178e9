"""DeepSeek-V4 (V4-Flash, V4-Pro): compressed attention beside a sliding window, hyper-connected
residual streams, hash-routed and sqrtsoftplus-routed experts (layers/compressed_attention.py,
models/decoder.py, layers/moe.py). Its next-token-prediction layer (`mtp.*`) is not read."""

from freetoken.activations import SWIGLU_CLAMP, SWIGLU_CLAMP_LIMIT
from freetoken.errors import UnsupportedModelError
from freetoken.model_config import (
    CompressedAttentionConfig,
    decoder_config,
    parse_rope,
    routed_experts,
)
from freetoken.models.family import Family

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
RATIO_KINDS = {0: KINDS[0], 4: KINDS[1], 128: KINDS[2]}


# transformers' defaults (configuration_deepseek_v4.py: V4-Flash's sizes) for keys a config omits
DEFAULTS = dict(
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    head_dim=512,
    n_routed_experts=256,
    num_experts_per_tok=6,
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    sliding_window=128,
    bos_token_id=0,
    eos_token_id=1,
)


def parse_config(raw: dict):
    # Missing keys take transformers' defaults, its legacy spellings (compress_ratios,
    # compress_rate_csa/hca, num_hash_layers, qk_rope_head_dim) folded in as it folds them. The
    # one shared expert is `moe_intermediate_size` wide whatever n_shared_experts says (as
    # transformers builds it).
    raw = {**DEFAULTS, **raw}
    raw["shared_expert_intermediate_size"] = raw["moe_intermediate_size"]
    n = int(raw["num_hidden_layers"])
    kinds, rates = _layer_kinds(raw, n)
    mlp_kinds = raw.get("mlp_layer_types")
    if mlp_kinds is None:
        hashed = int(raw.get("num_hash_layers", 3))
        mlp_kinds = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    head_dim = int(raw["head_dim"])
    partial = raw.get("partial_rotary_factor")
    if partial is None:
        partial = int(raw.get("qk_rope_head_dim", 64)) / head_dim
    _check_supported(raw)
    main, compress = _ropes(raw)

    def rope_of(params: dict):
        params = {**params, "partial_rotary_factor": partial}
        context = raw.get("max_position_embeddings")
        return parse_rope({"rope_parameters": params, "max_position_embeddings": context})

    compressed = CompressedAttentionConfig(
        layer_kinds=kinds,
        csa_ratio=int(rates["compressed_sparse_attention"]),
        hca_ratio=int(rates["heavily_compressed_attention"]),
        rope_dim=int(head_dim * partial),
        q_lora_rank=int(raw.get("q_lora_rank", 1024)),
        o_groups=int(raw.get("o_groups", 8)),
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        index_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        compress_rope=rope_of(compress),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        hash_layers=tuple(k == "hash_moe" for k in mlp_kinds[:n]),
    )
    return decoder_config(
        raw,
        "deepseek_v4",
        moe=routed_experts(
            raw,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            scoring="sqrtsoftplus",
            routed_scaling=float(raw.get("routed_scaling_factor", 1.5)),
            hash_layers=compressed.hash_layers,
        ),
        norm_scale_fp32=True,
        head_dim=head_dim,
        num_kv_heads=1,
        hidden_act=SWIGLU_CLAMP,
        rope=rope_of(main),
        sliding_window=int(raw["sliding_window"]),
        compressed=compressed,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
    )


def _layer_kinds(raw: dict, n: int) -> tuple[tuple[str, ...], dict[str, int]]:
    """Each of the `n` layers' attention kind, and each compressing kind's ratio."""
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates.update(raw.get("compress_rates") or {})
    if raw.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = int(raw["compress_rate_csa"])
    if raw.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = int(raw["compress_rate_hca"])
    kinds = raw.get("layer_types")
    if kinds is None and raw.get("compress_ratios") is not None:
        kinds = [RATIO_KINDS[int(r)] for r in raw["compress_ratios"]]
    if kinds is None:
        kinds = [KINDS[2]] * min(n, 2) + [KINDS[1] if i % 2 else KINDS[2] for i in range(n - 2)]
    kinds = tuple(kinds[:n])
    if any(k not in KINDS for k in kinds) or len(kinds) != n:
        raise UnsupportedModelError(f"DeepSeek-V4 layer_types {kinds!r}: one of {KINDS} a layer")
    return kinds, rates


def _check_supported(raw: dict) -> None:
    """Refuse what the releases do not use: other routing scores, another SwiGLU clamp."""
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise UnsupportedModelError(
            f"DeepSeek-V4 routing with scoring_func {scoring!r} is not supported (its "
            "releases' sqrtsoftplus is)"
        )
    # The quantized releases (FP8 attention in e8m0-scaled blocks, FP4 experts with an e8m0
    # scale per 32 values, both under `X.scale`) are read by weights/quantized.py: the experts
    # kept as MXFP4, the rest dequantized at load.
    limit = float(raw.get("swiglu_limit", SWIGLU_CLAMP_LIMIT))
    if limit != SWIGLU_CLAMP_LIMIT:
        raise UnsupportedModelError(
            f"DeepSeek-V4 with swiglu_limit={limit}: only the released {SWIGLU_CLAMP_LIMIT} "
            "is supported"
        )


def _ropes(raw: dict) -> tuple[dict, dict]:
    """The rope parameters of the attention (`main`) and of the compressor (`compress`)."""
    rope = raw.get("rope_parameters") or {}
    if isinstance(rope.get("main"), dict) and isinstance(rope.get("compress"), dict):
        main, compress = rope["main"], rope["compress"]
    else:
        flat = {**(raw.get("rope_scaling") or {}), **rope}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", compress.get("type", "default"))
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress = {"attention_factor": 1.0, **compress}  # (V4 does not scale cos and sin)
    return main, compress


# The released checkpoint's names (DeepSeek's own: `layers.N.attn.wq_a`,
# `layers.N.ffn.experts.E.w1`, `embed`, `head`, `hc_head_fn`; transformers saves them under a
# `model.` prefix) to the common layout; what is V4's alone goes through `model.layers.N.own.`
# (family.py). The next-token-prediction layer (`mtp.*`) matches nothing: not read.
_L = r"^(?:model\.)?layers\.(\d+)\."
_V4 = r"model.layers.\1.own."
RENAMES = (
    (r"^(?:model\.)?embed\.", "model.embed_tokens."),
    (r"^embed_tokens\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^norm\.", "model.norm."),
    (r"^(?:model\.)?hc_head[._]hc_", "model.own.hc_head."),
    (r"^(?:model\.)?hc_head_", "model.own.hc_head."),
    (_L + r"attn_norm\.", r"model.layers.\1.input_layernorm."),
    (_L + r"ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (_L + r"hc_(attn|ffn)_(fn|base|scale)$", _V4 + r"\2_hc.\3"),
    (_L + r"attn\.attn_sink$", _V4 + "attn.sinks"),
    (_L + r"attn\.q_norm\.", _V4 + "attn.q_a_norm."),
    (_L + r"attn\.(?:kv_)?norm\.", _V4 + "attn.kv_norm."),  # (the release: kv_norm)
    (_L + r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.", _V4 + r"attn.\2."),
    (_L + r"attn\.compressor\.", _V4 + "attn.compressor."),
    (_L + r"attn\.indexer\.compressor\.", _V4 + "attn.indexer."),
    (_L + r"attn\.indexer\.(wq_b|weights_proj)\.", _V4 + r"attn.indexer.\2."),
    (_L + r"ffn\.gate\.tid2eid$", _V4 + "moe.tid2eid"),
    (_L + r"ffn\.gate\.bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (_L + r"ffn\.gate\.weight$", r"model.layers.\1.mlp.gate.weight"),
    (_L + r"ffn\.shared_experts\.w1\.", r"model.layers.\1.mlp.shared_experts.gate_proj."),
    (_L + r"ffn\.shared_experts\.w2\.", r"model.layers.\1.mlp.shared_experts.down_proj."),
    (_L + r"ffn\.shared_experts\.w3\.", r"model.layers.\1.mlp.shared_experts.up_proj."),
    (_L + r"ffn\.experts\.(\d+)\.w1\.", r"model.layers.\1.mlp.experts.\2.gate_proj."),
    (_L + r"ffn\.experts\.(\d+)\.w2\.", r"model.layers.\1.mlp.experts.\2.down_proj."),
    (_L + r"ffn\.experts\.(\d+)\.w3\.", r"model.layers.\1.mlp.experts.\2.up_proj."),
)

FAMILY = Family("deepseek_v4", ("DeepseekV4ForCausalLM",), parse_config, renames=RENAMES)
