"""Long prefill chunks: whole MoE layers stream through two layer-sized device buffers.

A chunk of hundreds of tokens routes to nearly every expert of every layer, so filling the
cache on demand would expose the transfer of the whole pool as idle GPU time. Instead, while
layer l computes from one buffer, the copy stream fills the other with every expert of layer
l + 1 (it needs no routing, so it starts as soon as the buffer is free). Experts of l + 1
that the decode cache already holds are copied device to device; the rest come over PCIe in
runs of consecutive experts. Events order the two streams: a buffer is overwritten only after
the kernels reading it are done, and read only after its copies are.

After each layer, the experts the chunk's last token routed to are copied (device to device)
from the buffer into the decode cache, so the first decode steps do not start cold.

The buffers are a reserved region beside the cache rather than borrowed cache slots, so a
prefill never evicts what decode has learnt to keep. The price is two layers of experts the
cache could otherwise hold (2.4 GB for Qwen3-30B-A3B: a 23% larger cache at an 8 GiB budget);
borrowing would instead cost decode up to two layers of refills after every long chunk
(~50 ms of PCIe there). Which hurts decode less is not measured yet.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from freetoken.kernels.grouped_experts import grouped_expert_forward
from freetoken.moe.cache import ExpertCache
from freetoken.moe.store import HostExpertStore
from freetoken.weights.expert_format import expert_weights

log = logging.getLogger(__name__)


@dataclass
class PrefillCounters:
    """Per streamed chunk (a run of layers from the first MoE layer), summed."""

    chunks: int = 0
    tokens: int = 0
    seconds: float = 0.0
    bytes_h2d: int = 0
    bytes_d2d: int = 0
    copy_wait_s: float = 0.0  # time the compute stream waited for copies (CUDA: measured)
    history: list[dict] = field(default_factory=list)  # the last chunks, one dict each


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs in a sorted list: [(first, count), ...]."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][0] + runs[-1][1] == v:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


class LayerStreamer:
    def __init__(
        self,
        store: HostExpertStore,
        cache: ExpertCache | None,
        device: torch.device,
        act: str = "silu",
    ):
        self.store, self.cache, self.device, self.act = store, cache, device, act
        # two buffers, each a layer's row of every bank of the store
        self.buffers = [
            tuple(
                torch.empty(store.num_experts, *bank.shape[1:], dtype=bank.dtype, device=device)
                for bank in store.banks
            )
            for _ in range(2)
        ]
        self.loaded = [-1, -1]  # MoE layer held by each buffer
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.ready = [None, None]  # copy-done event of each buffer
        self.free = [None, None]  # last-read event of each buffer
        self.counters = PrefillCounters()
        self._chunk: dict | None = None
        # False loads each layer only when it is reached (copy, then compute): the baseline
        # that benchmarks/prefill.py compares the overlapped stream with.
        self.overlap = True

    def _load(self, moe_layer: int) -> None:
        """Issue the copies of every expert of `moe_layer` into its buffer."""
        b = moe_layer % 2
        buffer = self.buffers[b]
        store, cache, e = self.store, self.cache, self.store.num_experts
        base = moe_layer * e
        cached = {}
        if cache is not None:
            slots = cache.slot_of[base : base + e].tolist()
            cached = {x: s for x, s in enumerate(slots) if s >= 0}
        uncached = [x for x in range(e) if x not in cached]
        chunk = self._chunk

        def copy():
            for first, n in _runs(uncached):
                rows = slice(base + first, base + first + n)
                for dst, src in zip(buffer, store.banks, strict=True):
                    dst[first : first + n].copy_(src[rows], non_blocking=True)
            for x, s in cached.items():
                for dst, src in zip(buffer, cache.banks, strict=True):
                    dst[x].copy_(src[s], non_blocking=True)

        if self.copy_stream is None:
            copy()
        else:
            if self.free[b] is not None:  # kernels still reading this buffer's old layer
                self.copy_stream.wait_event(self.free[b])
            with torch.cuda.stream(self.copy_stream):
                copy()
                self.ready[b] = torch.cuda.Event()
                self.ready[b].record()
        self.loaded[b] = moe_layer
        if chunk is not None:
            chunk["bytes_h2d"] += len(uncached) * store.shape.nbytes
            chunk["bytes_d2d"] += len(cached) * store.shape.nbytes

    def forward(
        self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """All routes of a long chunk at `moe_layer`, from the streamed buffer; prefetches the
        next layer into the other buffer meanwhile."""
        if moe_layer == 0 or self._chunk is None:
            self._begin(x.shape[0])
        b = moe_layer % 2
        if self.loaded[b] != moe_layer:
            self._load(moe_layer)  # first layer of a chunk (or a skipped prefetch): on demand
        stream = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        if stream is not None:
            # The GPU's idle time waiting for this layer's copies: events around the wait.
            before, after = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            before.record(stream)
            stream.wait_event(self.ready[b])
            after.record(stream)
            self._chunk["waits"].append((before, after))
        w = expert_weights(
            dict(zip(self.store.named_banks, self.buffers[b], strict=True)),
            *self.store.formats.values(),
        )
        out = grouped_expert_forward(x, ids, weights, w.gate_up, w.down, self.act, w.bias)
        if stream is not None:
            self.free[b] = torch.cuda.Event()
            self.free[b].record(stream)
        self._warm_decode_cache(moe_layer, ids[-1])
        nxt = moe_layer + 1
        if nxt >= self.store.num_layers:
            self._end()
        elif self.overlap:
            self._load(nxt)
        return out

    def _warm_decode_cache(self, moe_layer: int, last_ids: torch.Tensor) -> None:
        """Leave the experts the chunk's last token routed to in the decode cache."""
        cache = self.cache
        if cache is None or cache.policy is None:
            return
        e = self.store.num_experts
        pairs = [moe_layer * e + x for x in sorted(set(last_ids.tolist()))]
        missing = [p for p in pairs if cache.slot_of[p] < 0]
        if not missing or len(missing) > cache.num_slots:
            return
        hit_slots = cache.slot_of[[p for p in pairs if p not in missing]]
        victims = cache.victim_candidates(moe_layer, hit_slots, len(missing))
        buffer = self.buffers[moe_layer % 2]
        sources = [tuple(bank[p - moe_layer * e] for bank in buffer) for p in missing]
        # Ordered after the buffer's copies (same stream) and after the compute queued before
        # this chunk began, which is all that could still read the victims.
        cache.place_from(missing, victims.tolist(), sources, after=self._chunk.get("began"))
        self._chunk["bytes_d2d"] += len(missing) * self.store.shape.nbytes

    def _begin(self, tokens: int) -> None:
        self._chunk = dict(
            tokens=tokens,
            start=time.perf_counter(),
            bytes_h2d=0,
            bytes_d2d=0,
            copy_wait_s=0.0,
            began=None,
            waits=[],
        )
        if self.copy_stream is not None:
            began = torch.cuda.Event()
            began.record(torch.cuda.current_stream(self.device))
            self._chunk["began"] = began

    def _end(self) -> None:
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            return
        if self.copy_stream is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_stream(self.copy_stream)  # decode may read the warmed cache slots
            stream.synchronize()
            chunk["copy_wait_s"] = sum(a.elapsed_time(b) for a, b in chunk["waits"]) / 1e3
        chunk.pop("waits")
        chunk.pop("began")
        chunk["seconds"] = time.perf_counter() - chunk.pop("start")
        c = self.counters
        c.chunks += 1
        c.tokens += chunk["tokens"]
        c.seconds += chunk["seconds"]
        c.bytes_h2d += chunk["bytes_h2d"]
        c.bytes_d2d += chunk["bytes_d2d"]
        c.copy_wait_s += chunk["copy_wait_s"]
        c.history = [*c.history[-31:], chunk]
