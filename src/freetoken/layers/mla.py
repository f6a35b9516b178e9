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

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5: `MLAConfig.indexer`) adds a Lightning Indexer:
its own key per token (`wk`, LayerNorm, RoPE on the first d_rope values), `head_dim` wide, kept
in the same page slot after [c, k_pe]; per query, n_heads ReLU'd dot products against every
cached token's index key, weighted per head by `weights_proj(x)`, pick the `topk` best earlier
tokens, and attention reads only those (a prompt: the expanded form under that mask; decode:
the absorbed form over the top-k slots gathered from the pages). A "shared" layer (GLM-5) has
no indexer and reuses the last full layer's choice, which the forward's batch carries
(`ForwardBatch.index_selection`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from freetoken.kernels import lightning_index
from freetoken.kernels.paged_attention import (
    causal_attention,
    paged_attention,
    sequence_slots,
)
from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import PagedKVCache
from freetoken.layers.concurrent import Beside, beside
from freetoken.layers.linear import Linear, outputs, stacked
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import apply_rotary
from freetoken.model_config import IndexerConfig, ModelConfig

# transformers builds MLA's q_a and kv_a RMSNorms with their default eps, not the config's
MLA_NORM_EPS = 1e-6
# The most fp32 index scores a prompt chunk holds at once ([queries, heads, keys]): 256 MiB
SCORE_ELEMENTS = 1 << 26


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d_nope + d_rope), times YaRN's mscale(factor, mscale_all_dim)^2 where the config
    scales RoPE that way (DeepSeek-V3's long-context setting)."""
    mla, rope = cfg.mla, cfg.rope
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.type == "yarn" and rope.mscale_all_dim and rope.factor > 1:
        scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
    return scale


class Indexer(nn.Module):
    """DSA's Lightning Indexer (parameter names as the checkpoints store them)."""

    def __init__(self, cfg: ModelConfig, idx: IndexerConfig):
        super().__init__()
        mla = cfg.mla
        assert mla is not None and mla.q_lora_rank is not None, "the indexer reads q_a's output"
        self.idx, self.rope_dim = idx, mla.qk_rope_head_dim
        self.wq_b = Linear(mla.q_lora_rank, idx.n_heads * idx.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, idx.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(idx.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, idx.n_heads, bias=False)  # kept fp32

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rotary(x, cos, sin, pairs_first=self.idx.rope_interleave)

    def keys(self, wk_x: torch.Tensor, cos, sin) -> torch.Tensor:
        """Each new token's index key from `wk(x)` [T, head_dim], as cached."""
        k = self.k_norm(wk_x)
        return self._rope(k[:, None], cos, sin)[:, 0]

    def queries(self, x, q_resid, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, n_heads, head_dim] in fp32, and each head's weight [T, n_heads] (fp32, times
        n_heads^-0.5 and the dot products' scale head_dim^-0.5, which ReLU lets in after)."""
        t, idx = x.shape[0], self.idx
        q = self._rope(self.wq_b(q_resid).view(t, idx.n_heads, idx.head_dim), cos, sin)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float()
        return q.float(), w * idx.n_heads**-0.5

    def scores(self, q, w, keys) -> torch.Tensor:
        """q [..., n, heads, d], w [..., n, heads], keys [..., L, d] -> [..., n, L] (fp32)."""
        s = torch.relu(
            torch.einsum("...nhd,...ld->...nhl", q, keys.float()) * self.idx.head_dim**-0.5
        )
        return torch.einsum("...nh,...nhl->...nl", w, s)


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
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, mla.latent_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * mla.v_head_dim, h, bias=cfg.o_bias)
        self.scale = softmax_scale(cfg)
        idx = mla.indexer
        if idx is not None and idx.full[layer]:
            self.indexer = Indexer(cfg, idx)
        # The layers that read x, in the order `forward` takes their outputs: q's (or its
        # down projection), the latent's, the indexer's keys'; and them as one, once stacked.
        q = self.q_proj if mla.q_lora_rank is None else self.q_a_proj
        indexer = getattr(self, "indexer", None)
        self.of_x = (q, self.kv_a_proj_with_mqa) + ((indexer.wk,) if indexer is not None else ())
        self.x_proj: Linear | None = None

    def stack_projections(self, dense: bool) -> None:
        """The projections of x computed as one weight from now on (layers/linear.py's
        `stacked`; dense weights too with `dense`): one GEMM of a decode step where there
        were two or three."""
        self.x_proj = stacked(*self.of_x, dense=dense)

    def _rope(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        # (DeepSeek's interleaved pairs laid out as rotate-half's: layers/rope.py)
        return apply_rotary(x, cos, sin, pairs_first=self.mla.rope_interleave)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        t, heads, mla = x.shape[0], self.num_heads, self.mla
        nope, r = mla.qk_nope_head_dim, mla.kv_lora_rank
        cos, sin = cos_sin
        if self.x_proj is None:
            # the cache row's projections beside the queries' chain (layers/concurrent.py)
            of_row = self.of_x[1:]
            cached = beside(lambda x: self._cached([layer(x) for layer in of_row], cos, sin), x)
            q = self.of_x[0](x)
        else:
            q, *projected = outputs(x, self.of_x, self.x_proj)
            cached = Beside(self._cached(projected, cos, sin))
        q_resid = None
        if mla.q_lora_rank is not None:
            q_resid = self.q_a_layernorm(q)
            q = self.q_b_proj(q_resid)
        q = q.view(t, heads, nope + mla.qk_rope_head_dim)
        q_nope, q_pe = q.split([nope, mla.qk_rope_head_dim], dim=-1)
        if mla.rope:  # (Kimi-Linear's MLA has none: position comes from its KDA layers)
            q_pe = self._rope(q_pe, cos, sin)
        w = self.kv_b_proj.weight.view(heads, nope + mla.v_head_dim, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        indexer = getattr(self, "indexer", None)
        kv.write(self.layer, batch.write_slots, cached.result(), None)
        pool = kv.k[self.layer]
        if indexer is not None:
            batch.index_selection = self._select(indexer, x, q_resid, cos, sin, pool, batch)
        selection = None if mla.indexer is None else batch.index_selection
        if mla.indexer is not None and selection is None:
            raise ValueError(f"layer {self.layer} shares the top-k of no earlier layer")
        if batch.is_decode and selection is not None:
            out = self._sparse_decode(
                torch.cat([q_nope, q_pe], dim=-1), pool, selection, w_uk, w_uv
            )
        elif batch.is_decode:
            q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
            out = paged_attention(
                torch.cat([q_lat, q_pe], dim=-1), pool, pool, batch, self.scale, values=r
            )
            out = torch.einsum("thr,hvr->thv", out[..., :r], w_uv)
        else:
            out = self._expanded(
                torch.cat([q_nope, q_pe], dim=-1), pool, batch, w_uk, w_uv, selection
            )
        return self.o_proj(out.reshape(t, heads * mla.v_head_dim))

    def _cached(self, projected: list[torch.Tensor], cos, sin) -> torch.Tensor:
        """A token's cache row [T, 1, r + d_rope (+ the index key's)] from the projections of
        x after q's: the normed latent, the turned rope key, and with an indexer the index
        key (zeros in a layer that keeps none)."""
        mla, (kv_a, *index_x) = self.mla, projected
        t, r = kv_a.shape[0], mla.kv_lora_rank
        latent, k_pe = kv_a.split([r, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_pe = k_pe.view(t, 1, -1)
        if mla.rope:
            k_pe = self._rope(k_pe, cos, sin)
        cached = torch.cat([latent.view(t, 1, r), k_pe], dim=-1)
        if mla.indexer is None:
            return cached
        indexer = getattr(self, "indexer", None)
        index_k = (
            indexer.keys(index_x[0], cos, sin)
            if indexer is not None
            else kv_a.new_zeros(t, mla.indexer.head_dim)
        )
        return torch.cat([cached, index_k.view(t, 1, -1)], dim=-1)

    def _select(self, indexer: Indexer, x, q_resid, cos, sin, pool, batch: ForwardBatch):
        """The indexer's choice for the batch's queries. A prompt: per sequence, a mask
        [n, L] of the keys each of its n queries reads (its top-k earlier tokens). Decode:
        (slots [B, k], valid [B, k]), each sequence's top-k slots, `valid` False where it has
        fewer than k tokens. The scores are read from the index keys in the pages."""
        q, w = indexer.queries(x, q_resid, cos, sin)
        first, topk = self.mla.latent_dim, indexer.idx.topk
        if not batch.is_decode:
            masks = []
            for b, (start, count) in enumerate(zip(batch.starts, batch.counts, strict=True)):
                keys = pool.index_select(0, sequence_slots(batch, b))[:, 0, first:]  # [L, d]
                length = keys.shape[0]
                mask = torch.ones(count, length, dtype=torch.bool, device=x.device).tril(
                    length - count
                )  # causal, then the top-k of each row
                # (queries a block at a time: the scores take [block, heads, L] in fp32)
                block = max(1, SCORE_ELEMENTS // (indexer.idx.n_heads * length))
                for i in range(0, count, block):
                    rows = slice(start + i, start + min(i + block, count))
                    causal = mask[i : i + block]
                    scores = indexer.scores(q[rows], w[rows], keys)
                    top = scores.masked_fill(~causal, float("-inf")).topk(min(topk, length))
                    causal &= torch.zeros_like(causal).scatter_(1, top.indices, True)
                masks.append(mask)
            return masks
        return self._decode_choice(indexer, q, w, pool, batch)

    def _decode_choice(self, indexer: Indexer, q, w, pool, batch: ForwardBatch):
        """A decode step's top-k slots [B, k] and which hold tokens [B, k], from the scores of
        every token of `batch.decode_pages()` (past each length: -inf)."""
        first, topk, ps = self.mla.latent_dim, indexer.idx.topk, batch.page_size
        width = batch.decode_pages() * ps
        if lightning_index.kernel_takes(q):  # scored in place, in one launch
            # (q's values are the pool dtype's, widened by `queries`: exact in it)
            keys = lightning_index.PagedKeys(pool, first, batch.page_table, batch.rows, ps)
            scores = lightning_index.index_scores(
                q.to(pool.dtype), w, keys.every(width), batch.lengths, indexer.idx.head_dim**-0.5
            )
            top = scores.topk(min(topk, width)).indices
            pages = batch.page_table[batch.rows[:, None], top // ps]
            return pages * ps + top % ps, top < batch.lengths[:, None]
        slots, valid = self._context_slots(batch)  # [B, W]
        keys = pool[slots, 0, first:]  # [B, W, d]
        scores = indexer.scores(q[:, None], w[:, None], keys)[:, 0]  # [B, W]
        top = scores.masked_fill(~valid, float("-inf")).topk(min(topk, width)).indices
        return slots.gather(1, top), valid.gather(1, top)

    @staticmethod
    def _context_slots(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoding sequence's slots [B, W] from its page-table row (and which hold its
        tokens), read on the device from the rows and lengths, over `batch.decode_pages()`."""
        ps, pages = batch.page_size, batch.decode_pages()
        table = batch.page_table[batch.rows, :pages]  # [B, P]
        offsets = torch.arange(ps, device=table.device)
        slots = (table[:, :, None] * ps + offsets).flatten(1)  # [B, P * ps]
        positions = torch.arange(slots.shape[1], device=table.device)
        return slots, positions[None] < batch.lengths[:, None]

    def _sparse_decode(self, q, pool, selection, w_uk, w_uv) -> torch.Tensor:
        """Decode over the top-k slots only, in the absorbed form: q [B, heads, d_nope + d_rope]
        -> [B, heads, d_v]."""
        r, nope = self.mla.kv_lora_rank, self.mla.qk_nope_head_dim
        slots, valid = selection
        chosen = pool[slots, 0, : self.mla.latent_dim]  # [B, k, r + d_rope]
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk)
        q_full = torch.cat([q_lat, q[..., nope:]], dim=-1)
        scores = torch.einsum("bhc,bkc->bhk", q_full.float(), chosen.float()) * self.scale
        probs = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1)
        out = torch.einsum("bhk,bkr->bhr", probs.to(chosen.dtype), chosen[..., :r])
        return torch.einsum("bhr,hvr->bhv", out, w_uv)

    def _expanded(self, q, pool, batch: ForwardBatch, w_uk, w_uv, masks=None) -> torch.Tensor:
        """Prefill: each sequence's cached context (its new tokens written already) expanded
        into per-head keys and values; q [T, heads, d_nope + d_rope] -> [T, heads, d_v].
        `masks`: per sequence, the keys [n, L] each query reads (DSA), else causal."""
        r = self.mla.kv_lora_rank
        out = q.new_empty(q.shape[0], self.num_heads, self.mla.v_head_dim)
        for b, (start, count) in enumerate(zip(batch.starts, batch.counts, strict=True)):
            context = pool.index_select(0, sequence_slots(batch, b))[:, 0]  # [L, r + d_rope]
            latent, k_pe = context[:, :r], context[:, r : self.mla.latent_dim]
            keys = torch.cat(
                [
                    torch.einsum("lr,hnr->hln", latent, w_uk),
                    k_pe[None].expand(self.num_heads, -1, -1),
                ],
                dim=-1,
            )
            values = torch.einsum("lr,hvr->hlv", latent, w_uv)
            queries = q[start : start + count].transpose(0, 1)  # [heads, n, d]
            mask = None if masks is None else masks[b]
            o = causal_attention(queries[None], keys[None], values[None], self.scale, mask)
            out[start : start + count] = o[0].transpose(0, 1)
        return out
