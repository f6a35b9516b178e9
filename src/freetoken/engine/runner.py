"""Runs forward passes of a loaded model over sequences held in the paged KV cache.

`ModelRunner` owns what a forward needs beyond the weights: the KV pool (sized here: without
`kv_cache_tokens`, one sequence of `max_model_len` within a quarter of free memory), the
recurrent state pool and its anchor slots (hybrid models), the MoE runtime (its expert cache
takes the device memory the KV pool leaves) installed as every MoE block's executor, and the
decode graphs. Re-sizes of the cache or the pool go through here, since the graphs read both:
they are dropped first and captured again after."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from freetoken.config import MoEOptions
from freetoken.engine.cuda_graphs import DecodeGraphs
from freetoken.errors import FreetokenError
from freetoken.kernels import paged_attention
from freetoken.kv.batch import SHORT_QUERIES, ForwardBatch, PinnedStaging, commit
from freetoken.kv.paged import KVSequence, PagedKVCache
from freetoken.kv.recurrent import RecurrentStatePool
from freetoken.model_config import ModelConfig
from freetoken.models.loading import LoadedModel
from freetoken.moe.runtime import MoERuntime, build_runtime
from freetoken.weights.memory import available_host_bytes, gib

log = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 16
# Without --kv-cache-tokens the KV pool holds one sequence of the model's whole context, but
# takes at most this share of the memory free when it is made (device memory on a GPU, where
# the expert cache takes what the pool leaves; host memory on the CPU).
KV_MEMORY_FRACTION = 0.25


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of one token in every attention layer (under MLA its latent, once)."""
    layers = sum(config.attention_layers)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if config.compressed is not None:  # (DeepSeek-V4: one row a token and layer, K=V)
        return sum(config.kv_layer_dims) * itemsize
    pools = 1 if config.mla else 2
    if config.layer_attention:  # (Gemma-4: heads by the layer's kind)
        shapes = zip(config.attention_layers, config.layer_attention, strict=True)
        return pools * sum(s.num_kv_heads * s.head_dim for kept, s in shapes if kept) * itemsize
    return pools * layers * config.kv_cache_heads * config.kv_cache_dim * itemsize


