"""Device memory pressure (engine/memory_watch.py), with the device's free memory scripted on
the CPU tier: when it runs short the expert cache gives slots back, down to its floor; when it
is free again the cache grows back to the size it was given; greedy outputs never change."""

from __future__ import annotations

import pytest

from freetoken.engine.memory_watch import DeviceMemoryWatch
from freetoken.engine.sampling import SamplingParams
from server_fixtures import demo_engine


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


def test_the_cache_gives_slots_back_under_pressure_and_takes_them_back(engine):
    prompt = engine.tokenizer.encode("Pressure on the device")
    params = SamplingParams(max_new_tokens=24, temperature=0)
    reference = engine.generate([prompt], params)[0].output_ids
    moe = engine.runner.moe
    per = moe.store.shape.nbytes
    free = {"bytes": 10 * per}
    watch = DeviceMemoryWatch(engine.runner, free_bytes=lambda: free["bytes"],
                              reserve_bytes=10 * per, every=2)  # fmt: skip
    assert watch.target == moe.cache.num_slots == 40 and watch.floor == 10
    engine.memory_watch = watch
    try:
        free["bytes"] = 4 * per  # 6 experts short of the reserve
        for _ in range(2):
            engine.step()
        assert moe.cache.num_slots == 34 and watch.shrinks == 1
        free["bytes"] = 0  # far short: down to the floor, no further
        assert engine.generate([prompt], params)[0].output_ids == reference
        assert moe.cache.num_slots == watch.floor
        free["bytes"] = 100 * per  # free again: back to what it was given
        assert engine.generate([prompt], params)[0].output_ids == reference
        assert moe.cache.num_slots == watch.target and watch.grows >= 1
    finally:
        engine.memory_watch = None
    assert DeviceMemoryWatch.for_runner(engine.runner) is None  # no device memory on the CPU
