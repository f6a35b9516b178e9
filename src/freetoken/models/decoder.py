"""The one decoder every family runs: embed -> N x (attention or linear attention, MLP or MoE)
-> norm -> logits; and, where read, the model's next-token-prediction (MTP) layer, which
drafts the token after next (`DecoderModel.mtp_forward`)."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import PagedKVCache
from freetoken.kv.recurrent import RecurrentStatePool
from freetoken.layers.attention import Attention
from freetoken.layers.compressed_attention import CompressedAttention, StepShared
from freetoken.layers.gated_deltanet import GatedDeltaNet
from freetoken.layers.hyper_connections import HyperConnection, HyperHead
from freetoken.layers.linear import Linear, linear
from freetoken.layers.mla import LatentAttention
from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import MoEBlock
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import RotaryEmbedding
from freetoken.model_config import ModelConfig
from freetoken.weights.expert_format import QuantizedWeight

# Whether a model on a GPU stacks its projections (`DecoderModel.stack_projections`): not until
# the CUDA tests have run it so. A GEMM over stacked rows may sum in another order than each
# alone (cuBLAS picks its kernel by the matrix's width), and there the bf16 greedy tokens are
# held equal to transformers', which multiplies each alone. benchmarks/ turn it on to time it.
STACK_ON_GPU = False


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        zc, fp32 = cfg.zero_centered_norm, cfg.norm_scale_fp32
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc, fp32)
        self.hyper = cfg.compressed is not None
        if self.hyper:  # (DeepSeek-V4: hyper-connected streams around each block)
            self.attn_hc = HyperConnection(cfg.compressed, cfg.hidden_size, cfg.rms_norm_eps)
            self.ffn_hc = HyperConnection(cfg.compressed, cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.linear_layers and cfg.linear_layers[layer]:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_layer_ids.index(layer))
        elif cfg.compressed is not None:
            self.attn = CompressedAttention(cfg, layer)
        elif cfg.mla is not None:
            self.attn = LatentAttention(cfg, layer)
        else:
            self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc, fp32)
        if cfg.moe_layers[layer]:
            self.moe = MoEBlock(cfg, cfg.moe_layer_ids.index(layer))
        else:
            self.mlp = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias
            )
        # (Gemma: the feed-forward's output normed before the residual add; Gemma-4: the
        # stream after the layer times a learned scalar)
        self.ffn_post_norm = None
        if cfg.sandwich_norms:
            self.ffn_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc, fp32)
        self.layer_scalar = None
        if cfg.layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(
        self,
        x,
        cos_sin,
        batch: ForwardBatch,
        kv: PagedKVCache,
        states: RecurrentStatePool | None,
        delta: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual stream, this layer's MLP or MoE output): the stream is x + delta (the
        previous layer's output, None for the first), and the output is added by the next
        norm that reads it, so every residual add rides in a norm's launch (`add_forward`).
        Hyper-connected layers (DeepSeek-V4) take and give their streams whole (delta None)."""
        if self.hyper:
            return self._hyper_forward(x, cos_sin, batch, kv), None
        x, h = self.attn_norm.add_forward(x, delta)
        if hasattr(self, "linear_attn"):
            a = self.linear_attn(h, batch, states)
        else:
            a = self.attn(h, cos_sin, batch, kv)
        x, h = self.mlp_norm.add_forward(x, a)
        out = self.moe(h, stream=x) if hasattr(self, "moe") else self.mlp(h)
        if self.ffn_post_norm is not None:
            out = self.ffn_post_norm(out)
        if self.layer_scalar is not None:  # (the sum is scaled: it cannot wait for the next norm)
            return (x + out) * self.layer_scalar, None
        return x, out

    def prefetch_experts(self, x, delta, batch: ForwardBatch) -> None:
        """Start this layer's expert prefetch (layers/moe.py `prefetch`) from the residual
        stream as the layer before left it (x + delta, or the hyper-connected streams): its
        router over its MLP norm, its attention skipped."""
        moe = getattr(self, "moe", None)
        if moe is None or moe.prefetch_from is None:
            return

        def predict_input():
            if self.hyper:
                return self.mlp_norm(self.ffn_hc(x)[2]), None
            stream = x if delta is None else x + delta
            return self.mlp_norm(stream), stream

        moe.prefetch(predict_input, (x,) if delta is None else (x, delta), batch.input_ids)

    def _hyper_forward(self, streams, angles, batch: ForwardBatch, kv: PagedKVCache):
        """The layer over hyper-connected streams [T, hc_mult, H] (layers/hyper_connections.py)."""
        post, comb, h = self.attn_hc(streams)
        out = self.attn(self.attn_norm(h), angles, batch, kv)
        streams = HyperConnection.merge(streams, post, comb, out)
        post, comb, h = self.ffn_hc(streams)
        h = self.mlp_norm(h)
        out = self.moe(h, batch.input_ids) if hasattr(self, "moe") else self.mlp(h)
        return HyperConnection.merge(streams, post, comb, out)