def auto_kv_tokens(config, max_model_len: int, dtype: torch.dtype, device: torch.device) -> int:
    """KV capacity for one sequence of `max_model_len` tokens where memory allows."""
    on_gpu = device.type == "cuda"
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else available_host_bytes()
    per_token = kv_bytes_per_token(config, dtype)
    tokens = min(max_model_len, int(free * KV_MEMORY_FRACTION) // max(1, per_token))
    if tokens < max_model_len:
        log.warning(
            "the KV cache holds %d tokens (%s, a quarter of the free %s memory), less than the "
            "model's %d-token context; requests are limited to that (--kv-cache-tokens or "
            "--max-model-len to choose)",
            tokens,
            gib(tokens * per_token),
            device.type,
            max_model_len,
        )
    return max(tokens, 1)


def _served_length(cfg: ModelConfig, max_model_len: int | None) -> int:
    """The longest sequence served: `max_model_len`, at most (and by default) the model's."""
    served = max_model_len or cfg.max_position_embeddings
    if served > cfg.max_position_embeddings:
        raise FreetokenError(
            f"--max-model-len {served} is beyond the model's context of "
            f"{cfg.max_position_embeddings} tokens (max_position_embeddings)"
        )
    return served


def _by_table_width(cfg: ModelConfig) -> bool:
    """Whether decode graphs are captured per page-table width: DSA's indexer (layers/mla.py)
    and DeepSeek-V4's compressed attention (layers/compressed_attention.py) read every slot or
    window of the width a capture fixes."""
    return cfg.compressed is not None or (cfg.mla is not None and cfg.mla.indexer is not None)


def _captures_decode(cfg: ModelConfig) -> bool:
    """Whether a GPU's decode steps of `cfg` are captured in CUDA graphs. Not for heads the
    device's decode kernel does not take (their torch path reads lengths on the host).
    Linear-attention layers read their sequences' state slots from the batch's packed buffer,
    which a replay copies in. Sparse attention (DSA) and DeepSeek-V4's compressed attention
    read as many page-table columns as their capture fixes, every slot or window there masked
    past each length: captured per width (`_by_table_width`)."""
    if _by_table_width(cfg):
        return True
    return all(  # (every layer's heads: Gemma-4's differ by layer)
        paged_attention.triton_decode_width(
            d, cfg.mla is not None, cfg.mla.kv_lora_rank if cfg.mla else 0
        )
        for d in set(cfg.kv_layer_dims or (cfg.kv_cache_dim,))
    )


def _captures_verify(cfg: ModelConfig) -> bool:
    """Whether verify steps (a few new tokens per sequence, every token's logits) are
    captured too, where decode steps are: where every layer's attention runs the decode
    kernel per new token (`ForwardBatch.per_query`), reading nothing sized on the host. Not latent
    attention, whose several-token path gathers keys sized by the host's lengths, nor models
    with recurrent state (their drafting requests save a state copy in the step, which runs
    eagerly: engine/generate.py's `_verify`)."""
    return cfg.mla is None and cfg.compressed is None and cfg.linear_attention is None


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        kv_cache_tokens: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        moe: MoEOptions | None = None,
        cuda_graphs: bool = True,
        max_sequences: int = 8,
        state_anchors: int = 0,
        state_scratch: int = 0,
        max_model_len: int | None = None,
    ):
        """`max_model_len`: the longest sequence served (default: the model's
        `max_position_embeddings`); `kv_cache_tokens`: the KV pool's capacity (default: one
        such sequence, within KV_MEMORY_FRACTION of free memory).
        For models with linear-attention layers: `max_sequences` recurrent state slots
        (how many sequences can run at once) plus `state_anchors` slots set aside for anchor
        checkpoints (`anchor_slots`, managed by kv/anchors.py) and `state_scratch` slots
        where speculative decoding keeps a drafting sequence's state from before its verify
        step (`scratch_slots`, engine/generate.py). Other models ignore all three."""
        self.model = loaded.model
        self.config = loaded.config
        self.integrity = loaded.integrity  # a weight directory's background checksum check
        if self.model.device.type == "cuda":
            # cuDNN's attention builds a plan for every new key length, on the host: 1-11 ms per
            # layer per decode step on the H200 machine (benchmarks/profile_decode.py). The
            # other SDPA backends take the same inputs with no such cost.
            torch.backends.cuda.enable_cudnn_sdp(False)
        cfg = loaded.config
        self.max_model_len = _served_length(cfg, max_model_len)
        self.kv = self._kv_pool(kv_cache_tokens, page_size)
        # Pinned buffers for each forward's packed copy of its per-step values.
        self.staging = PinnedStaging() if self.model.device.type == "cuda" else None
        self.states = RecurrentStatePool.for_model(
            cfg, max_sequences + state_anchors + state_scratch, self.model.dtype, self.model.device
        )
        log.debug("KV cache and state pool allocated")
        self.anchor_slots = (
            [self.states.alloc() for _ in range(state_anchors)] if self.states else []
        )
        self.scratch_slots = (
            [self.states.alloc() for _ in range(state_scratch)] if self.states else []
        )
        # The expert cache takes what device memory the KV cache leaves.
        self.moe: MoERuntime | None = None
        if loaded.experts is not None:
            self.moe = build_runtime(
                loaded.experts, self.model.device, moe or MoEOptions(), cfg.hidden_act
            )
            log.debug("MoE runtime built")
        self._moe_blocks = [layer.moe for layer in self.model.layers if hasattr(layer, "moe")]
        self._install_moe()
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and _captures_decode(cfg):
            self.graphs = DecodeGraphs(self.model, self.kv, self.states, _by_table_width(cfg))
        self.verify_graphs = self.graphs is not None and _captures_verify(cfg)
        # Forwards whose time is not their shape's steady cost: one that ran eagerly before
        # its shape's graphs were captured, or captured them (engine/draft_policy.py)
        self.untimed = 0

    def _kv_pool(self, kv_cache_tokens: int | None, page_size: int) -> PagedKVCache:
        """The paged KV pool: `kv_cache_tokens` (default: `auto_kv_tokens`) in pages."""
        cfg = self.config
        if kv_cache_tokens is None:
            kv_cache_tokens = auto_kv_tokens(
                cfg, self.max_model_len, self.model.dtype, self.model.device
            )
        return PagedKVCache(
            num_layers=cfg.stack_layers,  # (with MTP read, its layer's K/V too)
            num_pages=-(-kv_cache_tokens // page_size),
            page_size=page_size,
            num_kv_heads=cfg.kv_cache_heads,
            head_dim=cfg.kv_cache_dim,
            dtype=self.model.dtype,
            device=self.model.device,
            kv_layers=cfg.attention_layers,
            max_seq_tokens=self.max_model_len,
            values_are_keys=cfg.mla is not None or cfg.compressed is not None,
            layer_dims=cfg.kv_layer_dims,
            layer_heads=cfg.kv_layer_heads,
        )

    @property
    def device(self) -> torch.device:
        return self.model.device

    def _install_moe(self) -> None:
        """Make this runner's MoE runtime the executor of the model's MoE blocks. Runners
        built on one loaded model share its modules: each forward re-installs its own (a
        benchmark interleaving strategies on one model would otherwise run the last one
        built for all of them)."""
        blocks = self._moe_blocks
        if self.moe is not None and blocks and blocks[0].executor is not self.moe:
            for block in blocks:
                block.executor = self.moe
                # (None where nothing is prefetched: the decode loop then skips the layer's
                # prediction with one attribute test)
                block.prefetch_from = self.moe.prefetcher if self.moe.prefetches else None

    def resize_expert_cache(self, size: str | int) -> int:
        """Re-size the expert cache to `size` (slots, or bytes such as "8GiB") between steps;
        returns its slots. Decode graphs are captured again."""
        from freetoken.moe.runtime import parse_cache_size

        if self.moe is None:
            raise ValueError("this model has no routed experts")
        slots = parse_cache_size(size, self.moe.store.shape.nbytes)
        self._resize(lambda: self.moe.resize_cache(slots), f"an expert cache of {size}")
        return self.moe.cache.num_slots

    def resize_kv(self, num_pages: int) -> None:
        """Give the KV pool `num_pages` pages between steps (kv/paged.py `resize`)."""
        self._resize(lambda: self.kv.resize(num_pages), f"a KV cache of {num_pages} pages")

    def _resize(self, resize: Callable[[], None], what: str) -> None:
        """Run a re-size of buffers the decode graphs read: the graphs are dropped first (their
        memory pools go back to the driver, and the re-size can count on that memory) and
        captured again after it; the memory given up goes back too; no room for it is a
        ValueError."""
        if self.graphs is not None:
            self.graphs.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            resize()
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise ValueError(f"no device memory for {what}") from None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_pages_for(self, size: str) -> int:
        """Pages for a KV size: tokens ("65536") or bytes ("4GiB")."""
        from freetoken.moe.runtime import parse_cache_size

        if str(size).strip().isdigit():
            return -(-int(size) // self.kv.page_size)
        return parse_cache_size(size, self.kv.page_bytes)

    def new_sequence(self) -> KVSequence:
        """An empty sequence, with a zeroed recurrent state slot when the model needs one."""
        seq = KVSequence()
        if self.states is not None:
            seq.state_slot = self.states.alloc()
        return seq

    def release(self, seq: KVSequence) -> None:
        """Free the sequence's pages and its recurrent state slot."""
        self.kv.release(seq)
        if seq.state_slot is not None:
            self.states.free(seq.state_slot)
            seq.state_slot = None

    def forward(
        self,
        seqs: Sequence[KVSequence],
        new_tokens: Sequence[Sequence[int]],
        all_logits: bool = False,
        captures: list[list[tuple[int, int]]] | None = None,
        hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append `new_tokens[i]` to `seqs[i]` for every i in one forward pass; return fp32
        logits of each sequence's last token ([B, V]) or of every new token ([T, V]).
        `captures[i]`: (k, slot) pairs, save sequence i's recurrent state after its first k
        new tokens into state pool slot `slot` (anchor checkpoints). `hidden`: (logits, every
        new token's final hidden state), for MTP drafts (`mtp_forward`); such a step runs
        eagerly (a decode graph gives its logits only)."""
        self._install_moe()
        one_each = not all_logits and all(len(t) == 1 for t in new_tokens)
        # A verify step: every token's logits of a few new tokens per sequence (a draft).
        verify = all_logits and max(map(len, new_tokens)) <= SHORT_QUERIES
        if self.moe is not None:
            self.moe.begin_step(sum(map(len, new_tokens)), decode=one_each or verify)
        # (a step that saves a recurrent state mid-way, an anchor, runs eagerly: rare)
        graphed = one_each or (verify and self.verify_graphs)
        graphed = self.graphs is not None and graphed and not any(captures or []) and not hidden
        batch = ForwardBatch.build(
            self.kv, seqs, new_tokens, self.device, captures=captures, staging=self.staging
        )
        logits = self.graphs.run(batch, all_logits) if graphed else None
        captured = graphed and self.graphs.captured_now
        self.untimed += graphed and (logits is None or captured)
        if logits is None:
            logits = self.model(
                batch, self.kv, all_logits=all_logits, states=self.states, hidden=hidden
            )
        if self.moe is not None:
            self.moe.end_step(timed=not captured)
        commit(seqs, batch)
        return logits

    def mtp_forward(
        self,
        seqs: Sequence[KVSequence],
        tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
        hidden: torch.Tensor,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's MTP layer over `tokens[i]` at positions `starts[i]` on of `seqs[i]`
        (each token the one after its position; `hidden`, flat, the final hidden state at
        each): its K/V written there, in the sequence's pages (taken where it has none yet),
        its length unchanged. -> `DecoderModel.mtp_forward`'s (logits, hidden states)."""
        self._install_moe()
        if self.moe is not None:
            self.moe.begin_step(sum(map(len, tokens)), decode=all(len(t) == 1 for t in tokens))
        batch = ForwardBatch.build(
            self.kv, seqs, tokens, self.device, staging=self.staging, starts=starts
        )
        out = self.model.mtp_forward(batch, self.kv, hidden, all_logits)
        if self.moe is not None:
            self.moe.end_step()
        return out
