"""The device expert cache: ONE pool of slots shared by every MoE layer.

A slot holds every tensor of one expert (a row of each bank) in device memory. The tables,
`slot_of[pair]` (-1 when not cached) and `pair_of[slot]` (-1 when empty), live on the host
for the calls the host decides, after the one round trip that tells it which experts were
routed: the lookup, the rewrite to slot ids and the policy's victim choice run there as numpy
ops on the host tables (about a microsecond each; a torch op on a tiny tensor costs 5-10 on
the host). Decode calls of `offload` and `hybrid` are decided on the device instead, on device
copies of these tables (moe/device_control.py), which are synchronised with these around
every host-decided call.
Which slot to give up is the eviction policy's call (`moe/policy.py`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from freetoken.kernels.grouped_experts import grouped_expert_forward
from freetoken.kernels.host_copies import HostToDeviceCopier
from freetoken.moe.store import BanksByName, HostExpertStore
from freetoken.weights.expert_format import ExpertWeights, expert_weights


def warm_order(store: HostExpertStore) -> list[int]:
    """The pairs a warm cache starts with, in the order they take slots: expert 0 of every
    layer, then expert 1, ..., so a partial fill gives every layer the same share."""
    L, E = store.num_layers, store.num_experts
    return [layer * E + expert for expert in range(E) for layer in range(L)]


def host_array(values) -> np.ndarray:
    """A policy's scores as numpy: its state may live on the device (device control)."""
    if isinstance(values, torch.Tensor):
        return values.cpu().numpy()
    return np.asarray(values)


# One fill in this many is timed for the bandwidth tracker (see `_on_copy_stream`).
TIME_FILLS_EVERY = 8


ROOM_MARGIN = 512 * 2**20  # device memory a re-size leaves free beyond the new banks


