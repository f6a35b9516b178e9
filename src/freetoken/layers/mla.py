"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache.

Each token's keys and values come from one shared latent: `kv_a_proj_with_mqa(x)` gives the
latent c [r] (normalised) and a key part k_pe [d_rope] that carries RoPE; per head,
kv_b_proj expands c into the key's other part (W_UK c, d_nope values) and the value (W_UV c).
The cache keeps only [c, k_pe] per token and layer (r + d_rope values, one "head", read as
both keys and values: `PagedKVCache(values_are_keys=True)`), and attention never expands it:

    q_lat  = q_nope . W_UK            per head, [r]: the query moved into the latent's space
    score  = q_lat . c + q_pe . k_pe  = the query against [c, k_pe] in one dot product
    out    = sum_s p_s [c_s, k_pe_s]  over the cached tokens; its first r values are sum p c
    o      = W_UV . out[:r]           per head, [d_v], then o_proj

which is the same sum as attending over the expanded keys and values (only the order of the
floating-point operations differs). Decode takes that absorbed form: the paged kernels run it as
grouped-query attention with one KV head, reading r + d_rope values a cached token. A prompt
takes the expanded form instead (as llama.cpp and FlashMLA do): its context's cached latents
expanded once into per-head keys [W_UK c, k_pe] and values W_UV c, then ordinary causal
attention of d_nope + d_rope wide heads, a third of the absorbed form's arithmetic for
DeepSeek-V3 (192 + 128 against 576 + 512 values a query and key) over queries that outnumber
the cached tokens they expand.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from freetoken.kernels.paged_attention import (
    causal_attention,
    paged_attention,
    sequence_slots,
)
from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import PagedKVCache
from freetoken.layers.linear import Linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import apply_rotary
from freetoken.model_config import ModelConfig


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d_nope + d_rope), times YaRN's mscale(factor, mscale_all_dim)^2 where the config
    scales RoPE that way (DeepSeek-V3's long-context setting)."""
    mla, rope = cfg.mla, cfg.rope
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.type == "yarn" and rope.mscale_all_dim and rope.factor > 1:
        scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
    return scale


class LatentAttention(nn.Module):
    """Parameter names follow the DeepSeek checkpoints."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.layer, self.num_heads, self.mla = layer, cfg.num_heads, mla
        h, heads = cfg.hidden_size, cfg.num_heads
        q_dim = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, q_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(mla.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, mla.cache_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * mla.v_head_dim, h, bias=cfg.o_bias)
        self.scale = softmax_scale(cfg)

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        # DeepSeek pairs the rope dims as (x0, x1), (x2, x3), ...: laid out as (evens, odds)
        # the pairs are (i, i + d/2), the rotate-half form. Queries and cached keys both get
        # that order, so their dot products are unchanged.
        if self.mla.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        t, heads, mla = x.shape[0], self.num_heads, self.mla
        nope, r = mla.qk_nope_head_dim, mla.kv_lora_rank
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, heads, nope + mla.qk_rope_head_dim)
        q_nope, q_pe = q.split([nope, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = cos_sin
        q_pe, k_pe = self._rope(q_pe, cos, sin), self._rope(k_pe.view(t, 1, -1), cos, sin)
        w = self.kv_b_proj.weight.view(heads, nope + mla.v_head_dim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        cached = torch.cat([latent.view(t, 1, r), k_pe], dim=-1)  # [T, 1, r + d_rope]
        kv.write(self.layer, batch.write_slots, cached, None)
        pool = kv.k[self.layer]
        if batch.is_decode:
            q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
            out = paged_attention(torch.cat([q_lat, q_pe], dim=-1), pool, pool, batch,
                                  self.scale, values=r)  # fmt: skip
            out = torch.einsum("thr,hvr->thv", out[..., :r], w_uv)
        else:
            out = self._expanded(torch.cat([q_nope, q_pe], dim=-1), pool, batch, w_uk, w_uv)
        return self.o_proj(out.reshape(t, heads * mla.v_head_dim))

    def _expanded(self, q, pool, batch: ForwardBatch, w_uk, w_uv) -> torch.Tensor:
        """Prefill: each sequence's cached context (its new tokens written already) expanded
        into per-head keys and values; q [T, heads, d_nope + d_rope] -> [T, heads, d_v]."""
        r = self.mla.kv_lora_rank
        out = q.new_empty(q.shape[0], self.num_heads, self.mla.v_head_dim)
        for b, (start, count) in enumerate(zip(batch.starts, batch.counts, strict=True)):
            context = pool.index_select(0, sequence_slots(batch, b))[:, 0]  # [L, r + d_rope]
            latent, k_pe = context[:, :r], context[:, r:]
            keys = torch.cat([torch.einsum("lr,hnr->hln", latent, w_uk),
                              k_pe[None].expand(self.num_heads, -1, -1)], dim=-1)  # fmt: skip
            values = torch.einsum("lr,hvr->hlv", latent, w_uv)
            queries = q[start : start + count].transpose(0, 1)  # [heads, n, d]
            o = causal_attention(queries[None], keys[None], values[None], self.scale)
            out[start : start + count] = o[0].transpose(0, 1)
        return out
