"""Grouped-query attention over the paged KV cache (RoPE, optional qk-norm, clipping,
biases, sliding window, output gate and sinks, values read from the key projection and
normed, an output norm: every variant our families use, in one module)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.kernels.paged_attention import paged_attention
from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import PagedKVCache
from freetoken.layers.linear import Linear, outputs, stacked
from freetoken.layers.norm import RMSNorm, rms_normalize
from freetoken.layers.rope import apply_rotary
from freetoken.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        shape = cfg.attention_shape(layer)  # (Gemma-4: by the layer's kind)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
        )
        q_dim, kv_dim = cfg.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # With an output gate, q_proj yields each head's query then its gate, head by head.
        self.output_gate = cfg.attn_output_gate
        q_out = 2 * q_dim if self.output_gate else q_dim
        self.q_proj = Linear(cfg.hidden_size, q_out, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        # (Gemma-4's full layers: the values are the key projection's output, no v_proj)
        self.v_proj = (
            None if shape.values_from_keys else Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        )
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        zc, fp32, eps = cfg.zero_centered_norm, cfg.norm_scale_fp32, cfg.rms_norm_eps
        if cfg.qk_norm == "per_head":  # Qwen3: one norm over each head's vector
            self.q_norm = RMSNorm(self.head_dim, eps, zc, fp32)
            self.k_norm = RMSNorm(self.head_dim, eps, zc, fp32)
        elif cfg.qk_norm == "full":  # OLMoE: one norm over all heads at once
            self.q_norm = RMSNorm(q_dim, eps, zc, fp32)
            self.k_norm = RMSNorm(kv_dim, eps, zc, fp32)
        self.v_norm_eps = eps if cfg.v_norm else None
        self.post_norm = RMSNorm(cfg.hidden_size, eps, zc, fp32) if cfg.sandwich_norms else None
        self.clip_qkv = cfg.clip_qkv
        sliding = cfg.sliding_layers[layer] if cfg.sliding_layers else False
        self.window = cfg.sliding_window if sliding else None
        self.scale = self.head_dim**-0.5 if cfg.attn_scale is None else cfg.attn_scale
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attn_sinks else None
        self.qkv_proj: Linear | None = None  # q, k and v as one, once stacked

    def stack_projections(self, dense: bool) -> None:
        """q, k and v kept quantized in one format (or, with `dense`, dense in one dtype) are
        computed as one weight from now on (layers/linear.py's `stacked`)."""
        if self.v_proj is not None:
            self.qkv_proj = stacked(self.q_proj, self.k_proj, self.v_proj, dense=dense)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.v_proj is None:  # (k is v)
            q, k = self.q_proj(x), self.k_proj(x)
            v = k
        else:
            q, k, v = outputs(x, (self.q_proj, self.k_proj, self.v_proj), self.qkv_proj)
        gate = None
        if self.output_gate:
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(t, -1), gate.reshape(t, -1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm_eps is not None:
            v = rms_normalize(v, self.v_norm_eps)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        kv.write(self.layer, batch.write_slots, k, v)
        out = paged_attention(
            q, kv.k[self.layer], kv.v[self.layer], batch, self.scale, self.window, self.sinks
        )
        out = out.reshape(t, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        out = self.o_proj(out)
        return out if self.post_norm is None else self.post_norm(out)
