"""`ft ctl status` against a running server: the expert cache against the pool, its hit rate
and split, KV use; the API key honoured; a clear error where no server answers."""

from __future__ import annotations

import json

import httpx
import pytest

from freetoken.cli.main import main
from server_fixtures import MODEL, demo_engine, running_server


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


def test_status_shows_the_split_the_hit_rate_and_kv_use(engine, capsys):
    from freetoken.engine.memory_watch import DeviceMemoryWatch

    # (a watch of scripted free memory: the CPU tier has none, and its counts show)
    engine.memory_watch = DeviceMemoryWatch(engine, free_bytes=lambda: 2**40, every=10**6)
    with running_server(engine, api_key="sekret") as (base, _core):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
        auth = {"Authorization": "Bearer sekret"}
        reply = httpx.post(base + "/v1/completions", headers=auth, json=body, timeout=60)
        assert reply.status_code == 200  # some MoE traffic
        assert main(["ctl", "status", "--url", base, "--api-key", "sekret"]) == 0
        text = capsys.readouterr().out
        moe = engine.runner.moe
        assert f"hybrid: cache of {moe.cache.num_slots} of {moe.store.num_pairs} experts" in text
        assert "hit rate" in text and "on the CPU (m - q)" in text and "prefetched" in text
        assert "pages in use" in text and "16 tokens a page" in text
        assert "expert cache 0 shrinks, 0 grows (at most 40, at least 10 slots)" in text
        assert main(["ctl", "status", "--url", base, "--api-key", "sekret", "--json"]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["moe"]["cache_slots"] == moe.cache.num_slots
        assert stats["moe"]["cache_bytes"] == moe.cache.num_slots * moe.store.shape.nbytes
        # without the key: a clear error, not a traceback
        assert main(["ctl", "status", "--url", base]) == 2
        assert "wants an API key" in capsys.readouterr().err
    engine.memory_watch = None


def test_status_without_a_server_says_so(capsys):
    assert main(["ctl", "status", "--url", "http://127.0.0.1:9"]) == 2
    assert "no server answers at http://127.0.0.1:9" in capsys.readouterr().err


def test_the_expert_cache_resizes_under_running_requests(engine, capsys):
    """`ft ctl cache` shrinks and grows the expert cache of a running server between steps:
    greedy requests before, during and after give what they give at a fixed size, and none
    fails; a size that cannot be is refused in the API's error shape."""
    import threading
    import time

    prompts = ["The cache", "Experts move", "A third prompt here"]

    def complete(base, prompt, n=40):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    with running_server(engine) as (base, core):
        fixed = [complete(base, p) for p in prompts]  # at the demo engine's 40 slots
        assert complete(base, prompts[0]) == fixed[0]
        result = {}
        during = threading.Thread(target=lambda: result.update(b=complete(base, prompts[1], 40)))
        during.start()
        deadline = time.monotonic() + 30
        while core.scheduler.stats().running == 0:  # resized while it runs, not before
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for size, slots in (("12", 12), ("80", 80), ("40", 40)):
            assert main(["ctl", "cache", "--url", base, "--experts", size]) == 0
            assert f"expert cache: {slots} of" in capsys.readouterr().out
            assert engine.runner.moe.cache.num_slots == slots
        during.join()
        assert result["b"] == fixed[1]
        assert main(["ctl", "cache", "--url", base, "--experts", "7"]) == 0
        assert complete(base, prompts[2]) == fixed[2]
        # refused sizes: the API's own error shape, the cache as it was
        assert main(["ctl", "cache", "--url", base, "--experts", "0"]) == 2
        assert "at least one slot" in capsys.readouterr().err
        bad = httpx.post(base + "/v1/ctl/cache", json={"experts": "lots"}, timeout=30)
        assert bad.status_code == 400 and "cannot read cache size" in bad.json()["error"]["message"]
        assert engine.runner.moe.cache.num_slots == 7
        core.scheduler.call(lambda: engine.resize(experts="40")).result(timeout=60)


def test_memory_re_splits_between_the_expert_cache_and_kv(engine, capsys):
    """`ft ctl cache --kv` grows and shrinks the KV pool between steps (cached prefixes
    evicted where they hold pages above the new size), alone or with the expert cache in one
    call; greedy outputs are those of a fixed split; a pool too small for what runs is
    refused."""
    prompts = ["Split the memory", "Another prompt for the pool"]

    def complete(base, prompt, n=24):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    kv = engine.runner.kv
    pages = kv.num_pages
    with running_server(engine) as (base, core):
        fixed = [complete(base, p) for p in prompts]
        assert main(["ctl", "cache", "--url", base, "--kv", str(4 * kv.capacity_tokens)]) == 0
        assert f"KV cache: {4 * pages * kv.page_size} tokens" in capsys.readouterr().out
        assert [complete(base, p) for p in prompts] == fixed
        # shrink below the pages the prefix cache holds high up, and the experts with it
        assert main(["ctl", "cache", "--url", base, "--kv", "256", "--experts", "20"]) == 0
        out = capsys.readouterr().out
        assert "KV cache: 256 tokens" in out and "expert cache: 20 of" in out
        assert engine.runner.kv.num_pages == 256 // kv.page_size
        [listed] = httpx.get(base + "/v1/models", timeout=30).json()["data"]
        assert listed["max_model_len"] == 256  # the context follows the pool
        assert [complete(base, p) for p in prompts] == fixed
        # one page: the prefixes the last requests left above it are evicted to make room
        held = engine.prefix_cache.num_pages
        assert held > 1
        assert main(["ctl", "cache", "--url", base, "--kv", str(kv.page_size)]) == 0
        assert engine.runner.kv.num_pages == 1 and engine.prefix_cache.num_pages <= 1
        assert main(["ctl", "cache", "--url", base, "--kv", "256"]) == 0
        capsys.readouterr()
        assert [complete(base, p) for p in prompts] == fixed
        bad = httpx.post(base + "/v1/ctl/cache", json={}, timeout=30)
        assert bad.status_code == 400 and "give a size" in bad.json()["error"]["message"]
        assert main(["ctl", "cache", "--url", base, "--kv", "0"]) == 2
        assert "at least one page" in capsys.readouterr().err
        core.scheduler.call(lambda: engine.resize("40", str(pages * kv.page_size))).result(60)
        assert engine.runner.kv.num_pages == pages
