"""Device memory pressure: when another process takes VRAM, the expert cache gives slots back
(serving goes on with fewer experts on the GPU, outputs unchanged); when the memory is free
again, it takes them back, up to the size it was given. Checked between steps, every
`every` steps (one `cudaMemGetInfo`), so a decode step's host work does not grow."""

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


class DeviceMemoryWatch:
    def __init__(
        self,
        runner,
        free_bytes: Callable[[], int] | None = None,
        reserve_bytes: int = RESERVE_BYTES,
        every: int = CHECK_EVERY,
        floor_fraction: float = FLOOR_FRACTION,
    ):
        """`free_bytes`: the device's free memory (default: cudaMemGetInfo)."""
        moe = runner.moe
        self.runner = runner
        self.free_bytes = free_bytes or (lambda: torch.cuda.mem_get_info(runner.device)[0])
        self.reserve, self.every = reserve_bytes, every
        self.target = moe.cache.num_slots  # what it was given; it grows back up to this
        self.floor = max(1, int(self.target * floor_fraction))
        self.expert_bytes = moe.store.shape.nbytes
        self.steps = self.shrinks = self.grows = 0

    @classmethod
    def for_runner(cls, runner) -> DeviceMemoryWatch | None:
        """A watch where there is device memory to watch and a cache that can give it back."""
        moe = runner.moe
        if runner.device.type != "cuda" or moe is None or not moe.kind.fills:
            return None
        return cls(runner)

    def check(self) -> None:
        """Between steps: every `every`-th call, follow the device's free memory."""
        self.steps += 1
        if self.steps % self.every:
            return
        slots, free = self.runner.moe.cache.num_slots, self.free_bytes()
        if free < self.reserve and slots > self.floor:
            give = -(-(self.reserve - free) // self.expert_bytes)
            new = max(self.floor, slots - give)
            log.warning(
                "device memory is short (%.2f GiB free): the expert cache gives back %d of its "
                "%d slots", free / 2**30, slots - new, slots,
            )  # fmt: skip
            self.runner.resize_expert_cache(new)
            self.shrinks += 1
        elif free > 2 * self.reserve and slots < self.target:
            take = (free - 2 * self.reserve) // self.expert_bytes
            new = min(self.target, slots + take)
            if new > slots:
                log.info("device memory is free again: the expert cache grows to %d slots", new)
                self.runner.resize_expert_cache(new)
                self.grows += 1

    def snapshot(self) -> dict:
        return {"target_slots": self.target, "floor_slots": self.floor,
                "shrinks": self.shrinks, "grows": self.grows}  # fmt: skip
