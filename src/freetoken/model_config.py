"""One normalized model configuration for every family.

Hugging Face configs spell the same idea many ways (``num_experts`` vs ``num_local_experts``,
``rope_theta`` + ``rope_scaling`` in transformers 4 vs ``rope_parameters`` in 5). Family modules
read the raw ``config.json`` dict into a :class:`ModelConfig`; nothing past this point looks at
the raw dict again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from freetoken.errors import UnsupportedModelError

QKNorm = Literal["none", "per_head", "full"]


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # default | linear | llama3 | yarn | proportional
    factor: float = 1.0
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; derived from factor when absent
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert
    # Mixtral scales expert outputs by fp32 gate weights; the Qwen families and OLMoE round
    # the weights to the activation dtype first. Matters for bf16 exactness only.
    fp32_gate_weights: bool = False
    # How the router scores experts: "softmax" over the logits (Qwen, Mixtral, OLMoE), or
    # "sigmoid" (GLM-4.5, DeepSeek-V3): experts chosen by sigmoid + a learned correction bias,
    # within the `topk_groups` best of `num_groups` groups (a group scored by its two best),
    # weighted by their sigmoid, normalised if norm_topk_prob, times `routed_scaling`; the
    # router then runs in fp32 (its weight and bias kept fp32 in any model dtype).
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    # gpt-oss: every expert's projections have biases (the gate/up bias lives with the expert
    # in the host pool, moe/store.py; the down bias with the block, layers/moe.py), and the
    # router has a bias too.
    expert_bias: bool = False
    router_bias: bool = False
    # DeepSeek-V4: "sqrtsoftplus" scoring (layers/moe.py), and per MoE layer whether it routes
    # by the token's id (`tid2eid`) instead of by score
    hash_layers: tuple[bool, ...] = ()
    # Gemma-4: the router reads the residual stream RMS-normalised without a weight, times a
    # learned `router_scale` per channel and 1/sqrt(hidden); the chosen (renormalised) weights
    # are then times a learned `per_expert_scale` (layers/moe.py)
    scaled_router: bool = False


@dataclass(frozen=True)
class AttentionShape:
    """A softmax-attention layer's heads where a model's layers differ (Gemma-4: its full
    layers have wider heads, fewer KV heads and their own RoPE, and read their values from
    the key projection: `values_from_keys`)."""

    head_dim: int
    num_kv_heads: int
    rope: RopeConfig
    values_from_keys: bool = False


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet linear attention (Qwen3-Next), or Kimi Delta Attention (`kda`): its
    heads and its short causal conv."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each q/k head serves a group of v heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int  # width of the depthwise causal conv over q, k and v
    # Qwen3.5: q, k, v, z, b and a from four projections in head order (in_proj_qkv, _z, _b,
    # _a); Qwen3-Next: two (in_proj_qkvz, in_proj_ba), laid out by key-head group
    separate_projections: bool = False
    # Kimi-Linear's KDA: the same delta rule with a decay per key channel (low-rank f_a/f_b
    # projections) instead of one per head, q/k/v from three projections through three convs,
    # and a low-rank output gate through a sigmoid (layers/gated_deltanet.py)
    kda: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim  # q, k and v go through the conv together


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a Lightning Indexer scores every
    cached token for each query (`n_heads` ReLU'd dot products of `head_dim` wide heads,
    weighted per query) and attention reads only the `topk` best. Its key, one `head_dim`
    vector a token, lives in the paged cache after the latent (layers/mla.py). `full[i]`:
    layer i runs its own indexer; False ("shared", GLM-5): it reuses the last full layer's
    selection."""

    n_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool  # the indexer's RoPE dims in pairs (GLM-5) or halves (V3.2)
    full: tuple[bool, ...]


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from a shared latent of
    `kv_lora_rank` values per token (and a `qk_rope_head_dim` key part that carries RoPE);
    the cache keeps only those."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj; else q_a_proj -> norm -> q_b_proj
    rope_interleave: bool = True  # the rope dims in pairs (x0, x1), (x2, x3), ...
    # False (Kimi-Linear): no RoPE at all; the k_pe part is cached and read as it comes
    rope: bool = True
    indexer: IndexerConfig | None = None  # sparse attention (DSA)

    @property
    def latent_dim(self) -> int:
        """kv_a_proj_with_mqa's output: the latent and the RoPE key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values a token and layer in the cache: the latent, the RoPE key part and, under
        DSA, the indexer's key."""
        return self.latent_dim + (self.indexer.head_dim if self.indexer else 0)


