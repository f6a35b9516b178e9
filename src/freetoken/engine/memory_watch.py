"""Device memory moving at run time, checked between steps every `every` steps (one
`cudaMemGetInfo`), so a decode step's host work does not grow:

- pressure: when another process takes VRAM, the expert cache gives slots back (serving goes
  on with fewer experts on the GPU, outputs unchanged); when the memory is free again, it
  takes them back, up to the size it was given;
- KV short: when requests wait for KV pages (preempted for older ones), the KV pool grows by
  a quarter of its size at load, from free memory where there is enough, else with memory the
  expert cache lends (slots given up, down to its floor); when the pool is back under half of
  its size at load in use and no request waits, it shrinks to that size and the cache takes
  back what it lent. Each move is logged and counted in /v1/stats `memory_watch`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# Free device memory the watch keeps: below it the cache shrinks, above twice it the cache
# grows back (the gap keeps it from swinging with small allocations).
RESERVE_BYTES = 1 << 30
CHECK_EVERY = 32  # steps
FLOOR_FRACTION = 0.25  # of the cache's size at load: the least it gives up to
# checks after a KV move before the next one: lending and returning cost a cache re-fill
QUIET_CHECKS = 8


class DeviceMemoryWatch:
    def __init__(
        self,
        engine,
        free_bytes: Callable[[], int] | None = None,
        reserve_bytes: int = RESERVE_BYTES,
        every: int = CHECK_EVERY,
        floor_fraction: float = FLOOR_FRACTION,
    ):
        """`engine`: the LLMEngine whose runner's memory moves (it says when requests wait
        for KV pages); `free_bytes`: the device's free memory (default: cudaMemGetInfo)."""
        runner = engine.runner
        moe = runner.moe
        self.engine, self.runner = engine, runner
        self.free_bytes = free_bytes or (lambda: torch.cuda.mem_get_info(runner.device)[0])
        self.reserve, self.every = reserve_bytes, every
        self.target = moe.cache.num_slots  # what it was given; it grows back up to this
        self.floor_fraction = floor_fraction
        self.floor = max(1, int(self.target * floor_fraction))
        self.expert_bytes = moe.store.shape.nbytes
        self.kv_pages = runner.kv.num_pages  # the KV pool's size at load: its floor
        self.lent = 0  # cache slots now lent to the KV pool
        self._preemptions = engine.preemptions
        self._quiet_until = 0  # no KV move before this step (one settles before the next)
        self.steps = self.shrinks = self.grows = self.kv_grows = self.lends = self.returns = 0
        self.failures = 0

    @classmethod
    def for_engine(cls, engine) -> DeviceMemoryWatch | None:
        """A watch where there is device memory to watch and a cache that can give it back."""
        runner = engine.runner
        moe = runner.moe
        if runner.device.type != "cuda" or moe is None or not moe.kind.fills:
            return None
        return cls(engine)

    def check(self) -> None:
        """Between steps: every `every`-th call, follow the device's free memory and the KV
        pool's needs. A move that finds no memory is logged and tried again later; it never
        fails the step."""
        self.steps += 1
        if self.steps % self.every:
            return
        try:
            self._follow()
        except ValueError as e:  # no device memory for a re-size: serving goes on as it is
            self.failures += 1
            log.warning("a memory move failed, tried again later: %s", e)

    def _follow(self) -> None:
        slots, free = self.runner.moe.cache.num_slots, self.free_bytes()
        waiting = bool(self.engine.preempted) or self.engine.preemptions > self._preemptions
        self._preemptions = self.engine.preemptions
        settled = self.steps >= self._quiet_until  # the KV pool's moves wait for each other
        if free < self.reserve and slots > self.floor:
            give = -(-(self.reserve - free) // self.expert_bytes)
            new = max(self.floor, slots - give)
            log.warning(
                "device memory is short (%.2f GiB free): the expert cache gives back %d of its "
                "%d slots",
                free / 2**30,
                slots - new,
                slots,
            )
            self.runner.resize_expert_cache(new)
            self.shrinks += 1
        elif waiting:
            if settled:
                self._grow_kv(free)
        elif free > 2 * self.reserve and slots < self.target - self.lent:
            take = (free - 2 * self.reserve) // self.expert_bytes
            new = min(self.target - self.lent, slots + take)
            if new > slots:
                log.info("device memory is free again: the expert cache grows to %d slots", new)
                self.runner.resize_expert_cache(new)
                self.grows += 1
        elif settled and self.runner.kv.num_pages > self.kv_pages and self._kv_idle():
            self._return_kv()

    def rebase(self) -> None:
        """Take the current split as the one to keep (after an operator's re-split)."""
        self.target = self.runner.moe.cache.num_slots
        self.floor = max(1, int(self.target * self.floor_fraction))
        self.kv_pages, self.lent = self.runner.kv.num_pages, 0

    def _grow_kv(self, free: int) -> None:
        """Requests wait for KV pages: a quarter more pages, from free memory, else lent by
        the expert cache (down to its floor), keeping one slot's worth free as headroom."""
        kv, cache = self.runner.kv, self.runner.moe.cache
        want = max(1, self.kv_pages // 4)
        spare = max(0, free - self.reserve) // kv.page_bytes
        self._quiet_until = self.steps + QUIET_CHECKS * self.every
        if spare >= want:
            log.info("requests wait for KV pages: the KV pool grows by %d pages", want)
            self.engine.resize_kv_pages(kv.num_pages + want)
            self.kv_grows += 1
            return
        need = -(-(want - spare) * kv.page_bytes // self.expert_bytes)
        give = min(cache.num_slots - self.floor, need + 1)
        if give <= 0:
            return  # the cache is at its floor: requests wait as before
        self.runner.resize_expert_cache(cache.num_slots - give)
        self.lent += give
        headroom = 1 if give > 1 else 0
        pages = spare + (give - headroom) * self.expert_bytes // kv.page_bytes
        log.warning(
            "requests wait for KV pages: the expert cache lends %d slots, the KV pool grows by "
            "%d pages",
            give,
            pages,
        )
        self.engine.resize_kv_pages(kv.num_pages + pages)
        self.lends += 1

    def _kv_idle(self) -> bool:
        """Whether requests hold under half the pool's size at load (cached prefixes count as
        free: a shrink evicts them) and none above it (which a shrink cannot give up)."""
        kv, engine = self.runner.kv, self.engine
        cached = engine.prefix_cache.num_evictable if engine.prefix_cache is not None else 0
        held = kv.num_pages - kv.allocator.num_free - cached
        seqs = [r.seq for r in (*engine.running, *engine.preempted)]
        high = any(page >= self.kv_pages for seq in seqs for page in seq.pages)
        return held < self.kv_pages // 2 and not high

    def _return_kv(self) -> None:
        """The KV pool back to its size at load, and lent slots back to the cache (or, if the
        device lacks the memory then, to the growth that follows free memory)."""
        self._quiet_until = self.steps + QUIET_CHECKS * self.every
        self.engine.resize_kv_pages(self.kv_pages)
        log.info("the KV pool is back to %d pages", self.kv_pages)
        lent, self.lent = self.lent, 0
        if lent:
            log.info("the expert cache takes back the %d slots it lent", lent)
            self.returns += 1
            self.runner.resize_expert_cache(self.runner.moe.cache.num_slots + lent)

    def snapshot(self) -> dict:
        return {
            "target_slots": self.target,
            "floor_slots": self.floor,
            "shrinks": self.shrinks,
            "grows": self.grows,
            "kv_pages_at_load": self.kv_pages,
            "kv_grows": self.kv_grows,
            "lent_slots": self.lent,
            "lends": self.lends,
            "returns": self.returns,
            "failed_moves": self.failures,
        }
