"""Device memory moving at run time (engine/memory_watch.py), with the device's free memory
scripted on the CPU tier: when it runs short the expert cache gives slots back, down to its
floor; when it is free again the cache grows back to the size it was given; when requests
wait for KV pages the pool grows, from free memory or with slots the cache lends, and gives
them back once it is idle; greedy outputs never change."""

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
    watch = DeviceMemoryWatch(engine, free_bytes=lambda: free["bytes"],
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
    assert DeviceMemoryWatch.for_engine(engine) is None  # no device memory on the CPU


@pytest.mark.parametrize("source", ["free memory", "the expert cache"])
def test_requests_short_of_kv_pages_get_them_and_give_them_back(source):
    """Three requests that together need more pages than the pool has: they are preempted in
    turn until the watch grows the pool (from free memory, or with slots the cache lends);
    once they end and the pool is idle it returns to its size, and the cache takes its slots
    back. The outputs are those of a pool large enough from the start."""
    small = demo_engine(kv_cache_tokens=96)  # 6 pages of 16 tokens
    big = demo_engine()
    prompts = [small.tokenizer.encode(f"Request number {i} asks for pages") for i in range(3)]
    params = SamplingParams(max_new_tokens=40, temperature=0)
    reference = [o.output_ids for o in big.generate(prompts, params)]
    moe, kv = small.runner.moe, small.runner.kv
    per_page = kv.page_bytes
    free = {"bytes": (100 if source == "free memory" else 0) * per_page}
    watch = DeviceMemoryWatch(small, free_bytes=lambda: free["bytes"], reserve_bytes=0, every=1)
    small.memory_watch = watch
    outputs = [o.output_ids for o in small.generate(prompts, params)]
    assert outputs == reference
    assert small.preemptions > 0 and kv.num_pages > watch.kv_pages
    if source == "free memory":
        assert watch.kv_grows >= 1 and watch.lends == 0 and moe.cache.num_slots == watch.target
    else:
        assert watch.lends >= 1 and watch.lent > 0
        assert moe.cache.num_slots == watch.target - watch.lent >= watch.floor
    for _ in range(3):  # idle steps: the pool goes back, the cache takes its slots back
        small.step()
    assert kv.num_pages == watch.kv_pages and moe.cache.num_slots == watch.target
    assert watch.lent == 0 and watch.returns == (source == "the expert cache")
    again = [o.output_ids for o in small.generate(prompts, params)]
    assert again == reference