@dataclass(frozen=True)
class CompressedAttentionConfig:
    """DeepSeek-V4's attention (layers/compressed_attention.py): per layer one of
    "sliding_attention", "compressed_sparse_attention" (a compressor pooling every `csa_ratio`
    tokens, its Lightning Indexer choosing `index_topk` pooled entries a query) or
    "heavily_compressed_attention" (pooling every `hca_ratio`), each beside a sliding window of
    `ModelConfig.sliding_window` tokens; one shared K=V head of `head_dim`, RoPE on its last
    `rope_dim` values, interleaved; a grouped output projection; `hc_mult` residual streams
    mixed by Manifold-Constrained Hyper-Connections; hash-routed MoE layers (`hash_layers`)."""

    layer_kinds: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope: RopeConfig
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hash_layers: tuple[bool, ...]

    def ratio(self, layer: int) -> int:
        """Tokens pooled into one compressed entry in `layer` (0: sliding only)."""
        kind = self.layer_kinds[layer]
        if kind == "compressed_sparse_attention":
            return self.csa_ratio
        return self.hca_ratio if kind == "heavily_compressed_attention" else 0

    def row_layout(self, layer: int, head_dim: int) -> dict[str, slice]:
        """What one token's row of the layer's cache pool holds, by name (see
        layers/compressed_attention.py): its K=V, and for a compressing layer its pooled
        projections and gate logits (and the indexer's), then the entry of the window it
        closes (and the indexer's). What a token's forward writes leads the row, so one copy
        writes it; the entries are written apart, where a window closes."""
        kind, parts = self.layer_kinds[layer], [("kv", head_dim)]
        if kind != "sliding_attention":
            overlap = 2 if kind == "compressed_sparse_attention" else 1
            parts += [("ckv", overlap * head_dim), ("cgate", overlap * head_dim)]
            if kind == "compressed_sparse_attention":
                d = self.index_head_dim
                parts += [("ikv", 2 * d), ("igate", 2 * d), ("centry", head_dim), ("ientry", d)]
            else:
                parts.append(("centry", head_dim))
        out, at = {}, 0
        for name, width in parts:
            out[name] = slice(at, at + width)
            at += width
        return out


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers only)
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: QKNorm = "none"
    clip_qkv: float | None = None
    sliding_window: int | None = None
    # Per layer: True where the layer's MLP is a sparse MoE block, False for a dense MLP.
    moe_layers: tuple[bool, ...] = ()
    # Per layer: True where attention uses the sliding window.
    sliding_layers: tuple[bool, ...] = ()
    moe: MoEConfig | None = None
    # Per layer: True where the token mixer is linear attention instead of softmax attention.
    linear_layers: tuple[bool, ...] = ()
    linear_attention: LinearAttentionConfig | None = None
    # Qwen3-Next: q_proj also yields a per-channel gate; attention output *= sigmoid(gate).
    attn_output_gate: bool = False
    # gpt-oss: a learned logit per head that joins each softmax and takes no value ("sink").
    attn_sinks: bool = False
    # Qwen3-Next stores RMSNorm weights zero-centered: the scale applied is 1 + weight.
    zero_centered_norm: bool = False
    # gpt-oss scales its RMSNorms in fp32 before the cast back (Llama: after); matters in bf16
    norm_scale_fp32: bool = False
    # Per layer, where attention layers differ in their heads (Gemma-4's sliding and full
    # layers); empty: every layer has `head_dim`, `num_kv_heads` and `rope` (attention_shape)
    layer_attention: tuple[AttentionShape, ...] = ()
    attn_scale: float | None = None  # the softmax's scale; None: 1/sqrt(head_dim)
    # Gemma-4: values RMS-normalised per head, without a weight
    v_norm: bool = False
    # Gemma: attention's output and the feed-forward's normed before each residual add (their
    # `post_*_layernorm`); in a MoE layer the dense MLP's and the routed experts' outputs each
    # normed before their sum, the experts reading the residual stream through their own norm
    sandwich_norms: bool = False
    # Gemma-4: a learned scalar per layer multiplying the residual stream after the layer
    layer_scalar: bool = False
    embed_scale: float | None = None  # Gemma: embeddings times this (rounded to the dtype)
    final_logit_softcapping: float | None = None  # Gemma: logits = cap * tanh(logits / cap)
    mla: MLAConfig | None = None  # attention is multi-head latent attention (DeepSeek)
    compressed: CompressedAttentionConfig | None = None  # DeepSeek-V4's attention
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    # Next-token-prediction (MTP) layers the checkpoint ships and its family's layout reads
    # (`num_nextn_predict_layers`, `mtp_num_hidden_layers`); `mtp`: the model holds the first,
    # as layer `num_layers` (its decoder block) and `DecoderModel.mtp` (with_mtp)
    mtp_layers: int = 0
    mtp: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def stack_layers(self) -> int:
        """Decoder blocks the model holds: its layers, and the MTP layer's block where read."""
        return self.num_layers + self.mtp

    def with_mtp(self) -> ModelConfig:
        """This config with its MTP layer's block as one more layer (`num_layers` stays the
        main model's): full softmax attention with its own K/V in the paged cache, MoE where
        the model's layers are, a full indexer under DSA."""
        if self.mtp:
            return self
        if self.mtp_layers < 1 or self.compressed is not None or self.layer_attention:
            raise UnsupportedModelError(f"{self.family}: no next-token-prediction layer read")
        mla = self.mla
        if mla is not None and mla.indexer is not None:
            full = (*mla.indexer.full, True)
            mla = replace(mla, indexer=replace(mla.indexer, full=full))
        return replace(
            self,
            mtp=True,
            moe_layers=(*self.moe_layers, self.moe is not None),
            sliding_layers=(*self.sliding_layers, False) if self.sliding_layers else (),
            linear_layers=(*self.linear_layers, False) if self.linear_layers else (),
            mla=mla,
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.linear_layers) if m)

    @property
    def attention_layers(self) -> tuple[bool, ...]:
        """Per layer: True where the layer keeps K/V in the paged cache."""
        linear = self.linear_layers or (False,) * self.stack_layers
        return tuple(not m for m in linear)

    def attention_shape(self, layer: int) -> AttentionShape:
        """The heads of softmax-attention layer `layer`."""
        if self.layer_attention:
            return self.layer_attention[layer]
        return AttentionShape(self.head_dim, self.num_kv_heads, self.rope)

    @property
    def kv_cache_heads(self) -> int:
        """Heads of K (and V) the paged cache keeps per token and layer (the most of any
        layer, where they differ: kv_layer_heads)."""
        if self.layer_attention:
            return max(s.num_kv_heads for s in self.layer_attention)
        return 1 if self.mla or self.compressed else self.num_kv_heads

    @property
    def kv_layer_heads(self) -> tuple[int, ...] | None:
        """Per layer, the heads of its cache pool where layers differ; None: kv_cache_heads."""
        return tuple(s.num_kv_heads for s in self.layer_attention) or None

    @property
    def kv_layer_dims(self) -> tuple[int, ...] | None:
        """Per layer, the width of a token's row of its cache pool, where layers differ
        (DeepSeek-V4: CompressedAttentionConfig.row_layout; Gemma-4: each layer's head_dim);
        None: kv_cache_dim for all."""
        if self.layer_attention:
            return tuple(s.head_dim for s in self.layer_attention)
        c = self.compressed
        if c is None:
            return None
        return tuple(
            max(s.stop for s in c.row_layout(i, self.head_dim).values())
            for i in range(self.num_layers)
        )

    @property
    def kv_cache_dim(self) -> int:
        """Values per cached head: the latent and the RoPE key part under MLA."""
        if self.compressed or self.layer_attention:
            return max(self.kv_layer_dims or (0,))
        return self.mla.cache_dim if self.mla else self.head_dim

    @property
    def rope_head_dim(self) -> int:
        """The head width RoPE is laid out for (before `partial_rotary_factor`)."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def has_recurrent_state(self) -> bool:
        """Whether some layer carries a recurrent state (which a KV prefix cannot restore)."""
        return any(self.linear_layers)


def _first(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return default


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings in either the transformers 4 or 5 spelling."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = _first(params, "rope_theta", default=_first(raw, "rope_theta", default=10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    original_max = _first(
        raw,
        "original_max_position_embeddings",
        default=params.get("original_max_position_embeddings"),
    )
    if original_max is None and rope_type in ("llama3", "yarn"):
        original_max = raw.get("max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor") or 1.0),
        partial_rotary_factor=float(
            _first(params, "partial_rotary_factor", default=raw.get("partial_rotary_factor", 1.0))
        ),
        original_max_position_embeddings=original_max,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def decoder_config(
    raw: dict[str, Any],
    family: str,
    *,
    moe: MoEConfig | None = None,
    moe_layers: tuple[bool, ...] | None = None,
    sliding: bool = False,
    **overrides: Any,
) -> ModelConfig:
    """Build a ModelConfig from the fields every decoder-only family spells the same way.

    `moe_layers` defaults to every layer when `moe` is given; `sliding` says whether the
    family's config turns the sliding window on (`layer_types`, when present, decides per layer).
    """
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    num_layers = int(raw["num_hidden_layers"])
    attention_bias = bool(raw.get("attention_bias", False))
    if moe_layers is None:
        moe_layers = (moe is not None,) * num_layers
    sliding_layers = sliding_pattern(raw, num_layers, sliding)
    fields: dict[str, Any] = dict(
        architecture=raw["architectures"][0],
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(_first(raw, "num_key_value_heads", default=heads)),
        head_dim=int(_first(raw, "head_dim", default=hidden // heads)),
        intermediate_size=int(_first(raw, "intermediate_size", default=0)),
        rms_norm_eps=float(_first(raw, "rms_norm_eps", default=1e-6)),
        rope=parse_rope(raw),
        max_position_embeddings=int(_first(raw, "max_position_embeddings", default=4096)),
        hidden_act=str(_first(raw, "hidden_act", default="silu")),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=int(raw["sliding_window"]) if any(sliding_layers) else None,
        moe_layers=moe_layers,
        sliding_layers=sliding_layers,
        moe=moe if any(moe_layers) else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=as_id_tuple(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        torch_dtype=str(_first(raw, "dtype", "torch_dtype", default="float32")),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def routed_experts(
    raw: dict[str, Any],
    *,
    intermediate_key: str = "moe_intermediate_size",
    norm_topk_prob: bool | None = None,
    shared_expert_gated: bool = False,
    fp32_gate_weights: bool = False,
    **fields: Any,
) -> MoEConfig:
    """The routed-expert settings, in the spellings of Qwen, Mixtral, OLMoE and GLM configs;
    `fields`: other MoEConfig fields the family sets."""
    shared = raw.get("shared_expert_intermediate_size")
    if shared is None and raw.get("n_shared_experts"):  # GLM, DeepSeek: n experts' width
        shared = int(raw["n_shared_experts"]) * int(raw[intermediate_key])
    return MoEConfig(
        num_experts=int(_first(raw, "num_experts", "num_local_experts", "n_routed_experts")),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw[intermediate_key]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False))
        if norm_topk_prob is None
        else norm_topk_prob,
        shared_expert_intermediate_size=int(shared or 0),
        shared_expert_gated=shared_expert_gated,
        fp32_gate_weights=fp32_gate_weights,
        **fields,
    )


def sigmoid_routed_experts(
    raw: dict[str, Any], *, groups: int = 1, topk_groups: int = 1, scaling: float = 1.0
) -> MoEConfig:
    """GLM's and DeepSeek's routed experts: sigmoid scoring with a correction bias within the
    best `topk_group` of `n_group` groups, times `routed_scaling_factor`, fp32 gate weights;
    the keyword arguments are the family's defaults for keys its config may omit."""
    return routed_experts(
        raw,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        fp32_gate_weights=True,
        scoring="sigmoid",
        num_groups=int(raw.get("n_group", groups)),
        topk_groups=int(raw.get("topk_group", topk_groups)),
        routed_scaling=float(raw.get("routed_scaling_factor", scaling)),
    )


