"""Copies of missed experts into the cache's slots, both ways a layer step makes them.

Decided on the device (moe/device_control.py), the plan's fill list is copied by one
device-launched kernel reading the pinned host pool where it lies (kernels/expert_fill.py), so
a decode graph holds it. Decided on the host, the victims are chosen on the host tables and
the copies queued on the copy stream by one native call (ExpertCache.place); the current
stream waits for them, and one fill in a few is timed for the bandwidth tracker.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.kernels.expert_fill import HostRows, fill_experts, fill_table
from freetoken.moe.cache import ExpertCache
from freetoken.moe.split import BandwidthTracker
from freetoken.moe.store import HostExpertStore


class Fills:
    def __init__(self, store: HostExpertStore, device: torch.device, tracker: BandwidthTracker):
        self.device, self.tracker = device, tracker
        self.expert_bytes = store.shape.nbytes
        # the host pool as the device-launched fills read it (by address on CUDA)
        self._pool = store.banks
        if device.type == "cuda":
            self._pool = tuple(HostRows(bank) for bank in self._pool)
        self._pending_timings: list[tuple] = []  # (start, done, bytes) of timed copies
        self.cache: ExpertCache | None = None
        self._banks: tuple = ()

    def bind(self, cache: ExpertCache | None) -> None:
        """Fill `cache` from now on."""
        self.cache = cache
        if cache is not None:
            self._banks = tuple(zip(cache.banks, self._pool, strict=True))
            # the fill kernel's table, built here once (a graph capture could not build it)
            self._table = fill_table(self._banks) if cache.device.type == "cuda" else None

    def release(self) -> None:
        """Drop the references to the cache's banks (before a re-size, so they may be freed
        before the new ones are made)."""
        self._banks = ()

    def launch(self, fill_pairs: torch.Tensor, fill_slots: torch.Tensor) -> None:
        """The device plan's copies (`DeviceControl.plan`'s fill list), queued on the device."""
        fill_experts(self._banks, fill_pairs, fill_slots, self.cache.num_slots, self._table)

    def place(self, moe_layer: int, fill: np.ndarray, protected: np.ndarray) -> None:
        """Copy the pairs `fill` into victims' slots (never one of `protected`, the slots this
        layer step's hits read), the current stream waiting for the copies."""
        cache = self.cache
        victims = cache.victim_candidates(moe_layer, protected, len(fill))
        # The round trip synchronised the stream: no kernel queued can still read a victim.
        events = cache.place(fill.tolist(), victims.tolist(), after_compute=False)
        fill_bytes = len(fill) * self.expert_bytes
        if events is not None:
            torch.cuda.current_stream(self.device).wait_event(events[1])
            if events[0] is not None:  # a timed fill
                self._pending_timings.append((*events, fill_bytes))
        else:
            self.tracker.observe_fill(fill_bytes, cache.last_fill_seconds)

    def drain_timings(self) -> None:
        """Fold finished copies' measured bandwidth into the running average (no waiting)."""
        keep = []
        for start, done, nbytes in self._pending_timings:
            if done.query():
                self.tracker.observe_fill(nbytes, start.elapsed_time(done) / 1e3)
            else:
                keep.append((start, done, nbytes))
        self._pending_timings = keep
