"""DeepSeek-V4's attention over the paged KV cache: a sliding window beside compressed entries.

Every layer attends with one shared K=V head (`wkv`, normed, RoPE on its last `rope_dim`
values, interleaved) to the last `sliding_window` tokens, plus learned per-head sinks. A
compressing layer also attends to pooled entries: its compressor turns each window of `ratio`
tokens into one entry, a softmax-gated sum of their projections (`wkv`, `wgate` plus a learned
bias per place in the window `ape`), normed and turned by RoPE at the window's first position.
"heavily_compressed_attention" pools every `hca_ratio` tokens and a query sees every closed
window before it; "compressed_sparse_attention" pools every `csa_ratio` over two series (a
window's entry mixes its own tokens' second series with the previous window's first), and its
Lightning Indexer (a second, narrower compressor and query) scores the closed windows per query
and keeps the `index_topk` best. The output has the queries' RoPE turned back, then goes through
the grouped output projection (`wo_a` per head group, `wo_b`).

All of it lives in the paged cache, one row a token and layer (`PagedKVCache(layer_dims=...)`,
`CompressedAttentionConfig.row_layout`): the token's K=V, its compressor projections and gate
logits (without `ape`), and the entry of the window the token closes (written at the window's
last token; the rows of other tokens hold an entry nobody reads). So a window is pooled from
its tokens' rows wherever they were written (an earlier prefill chunk, a prefix shared from
the radix cache), there is no per-sequence state beside the pages, and chunked prefill and
prefix reuse are exact by construction. Each step pools one candidate entry per new token (the
window ending there), the same work whether or not it closes a window.

The torch code here is the definition and the CPU path. On a GPU the rotations, the pooling and
a decode step's attention are kernels/compressed_decode.py's (one launch each where torch
needs tens), and the cos and sin of a step's positions are computed once for all its layers
(`StepShared`). A prompt is read per sequence, its context's rows gathered (as the MLA prefill
does). A decode step reads every sequence at once: the window's rows and the closing rows of
the windows of the batch's longest sequence (in steps of WINDOW_BUCKET windows; while a CUDA
graph is captured, every window of the page-table width it is captured for), masked past
each sequence's length (the kernel reads only the entries the indexer chose); the host's work
does not grow with the context and nothing waits on the device, so the runner captures V4's
decode step in CUDA graphs like any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels import compressed_decode as kernels
from freetoken.kernels import lightning_index
from freetoken.kernels.paged_attention import sequence_slots
from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import PagedKVCache
from freetoken.layers.concurrent import Beside, beside
from freetoken.layers.linear import Linear, outputs, stacked
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import RotaryEmbedding
from freetoken.model_config import ModelConfig

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def half_cos_sin(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin [T, rope_dim / 2] (one per interleaved pair), in `dtype` as transformers
    hands them over."""
    freqs = positions.float()[:, None] * rotary.inv_freq[None, :]
    return (freqs.cos() * rotary.scaling).to(dtype), (freqs.sin() * rotary.scaling).to(dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's RoPE on the last 2 * cos.shape[-1] values of x [T, ..., D], pairs interleaved
    (x0, x1), (x2, x3)...; cos, sin [T, rope_dim / 2]; computed in fp32."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rd = cos.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def turn(x: torch.Tensor, cos, sin, rms_eps: float | None = None) -> torch.Tensor:
    """rope_tail(x) (of unweighted_rms(x) with `rms_eps`): one launch on a GPU."""
    if kernels.kernel_takes(x):
        return kernels.rope_tail(x, cos, sin, rms_eps)
    return rope_tail(x if rms_eps is None else unweighted_rms(x, rms_eps), cos, sin)


class StepShared:
    """What a forward's compressed layers share, each computed at its first use and kept for
    the forward's other layers (the positions are the same in every layer), so a decode step
    launches it once, not once a layer: the cos and sin they turn by (the main RoPE's at the
    new tokens' positions, the compressed branches' at them and at the first positions of the
    windows they close, `offset` 1 - ratio; and the inverse turn's), and which windows each
    sequence has closed."""

    def __init__(self, main: RotaryEmbedding, compress: RotaryEmbedding, positions, dtype):
        self.rotaries, self.positions, self.dtype = (main, compress), positions, dtype
        self.kept: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def angles(self, compressed: bool, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("angles", compressed, offset)
        if key not in self.kept:
            rotary = self.rotaries[compressed]
            self.kept[key] = half_cos_sin(rotary, self.positions + offset, self.dtype)
        return self.kept[key]

    def inverse(self, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, -sin): the turn back of the attention's output."""
        key = ("inverse", compressed)
        if key not in self.kept:
            cos, sin = self.angles(compressed)
            self.kept[key] = cos, -sin
        return self.kept[key]

    def windows(self, ratio: int, count: int) -> tuple[torch.Tensor, ...]:
        """(w [count] the window numbers, ready [B] how many each sequence has closed,
        seen [B, count] w < ready) of a decode step's sequences."""
        key = ("windows", ratio, count)
        if key not in self.kept:
            w = torch.arange(count, device=self.positions.device)
            ready = (self.positions + 1) // ratio
            self.kept[key] = w, ready, w[None] < ready[:, None]
        return self.kept[key]


# A decode step reads the closing rows of this many windows a sequence at a time: enough for
# the batch's longest sequence, rounded up (so shapes change every so many windows), or, while a
# CUDA graph is captured, every window of the width it is captured for (ForwardBatch.table_pages).
WINDOW_BUCKET = 64


def _rows_at(pool, batch: ForwardBatch, rows_of, positions, cols=slice(None)) -> torch.Tensor:
    """Columns `cols` of the cache rows [N, S, ...] of positions [N, S] (>= 0) of the sequences
    on page-table rows `rows_of` [N] (only those columns are read)."""
    ps = batch.page_size
    slots = batch.page_table[rows_of[:, None], positions // ps] * ps + positions % ps
    return pool[:, 0, cols][slots]


def _closing(windows: torch.Tensor, ratio: int, positions: torch.Tensor) -> torch.Tensor:
    """The positions of `windows`' last tokens (their entries' rows), for each of the
    sequences at `positions` [B, 1]: [B, windows]."""
    return ((windows + 1) * ratio - 1)[None].expand(positions.shape[0], -1)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _windows_read(batch: ForwardBatch, ratio: int, capturing: bool) -> int:
    """Windows a decode step reads: while a CUDA graph is captured, every window of the
    page-table width it is captured for (`ForwardBatch.table_pages`), else the closed ones
    rounded up to a bucket."""
    if capturing:
        return batch.table_pages() * batch.page_size // ratio
    most = batch.page_table.shape[1] * batch.page_size // ratio
    closed = max(batch.seq_lens) // ratio
    return min(most, -(-(closed + 1) // WINDOW_BUCKET) * WINDOW_BUCKET)


class Compressor(nn.Module):
    """Pools `ratio` tokens' projections into one entry of `dim` values; `overlap` (CSA): two
    series, a window's entry taking its own tokens' second and the previous window's first."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        series = 2 if overlap else 1
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv = Linear(hidden, series * dim, bias=False)
        self.wgate = Linear(hidden, series * dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, series * dim))  # (kept fp32)
        self.norm = RMSNorm(dim, eps, scale_fp32=True)

    def pool(
        self,
        rows: torch.Tensor,
        valid: torch.Tensor,
        kv_cols: slice,
        gate_cols: slice,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The entry of the window ending at each new token: `rows` [T, S, W] are the cache
        rows of the S = (2 if overlap else 1) * ratio tokens up to it, `valid` [T, S] which of
        them exist (a first window has no previous one); `cos_sin` at the window's first
        position."""
        r, d = self.ratio, self.dim
        kv, gate = rows[..., kv_cols], rows[..., gate_cols].float()
        if self.overlap:
            ape = self.ape.float()
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d] + ape[:, :d], gate[:, r:, d:] + ape[:, d:]], dim=1)
        else:
            gate = gate + self.ape.float()
        ok = valid[..., None]
        kv = torch.where(ok, kv, torch.zeros((), dtype=kv.dtype, device=kv.device))
        gate = torch.where(ok, gate, float("-inf"))
        pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
        return rope_tail(self.norm(pooled), *cos_sin)


class Indexer(Compressor):
    """The Lightning Indexer of a CSA layer: its own compressor at `index_head_dim`, queries
    from the attention's q latent (`wq_b`) and per-head weights (`weights_proj`)."""

    def __init__(self, cfg: ModelConfig):
        c = cfg.compressed
        super().__init__(cfg.hidden_size, c.index_head_dim, c.csa_ratio, True, cfg.rms_norm_eps)
        self.heads, self.topk = c.index_heads, c.index_topk
        self.wq_b = Linear(c.q_lora_rank, c.index_heads * c.index_head_dim, bias=False)
        self.weights_proj = Linear(cfg.hidden_size, c.index_heads, bias=False)


class CompressedAttention(nn.Module):
    """Parameter names follow the released checkpoint (DeepSeek's own spelling)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        c = cfg.compressed
        assert c is not None
        self.layer, self.kind = layer, c.layer_kinds[layer]
        h, heads, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.heads, self.dim, self.window, self.eps = heads, d, cfg.sliding_window, cfg.rms_norm_eps
        self.groups = c.o_groups
        self.layout = c.row_layout(layer, d)
        self.wq_a = Linear(h, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, cfg.rms_norm_eps, scale_fp32=True)
        self.wq_b = Linear(c.q_lora_rank, heads * d, bias=False)
        self.wkv = Linear(h, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, scale_fp32=True)
        self.wo_a = Linear(heads * d // c.o_groups, c.o_groups * c.o_lora_rank, bias=False)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, h, bias=False)
        self.sinks = nn.Parameter(torch.zeros(heads))  # (kept fp32)
        self.scale = d**-0.5
        self.ratio = c.ratio(layer)
        if self.kind != "sliding_attention":
            self.compressor = Compressor(h, d, self.ratio, self.kind == CSA, cfg.rms_norm_eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg)
        # The layers that read x, in the order `forward` takes their outputs: q's down
        # projection, K=V, then what the row stores after K (row_layout's order), the
        # indexer's head weights last; and them as one, once stacked.
        of_x = [self.wq_a, self.wkv]
        if self.kind != "sliding_attention":
            of_x += [self.compressor.wkv, self.compressor.wgate]
        if self.kind == CSA:
            of_x += [self.indexer.wkv, self.indexer.wgate, self.indexer.weights_proj]
        self.of_x = tuple(of_x)
        self.x_proj: Linear | None = None

    def stack_projections(self, dense: bool) -> None:
        """The projections of x computed as one weight from now on (layers/linear.py's
        `stacked`; dense weights too with `dense`): one GEMM of a decode step where a CSA
        layer had seven."""
        self.x_proj = stacked(*self.of_x, dense=dense)

    def forward(
        self, x: torch.Tensor, shared: StepShared, batch: ForwardBatch, kv: PagedKVCache
    ) -> torch.Tensor:
        t, heads, d = x.shape[0], self.heads, self.dim
        compressed = self.kind != "sliding_attention"
        cos, sin = shared.angles(compressed)
        if self.x_proj is None:
            # the row's projections beside the queries' chain (layers/concurrent.py)
            of_row = self.of_x[1:]
            written = beside(lambda x: self._row([layer(x) for layer in of_row], cos, sin), x)
            q_down = self.wq_a(x)
        else:
            q_down, *projected = outputs(x, self.of_x, self.x_proj)
            written = Beside(self._row(projected, cos, sin))
        q_latent = self.q_a_norm(q_down)
        q = turn(self.wq_b(q_latent).view(t, heads, d), cos, sin, rms_eps=self.eps)
        # (a decode step's indexer queries, before the row is joined)
        index_q = None
        if self.kind == CSA and batch.is_decode:
            index_q = self._index_query(q_latent, shared.angles(True))
        row, index_weights = written.result()

        pool = kv.k[self.layer]  # [slots, 1, W]
        pool[:, 0, : row.shape[1]].index_copy_(0, batch.write_slots, row.to(pool.dtype))
        if compressed:
            self._pool_entries(pool, batch, shared)

        if batch.is_decode:
            out = self._decode(q, pool, batch, index_weights, index_q, shared)
        else:
            out = q.new_empty(t, heads, d)
            for b, (start, count) in enumerate(zip(batch.starts, batch.counts, strict=True)):
                rows = pool.index_select(0, sequence_slots(batch, b))[:, 0]  # [L, W]
                span = slice(start, start + count)
                angles = tuple(a[span] for a in shared.angles(True))
                weights = None if index_weights is None else index_weights[span]
                out[span] = self._attend(
                    q[span], rows, batch.positions[span], weights, q_latent[span], angles
                )
        out = turn(out, *shared.inverse(compressed))
        grouped = out.reshape(t, self.groups, -1)
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        return self.wo_b(torch.einsum("tgi,gri->tgr", grouped, w).reshape(t, -1))

    def _row(self, projected: list[torch.Tensor], cos, sin):
        """(the cache row's leading columns [T, ...] in row_layout's order: K=V normed and
        turned, the compressors' projections and gate logits; the indexer's head weights
        [T, heads] as projected, scaled where they are read, or None) from the projections of
        x after q's."""
        kv_x, *stored = projected
        index_weights = stored.pop() if self.kind == CSA else None
        k = turn(self.kv_norm(kv_x), cos, sin)
        return (torch.cat([k, *stored], dim=1) if stored else k), index_weights

    def _pool_entries(self, pool: torch.Tensor, batch: ForwardBatch, shared: StepShared) -> None:
        """Write, at each new token's row, the entry (and the indexer's) of the window ending
        at that token, pooled from the cache rows of the window's tokens."""
        lay, r = self.layout, self.ratio
        if batch.is_decode:
            rows_of = batch.rows
        else:
            counts = torch.tensor(batch.counts, device=pool.device)
            rows_of = batch.rows.repeat_interleave(counts, output_size=batch.num_tokens)
        compressors = [(self.compressor, "ckv", "cgate", "centry")]
        if self.kind == CSA:
            compressors.append((self.indexer, "ikv", "igate", "ientry"))
        cos_sin = shared.angles(True, 1 - r)
        if kernels.kernel_takes(pool):
            for c, kv_cols, gate_cols, entry_cols in compressors:
                cols = (lay[kv_cols].start, lay[gate_cols].start, lay[entry_cols].start, c.dim)
                kernels.pool_entries(
                    pool,
                    batch.page_table,
                    rows_of,
                    batch.positions,
                    batch.write_slots,
                    batch.page_size,
                    r,
                    c.overlap,
                    cols,
                    c.ape,
                    c.norm.weight,
                    c.norm.eps,
                    *cos_sin,
                )
            return
        series = 2 if self.kind == CSA else 1
        span = torch.arange(series * r, device=pool.device) - (series * r - 1)
        positions = batch.positions[:, None] + span  # [T, S]
        rows = _rows_at(pool, batch, rows_of, positions.clamp(min=0))  # [T, S, W]
        for c, kv_cols, gate_cols, entry_cols in compressors:
            entry = c.pool(rows, positions >= 0, lay[kv_cols], lay[gate_cols], cos_sin)
            pool[batch.write_slots, 0, lay[entry_cols]] = entry

    def _decode(self, q, pool, batch: ForwardBatch, index_weights, index_q, shared: StepShared):
        """One new token a sequence, all sequences at once, with no host work that grows with
        the context and nothing that waits on the device: the window's rows, and the closing
        rows of `_windows_read` windows, those not closed yet masked (while a CUDA graph is
        captured, of every window of the width it is captured for: shapes fixed up to it);
        `index_q`, a CSA layer's indexer queries (`_index_query`)."""
        lay, r, p = self.layout, self.ratio, batch.positions[:, None]
        if r:
            w, ready, seen = shared.windows(r, _windows_read(batch, r, _capturing(q)))
            top = None
            if self.kind == CSA and lightning_index.kernel_takes(q):  # scored in place
                keys = lightning_index.PagedKeys(
                    pool, lay["ientry"].start, batch.page_table, batch.rows, batch.page_size
                ).closing(len(w), r)
                top = self._top_windows_in_place(keys, ready, index_weights, index_q)
            elif self.kind == CSA:
                index_keys = _rows_at(pool, batch, batch.rows, _closing(w, r, p), lay["ientry"])
                top = self._top_windows(index_keys, seen, ready, index_weights, index_q)
        if kernels.kernel_takes(q):
            ids = None
            if r:  # the windows each sequence reads (-1: none), only the chosen ones
                ids = torch.where(seen, w[None], -1) if top is None else top
            return kernels.attend(
                q,
                pool,
                batch.page_table,
                batch.rows,
                batch.positions,
                batch.page_size,
                self.window,
                lay["kv"].start,
                ids,
                r,
                lay["centry"].start if r else 0,
                self.sinks,
                self.scale,
            )
        back = torch.arange(self.window - 1, -1, -1, device=q.device)
        at = p - back  # [B, window]
        keys = _rows_at(pool, batch, batch.rows, at.clamp(min=0), lay["kv"])
        bias = torch.zeros(at.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(at < 0, float("-inf"))
        if r:
            entries = _rows_at(pool, batch, batch.rows, _closing(w, r, p), lay["centry"])
            keys = torch.cat([keys, entries], dim=1)
            if top is not None:
                seen = _chosen_mask(top, seen)
            extra = torch.zeros(seen.shape, dtype=q.dtype, device=q.device)
            bias = torch.cat([bias, extra.masked_fill(~seen, float("-inf"))], dim=1)
        return self._softmax_attend(q, keys, bias, "bhd,bkd->bhk", "bhk,bkd->bhd")

    def _attend(self, q, rows, positions, index_weights, q_latent, cos_sin) -> torch.Tensor:
        """One sequence's new queries q [n, heads, d] at `positions` over its context's rows
        [L, W]: the sliding window, the closed windows' entries (all, or the indexer's top-k),
        the sinks."""
        lay, length = self.layout, rows.shape[0]
        keys = rows[:, lay["kv"]]
        j = torch.arange(length, device=q.device)
        p = positions[:, None]
        visible = (j[None] <= p) & (j[None] > p - self.window)  # [n, L]
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~visible, float("-inf"))
        if self.ratio:
            r = self.ratio
            count = length // r
            closed = rows[r - 1 : count * r : r]  # the rows of each window's last token
            keys = torch.cat([keys, closed[:, lay["centry"]]])
            ready = (positions + 1) // r  # windows closed at each query
            w = torch.arange(count, device=q.device)
            seen = w[None] < ready[:, None]  # [n, E]
            if self.kind == CSA and count:
                entries = closed[:, lay["ientry"]]
                index_q = self._index_query(q_latent, cos_sin)
                top = self._top_windows(entries, seen, ready, index_weights, index_q)
                seen = _chosen_mask(top, seen)
            extra = torch.zeros(seen.shape, dtype=q.dtype, device=q.device)
            bias = torch.cat([bias, extra.masked_fill(~seen, float("-inf"))], dim=1)
        return self._softmax_attend(q, keys, bias, "nhd,kd->nhk", "nhk,kd->nhd")

    def _softmax_attend(self, q, keys, bias, scores: str, mix: str) -> torch.Tensor:
        """Attention of q [n, heads, d] over keys = values with an additive bias [n, K] and
        the per-head sinks (a logit each, in the softmax, attending nothing): the softmax in
        fp32, where transformers' concatenation with its fp32 sinks puts it."""
        logits = torch.einsum(scores, q, keys) * self.scale + bias[:, None]
        sinks = self.sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
        combined = torch.cat([logits.float(), sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
        return torch.einsum(mix, probs, keys)

    def _top_windows(self, entries, seen, ready, weights, iq) -> torch.Tensor:
        """The Lightning Indexer: the closed windows each query attends, [n, min(topk, E)]
        (-1 for a pick past the closed ones, when fewer are closed than it keeps), from the
        head `weights` [n, heads] as projected and the queries `iq` (`_index_query`)."""
        ix = self.indexer
        weights = weights.float() * ix.heads**-0.5
        spec = "nhd,ed->nhe" if entries.dim() == 2 else "nhd,ned->nhe"  # (shared, or per query)
        scores = torch.einsum(spec, iq.float(), entries.float())
        scores = F.relu(scores) * ix.dim**-0.5
        scores = (scores * weights[..., None]).sum(dim=1)  # [n, E]
        return self._chosen(scores.masked_fill(~seen, float("-inf")), ready)

    def _top_windows_in_place(self, keys, ready, weights, iq) -> torch.Tensor:
        """`_top_windows` of a decode step, its entries scored where they lie in the pages
        (kernels/lightning_index.py)."""
        ix = self.indexer
        scores = lightning_index.index_scores(
            iq, weights, keys, ready, ix.dim**-0.5, weight_scale=ix.heads**-0.5
        )
        return self._chosen(scores, ready)

    def _index_query(self, q_latent, cos_sin) -> torch.Tensor:
        """The indexer's queries [n, heads, dim], rotated."""
        ix = self.indexer
        n = q_latent.shape[0]
        return turn(ix.wq_b(q_latent).view(n, ix.heads, ix.dim), *cos_sin)

    def _chosen(self, scores: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
        """The top-k of scores [n, E] (-inf past the closed windows), -1 for a pick past them."""
        top = scores.topk(min(self.indexer.topk, scores.shape[1]), dim=-1).indices
        return torch.where(top < ready[:, None], top, -1)


def _chosen_mask(top: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """The windows `top` [n, k] names (-1: none) as a mask [n, E], within `seen`."""
    n, count = seen.shape
    chosen = seen.new_zeros(n, count + 1)  # (a last column for the picks not kept)
    chosen.scatter_(1, torch.where(top >= 0, top, count), True)
    return chosen[:, :count] & seen
