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
    watch = DeviceMemoryWatch(
        engine, free_bytes=lambda: free["bytes"], reserve_bytes=10 * per, every=2
    )
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
    for _ in range(12):  # idle steps: once the last move settled, the pool goes back
        small.step()
    assert kv.num_pages == watch.kv_pages and moe.cache.num_slots == watch.target
    assert watch.lent == 0 and watch.returns == (source == "the expert cache")
    again = [o.output_ids for o in small.generate(prompts, params)]
    assert again == reference


def test_a_move_without_memory_is_tried_later_and_never_fails_a_step(engine, monkeypatch):
    moe = engine.runner.moe
    per = moe.store.shape.nbytes
    free = {"bytes": 0}
    watch = DeviceMemoryWatch(
        engine, free_bytes=lambda: free["bytes"], reserve_bytes=10 * per, every=1
    )

    def no_memory(size):
        raise ValueError("no device memory for an expert cache of 3")

    monkeypatch.setattr(engine.runner, "resize_expert_cache", no_memory)
    engine.memory_watch = watch
    try:
        prompt = engine.tokenizer.encode("Short of memory")
        out = engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0))
        assert len(out[0].output_ids) == 4  # served all the same
        assert watch.failures >= 1 and watch.shrinks == 0
    finally:
        engine.memory_watch = None


def test_an_operators_re_split_is_the_one_the_watch_keeps(engine):
    moe, kv = engine.runner.moe, engine.runner.kv
    watch = DeviceMemoryWatch(engine, free_bytes=lambda: 2**40, every=1)
    engine.memory_watch = watch
    slots, pages = moe.cache.num_slots, kv.num_pages
    try:
        engine.resize(experts=slots - 8, kv=str((pages + 4) * kv.page_size))
        assert (watch.target, watch.kv_pages) == (slots - 8, pages + 4)
        prompt = engine.tokenizer.encode("Keep my split")
        engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0))
        # plenty of free memory, an idle pool: neither goes back to the sizes at load
        assert (moe.cache.num_slots, kv.num_pages) == (slots - 8, pages + 4)
    finally:
        engine.memory_watch = None
        engine.resize(experts=slots, kv=str(pages * kv.page_size))


def test_a_pool_with_a_request_above_its_size_at_load_is_not_idle(engine):
    allocator = engine.runner.kv.allocator
    watch = DeviceMemoryWatch(engine, free_bytes=lambda: 2**40, every=1)
    low = allocator.alloc(10)  # the low page ids taken: the request's pages come above them
    req = engine.add_request(
        engine.tokenizer.encode("hold pages " * 12), SamplingParams(max_new_tokens=2, temperature=0)
    )
    try:
        engine.step()
        allocator.free(low)
        watch.kv_pages = 8  # as if the pool had grown from 8 pages
        assert min(req.seq.pages) >= 10
        assert not watch._kv_idle()  # few pages held, but above 8: a shrink cannot free them
        engine.abort(req)
        assert watch._kv_idle()
    finally:
        if req in engine.running:
            engine.abort(req)