class NextTokenPredictor(nn.Module):
    """What an MTP layer has beside its decoder block (DeepSeek-V3's `enorm`, `hnorm`,
    `eh_proj` and `shared_head.norm`; Qwen3-Next's `pre_fc_norm_embedding`,
    `pre_fc_norm_hidden`, `fc` and `norm`): the block's input is eh_proj over
    [enorm(embedding of token i+1); hnorm(hidden state at i)], its output is normed for the
    shared output head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, norm = cfg.hidden_size, (cfg.rms_norm_eps, cfg.zero_centered_norm, cfg.norm_scale_fp32)
        self.enorm, self.hnorm, self.norm = RMSNorm(h, *norm), RMSNorm(h, *norm), RMSNorm(h, *norm)
        self.eh_proj = Linear(2 * h, h, bias=False)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # (weights are loaded, not drawn: nn.Embedding's random init would be wasted work, and
        # on the meta device its normal_ imports torch._dynamo, seconds of a start)
        self.embed = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        # (with MTP read, its decoder block is the last: layer `num_layers`)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.stack_layers))
        self.mtp = NextTokenPredictor(cfg) if cfg.mtp else None
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, cfg.zero_centered_norm, cfg.norm_scale_fp32
        )
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rope_head_dim)
        self._set_kind_rotaries(self._kind_rotaries())
        if cfg.compressed is not None:  # (DeepSeek-V4: the compressed branches' own RoPE)
            self.compress_rotary = RotaryEmbedding(cfg.compressed.compress_rope, cfg.head_dim)
            self.hc_head = HyperHead(cfg.compressed, cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def cast(self, dtype: torch.dtype) -> DecoderModel:
        """The model in `dtype`, but for what stays fp32 in any dtype, as transformers keeps
        it: a sigmoid router's weight and correction bias (MoEConfig.scoring), a sparse
        attention indexer's head weights (`indexer.weights_proj`)."""
        self.to(dtype)
        v4 = self.config.compressed is not None
        for module in self.modules():  # (DeepSeek-V4's hyper-connections, norms, sinks, `ape`)
            if isinstance(module, (HyperConnection, HyperHead)) or (
                v4 and isinstance(module, RMSNorm)
            ):
                module.float()
            if isinstance(module, CompressedAttention):
                module.sinks.data = module.sinks.data.float()
            if hasattr(module, "ape"):
                module.ape.data = module.ape.data.float()
            if isinstance(module, GatedDeltaNet) and module.kda:  # (KDA's per-channel bias)
                module.dt_bias.data = module.dt_bias.data.float()
        for layer in self.layers:
            moe = getattr(layer, "moe", None)
            if moe is not None and moe.correction_bias is not None:
                if moe.moe.scoring == "sigmoid":  # (V4's sqrtsoftplus router: model dtype)
                    moe.router.float()
                moe.correction_bias.data = moe.correction_bias.data.float()
            indexer = getattr(getattr(layer, "attn", None), "indexer", None)
            if indexer is not None and self.config.mla is not None:  # (DSA's; not V4's)
                indexer.weights_proj.float()
        return self

    @classmethod
    def empty(
        cls, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device
    ) -> DecoderModel:
        """The model in `dtype` on `device`, its parameters uninitialised (to be loaded)."""
        return cls.on_meta(cfg, dtype).materialize(device)

    @classmethod
    def on_meta(cls, cfg: ModelConfig, dtype: torch.dtype) -> DecoderModel:
        """The model's structure in `dtype` on the meta device: no memory, no computation."""
        with torch.device("meta"):
            return cls(cfg).cast(dtype)

    def materialize(self, device: str | torch.device) -> DecoderModel:
        """A meta model given uninitialised memory on `device` by torch.empty (nn.Module's
        to_empty calls empty_like, which runs a Python reference op per meta tensor: 0.85 s of
        a start on the H200 machine), and its RoPE table."""
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        self.reset_rotary()
        return self

    def _kind_rotaries(self) -> dict[tuple, RotaryEmbedding]:
        """Where attention layers differ in their heads (ModelConfig.layer_attention), a RoPE
        table for each kind, by (RoPE, head_dim); else none (every layer reads `rotary`)."""
        kinds = {(s.rope, s.head_dim) for s in self.config.layer_attention}
        return {kind: RotaryEmbedding(*kind) for kind in sorted(kinds, key=repr)}

    def _set_kind_rotaries(self, rotaries: dict[tuple, RotaryEmbedding]) -> None:
        # (submodules, so that moving the model moves their tables; keyed beside them)
        self.kind_rotary_modules = nn.ModuleList(rotaries.values())
        self.kind_keys = list(rotaries)

    @property
    def kind_rotaries(self) -> dict[tuple, RotaryEmbedding]:
        return dict(zip(self.kind_keys, self.kind_rotary_modules, strict=True))

    def reset_rotary(self) -> None:
        """Recompute the RoPE table in fp32 (after `empty`, or a dtype cast, clobbered it)."""
        self.rotary = RotaryEmbedding(self.config.rope, self.config.rope_head_dim).to(self.device)
        self._set_kind_rotaries({k: r.to(self.device) for k, r in self._kind_rotaries().items()})
        if self.config.compressed is not None:
            rope = self.config.compressed.compress_rope
            self.compress_rotary = RotaryEmbedding(rope, self.config.head_dim).to(self.device)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def lm_head_weight(self) -> torch.Tensor | QuantizedWeight:
        head = getattr(self, "lm_head", None)
        return self.embed.weight if head is None else head.computed_weight  # (None: tied)

    def head_from(self, weight: QuantizedWeight) -> None:
        """A tied model's output head computed from the embedding's quantized blocks (`weight`,
        the table's values) rather than the table (layers/linear.py)."""
        self.lm_head = Linear(
            self.config.hidden_size, self.config.vocab_size, bias=False, device="meta"
        )
        self.lm_head.keep_quantized(weight)

    def stack_projections(self, dense: bool | None = None) -> None:
        """Projections of one input (each attention's q, k and v, or an MLA, compressed or
        linear attention's projections of x; each MLP's gate and up) kept quantized in one
        format are computed as one weight from now on, and a dense MLP kept quantized as one
        CPU job (layers/linear.py's `stacked`, layers/mlp.py): one call where there were
        several, on the CPU each a handoff to the thread team. Dense weights stack with
        `dense`, by default on a GPU with STACK_ON_GPU (its comment says why not yet), where
        each was a launch. Not on the CPU: there a model's dense weights are views of its
        files' memory (a weight directory's read), which a stacked copy would hold twice for
        ~1% of a step."""
        if dense is None:
            dense = self.device.type != "cpu" and STACK_ON_GPU
        for module in self.modules():
            if isinstance(module, (Attention, LatentAttention, CompressedAttention, GatedDeltaNet)):
                module.stack_projections(dense)
            elif isinstance(module, GatedMLP):
                module.stack_projections(self.dtype, dense)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: PagedKVCache,
        all_logits: bool = False,
        states: RecurrentStatePool | None = None,
        hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits in fp32: [B, V] for each sequence's last new token, or [T, V] for every new
        token when `all_logits`. `states` holds the recurrent state of linear-attention
        layers (read and advanced in place). `hidden`: (logits, every new token's final hidden
        state [T, H], normed: what the output head reads), which an MTP layer drafts from."""
        cfg = self.config
        x = self.embed(batch.input_ids)
        if cfg.embed_scale is not None:  # (the scale rounded to the dtype first, as Gemma's)
            x = x * float(torch.tensor(cfg.embed_scale, dtype=x.dtype))
        if cfg.compressed is not None:  # (each layer turns what it needs)
            cos_sin = StepShared(self.rotary, self.compress_rotary, batch.positions, x.dtype)
            x = x.unsqueeze(1).expand(-1, cfg.compressed.hc_mult, -1).contiguous()
        else:
            cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        kinds = {k: r.cos_sin(batch.positions, x.dtype) for k, r in self.kind_rotaries.items()}
        delta = None
        layers = list(itertools.islice(self.layers, cfg.num_layers))
        for i, layer in enumerate(layers):
            if kinds:
                shape = cfg.layer_attention[i]
                cos_sin = kinds[(shape.rope, shape.head_dim)]
            x, delta = layer(x, cos_sin, batch, kv, states, delta)
            if i + 1 < len(layers):  # (while the next layer's attention runs)
                layers[i + 1].prefetch_experts(x, delta, batch)
        if cfg.compressed is not None:
            x = self.hc_head(x)
        if hidden:
            normed = self.norm.add_forward(x, delta)[1]
            return self._logits(normed if all_logits else normed[batch.last_index]), normed
        if not all_logits:
            x = x[batch.last_index]
            delta = None if delta is None else delta[batch.last_index]
        return self._logits(self.norm.add_forward(x, delta)[1])

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The output head over final hidden states, in fp32."""
        logits = linear(normed, self.lm_head_weight())
        cfg = self.config
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.inference_mode()
    def mtp_forward(
        self, batch: ForwardBatch, kv: PagedKVCache, hidden: torch.Tensor, all_logits=False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over the batch: new token j is token i+1 of its sequence at position
        i, `hidden[j]` the final hidden state at i (normed, `forward(hidden=True)`); its block
        attends over its own K/V of the positions before (layer `num_layers` of the cache).
        -> (fp32 logits of token i+2, [B, V] at each sequence's last new token or [T, V] for
        all; the layer's hidden states there, normed: fed back as `hidden` to draft on)."""
        mtp, cfg = self.mtp, self.config
        e = mtp.enorm(self.embed(batch.input_ids))
        x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden.to(e.dtype))], dim=-1))
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        x, delta = self.layers[cfg.num_layers](x, cos_sin, batch, kv, None)
        if not all_logits:
            x = x[batch.last_index]
            delta = None if delta is None else delta[batch.last_index]
        normed = mtp.norm.add_forward(x, delta)[1]
        return self._logits(normed), normed