class ExpertCache(BanksByName):
    def __init__(
        self,
        store: HostExpertStore,
        num_slots: int,
        device: torch.device,
        policy=None,
        banks: tuple[torch.Tensor, ...] | None = None,
    ):
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.store = store
        self.device = device
        self.num_slots = num_slots
        if banks is None:  # a row of each of the store's banks per slot
            banks = tuple(
                torch.empty(num_slots, *host.shape[1:], dtype=host.dtype, device=device)
                for host in store.banks
            )
        self.banks: tuple[torch.Tensor, ...] | None = banks
        self.slot_of = torch.full((store.num_pairs,), -1, dtype=torch.long)
        self.pair_of = torch.full((num_slots,), -1, dtype=torch.long)
        self.policy = policy
        if policy is not None:
            policy.reset(store.num_layers, store.num_experts, num_slots, torch.device("cpu"))
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._unsettled: torch.cuda.Event | None = None  # fills not waited for (`preload`)
        self.last_fill_seconds = 0.0  # CPU-tier copies: measured directly
        # Fills from the host pool: (host address, device address, bytes) of each bank's row 0,
        # for the native copier; torch copies where it is not available.
        self._copier, self._rows = None, []
        if self.copy_stream is not None:
            self._copier = HostToDeviceCopier.create()
            self._queued, self._filled = torch.cuda.Event(), torch.cuda.Event()
            self._fills = 0
            for host, dev in zip(store.banks, self.banks, strict=True):
                if not (host.is_contiguous() and dev.is_contiguous()):
                    self._copier = None
                row = dev[0].numel() * dev.element_size()
                self._rows.append((host.data_ptr(), dev.data_ptr(), row))

    @property
    def named_banks(self) -> dict[str, torch.Tensor]:
        """The slots' banks by the store's names (empty once the banks were freed)."""
        return dict(zip(self.store.named_banks, self.banks or (), strict=False))

    @property
    def weights(self) -> ExpertWeights:
        """The slots' projections, for the GPU kernels (by slot id)."""
        return expert_weights(self.named_banks, *self.store.formats.values())

    def compute(self, x, slots, weights, act: str) -> torch.Tensor:
        """The routes of `slots` [T, k] (-1: computed elsewhere) over the experts in them,
        gate-weighted and summed per token: the grouped kernel (kernels/grouped_experts.py)."""
        w = self.weights
        return grouped_expert_forward(x, slots, weights, w.gate_up, w.down, act, w.bias)

    @classmethod
    def resident(cls, store: HostExpertStore, device: torch.device) -> ExpertCache:
        """Every expert in its own slot (slot == flat id): the `fused` placement. On the CPU the
        host banks are used as they are, with no copy."""
        banks = store.banks if device.type == "cpu" else None
        cache = cls(store, store.num_pairs, device, banks=banks)
        if banks is None:
            for dev, host in zip(cache.banks, store.banks, strict=True):
                dev.copy_(host)
        ids = torch.arange(store.num_pairs)
        cache.slot_of.copy_(ids)
        cache.pair_of.copy_(ids)
        return cache

    def victim_candidates(self, moe_layer: int, protected, count: int) -> np.ndarray:
        """The `count` slots the policy would give up first (in no particular order). Empty
        slots come first (their score is -inf); `protected` slots (those the current layer hits:
        its kernel reads them this step) are never candidates."""
        pair_of = self.pair_of.numpy()
        if self.policy is None:
            scores = (pair_of >= 0).astype(np.float32)
        else:
            scores = host_array(self.policy.slot_scores(moe_layer, pair_of)).astype(np.float32)
        scores[np.asarray(protected, dtype=np.int64)] = np.inf
        if count >= len(scores):
            return np.argsort(scores, kind="stable")[:count]
        return np.argpartition(scores, count - 1)[:count]

    def place(self, pairs: Sequence[int], slots: Sequence[int], after_compute: bool = True):
        """Put `pairs` into `slots`, copying from the host pool. Returns (start, done) copy
        events on CUDA (start None where the copy is not timed), None on the CPU tier (copied
        on return). The copies wait for the compute queued so far, which may still read the
        victims, unless `after_compute` is False (the caller has synchronised the stream)."""
        self._retable(pairs, slots)
        if self._copier is not None:
            return self._copy_rows(pairs, slots, after_compute)
        sources = [tuple(bank[p] for bank in self.store.banks) for p in pairs]
        return self._copy(slots, sources, wait=after_compute)

    def _copy_rows(self, pairs: Sequence[int], slots: Sequence[int], after_compute: bool):
        """`place`'s copies as one native call: each bank's row of each pair, by address."""
        pairs = np.asarray(pairs, dtype=np.uint64)
        slots = np.asarray(slots, dtype=np.uint64)
        src = np.concatenate([host + pairs * row for host, _, row in self._rows])
        dst = np.concatenate([dev + slots * row for _, dev, row in self._rows])
        nbytes = np.repeat([row for _, _, row in self._rows], len(pairs))
        enqueue = lambda: self._copier.copy(dst, src, nbytes, self.copy_stream)
        return self._on_copy_stream(enqueue, wait=after_compute)

    def _on_copy_stream(self, enqueue, after=None, wait: bool = True):
        """Queue copies (`enqueue()`) on the copy stream, after the event `after`, or by
        default after all compute queued so far (a victim may still be read by it; `wait`
        False: nothing queued can, so no ordering at all). Returns
        (start, done) events: every `TIME_FILLS_EVERY`-th call is timed (fresh timing events,
        for the bandwidth tracker); the others return (None, done) with a reused event, since
        under gVisor each event created, recorded or waited on costs 5-15 us of host time."""
        if wait and after is None:
            self._queued.record(torch.cuda.current_stream(self.device))
            after = self._queued
        if wait:
            self.copy_stream.wait_event(after)
        self._fills += 1
        start, done = None, self._filled
        if self._fills % TIME_FILLS_EVERY == 1:
            start = torch.cuda.Event(enable_timing=True)
            done = torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
        enqueue()
        done.record(self.copy_stream)
        return start, done

    def place_from(self, pairs, slots, sources, after=None):
        """Like `place`, copying from device tensors (`sources`: a row of each bank). On
        CUDA the copies follow `after` (an event) instead of all queued compute."""
        self._retable(pairs, slots)
        return self._copy(slots, sources, after)

    def _retable(self, pairs: Sequence[int], slots: Sequence[int]) -> None:
        slot_of, pair_of = self.slot_of.numpy(), self.pair_of.numpy()  # views: no torch ops
        for p, s in zip(pairs, slots, strict=True):
            old = pair_of[s]
            if old >= 0:
                slot_of[old] = -1
            pair_of[s] = p
            slot_of[p] = s

    def _copy(self, slots, sources, after=None, wait: bool = True):
        if self.copy_stream is None:
            start = time.perf_counter()
            for s, rows in zip(slots, sources, strict=True):
                for bank, row in zip(self.banks, rows, strict=True):
                    bank[s].copy_(row)
            self.last_fill_seconds = time.perf_counter() - start
            return None

        def enqueue():
            with torch.cuda.stream(self.copy_stream):
                for s, rows in zip(slots, sources, strict=True):
                    for bank, row in zip(self.banks, rows, strict=True):
                        bank[s].copy_(row, non_blocking=True)

        return self._on_copy_stream(enqueue, after, wait)

    def resized(self, num_slots: int, refill: Sequence[int] = ()) -> ExpertCache:
        """A cache of `num_slots` slots holding what this one holds that its policy would keep
        longest (all of it when it fits), the rest of its slots filled with the first pairs of
        `refill` not already held. The policy and its state carry over. Where device memory
        holds both caches at once, what is kept is copied device to device; where it does not
        (the device is short of memory: why a cache shrinks), this cache's banks are freed
        first and what it kept comes back from the host pool, in as many slots as the device
        then holds if fewer. This cache is unusable after that."""
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.settle()
        pair_of = self.pair_of.numpy()
        held = np.flatnonzero(pair_of >= 0)
        if len(held) > num_slots and self.policy is not None:
            # the policy's keep-scores choose what stays, as at layer 0, where a step starts
            scores = host_array(self.policy.slot_scores(0, pair_of))[held]
            held = np.sort(held[np.argsort(-scores, kind="stable")[:num_slots]])
        held = held[:num_slots]
        kept = pair_of[held].tolist()
        if self._room_for(num_slots):
            try:
                return self._resized_beside(num_slots, held, kept, refill)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()  # (the estimate was wrong: free this cache first)
        self.banks = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            # what the device holds once these banks are gone, if less than asked for
            free, _ = torch.cuda.mem_get_info(self.device)
            fit = (free - ROOM_MARGIN) // self.store.shape.nbytes
            if fit < num_slots:
                if fit < 1:
                    raise torch.cuda.OutOfMemoryError("no device memory for one expert slot")
                num_slots = int(fit)
        new = ExpertCache(self.store, num_slots, self.device)
        new.policy = self.policy  # (made without one: the constructor would reset its state)
        kept_set = set(kept)
        new._fill(kept + [p for p in refill if p not in kept_set], 0)
        return new

    def _resized_beside(self, num_slots, held, kept, refill) -> ExpertCache:
        """`resized` with both caches in device memory: what is kept copied device to device."""
        new = ExpertCache(self.store, num_slots, self.device)
        new.policy = self.policy  # (made without one: the constructor would reset its state)
        keep = torch.as_tensor(held, dtype=torch.long)
        if len(keep):
            index = keep.to(self.device)
            for old_bank, new_bank in zip(self.banks, new.banks, strict=True):
                # straight into the new bank's first rows: no third copy in device memory
                torch.index_select(old_bank, 0, index, out=new_bank[: len(keep)])
            new._retable(kept, list(range(len(keep))))
        kept_set = set(kept)
        new._fill([p for p in refill if p not in kept_set], len(keep))
        return new

    def _fill(self, pairs: list[int], first: int, wait: bool = True) -> None:
        """Copy `pairs` from the host pool into slots first, first + 1, ... (as many as fit);
        `wait` False: return while the copies run (`settle` waits for them)."""
        pairs = pairs[: self.num_slots - first]
        if pairs:
            events = self.place(pairs, list(range(first, first + len(pairs))))
            if events is not None:
                if wait:
                    events[1].synchronize()
                else:
                    self._unsettled = events[1]

    def settle(self) -> None:
        """Wait for the fills `preload` left running (before anything reads the slots)."""
        if self._unsettled is not None:
            self._unsettled.synchronize()
            self._unsettled = None

    def _room_for(self, num_slots: int) -> bool:
        """Whether the device has memory for banks of `num_slots` beside this cache's, with
        a margin for the step's activations (the caller has given cached blocks back)."""
        if self.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.device)
        return num_slots * self.store.shape.nbytes + ROOM_MARGIN <= free

    def preload(self, pairs: Sequence[int], wait: bool = True) -> None:
        """Fill empty slots with `pairs` in order (a static placement, or a warm start).
        `wait` False: the copies run on while the caller goes on (a warm start's 8 GiB take
        0.16 s of the link, while the start's Python has more to do), and `settle()` waits for
        them before the first step reads the slots."""
        self._fill(list(pairs), 0, wait)