def leading_dense_pattern(raw: dict[str, Any], default: int) -> tuple[bool, ...]:
    """MoE layers after the first `first_k_dense_replace` dense ones (GLM, DeepSeek)."""
    dense = int(raw.get("first_k_dense_replace", default))
    return tuple(i >= dense for i in range(int(raw["num_hidden_layers"])))


def sparse_layer_pattern(raw: dict[str, Any]) -> tuple[bool, ...]:
    """Qwen-style placement of MoE layers: every `decoder_sparse_step`-th layer, minus
    `mlp_only_layers`."""
    num_layers = int(raw["num_hidden_layers"])
    step = int(_first(raw, "decoder_sparse_step", default=1))
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))


def sliding_pattern(raw: dict[str, Any], num_layers: int, default: bool) -> tuple[bool, ...]:
    """Which layers use sliding-window attention.

    transformers 5 writes the answer as `layer_types`; older configs only say whether the
    window is on (`default`, decided by the family from `sliding_window`/`use_sliding_window`).
    """
    types = raw.get("layer_types")
    if types:
        return tuple(t == "sliding_attention" for t in types)
    return (default and bool(raw.get("sliding_window")),) * num_layers


def linear_attention_pattern(raw: dict[str, Any], default_interval: int) -> tuple[bool, ...]:
    """Which layers are linear attention: `layer_types` when the config spells it out, else
    every layer but each `full_attention_interval`-th (the Qwen3-Next default is 4)."""
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types:
        return tuple(t == "linear_attention" for t in types)
    interval = int(_first(raw, "full_attention_interval", default=default_interval))
    return tuple((i + 1) % interval != 0 for i in range(num_layers))
