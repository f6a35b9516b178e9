"""KV pages taken as requests grow, and recompute preemption when the pool runs dry."""

from __future__ import annotations

import threading

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.demo import demo_checkpoint
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.scheduler import Scheduler
from freetoken.errors import FreetokenError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def demo_config(**options) -> EngineConfig:
    return EngineConfig(model=demo_checkpoint(), device="cpu", dtype="float32", **options)


def demo(kv_tokens: int, **options) -> LLMEngine:
    return LLMEngine.from_config(
        demo_config(kv_cache_tokens=kv_tokens, max_batch_size=3, **options)
    )


def prompts(engine):
    texts = ["Once upon a time", "def fibonacci(n):", "The capital of France is"]
    return [engine.tokenizer.encode(t) for t in texts]


GREEDY = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)


def pages_accounted_for(engine) -> bool:
    kv, tree = engine.runner.kv, engine.prefix_cache
    held = tree.num_pages if tree is not None else 0
    unlocked = tree is None or tree.num_locked == 0
    return kv.allocator.num_free + held == kv.num_pages and unlocked


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_pool_run_dry_preempts_and_gives_the_same_tokens(cache_dir, prefix_cache):
    roomy = demo(4096, prefix_cache=prefix_cache)
    expected = [c.output_ids for c in roomy.generate(prompts(roomy), GREEDY)]
    # 6 pages of 16 tokens: each request grows to 3 pages, so three cannot all hold their KV.
    tight = demo(96, prefix_cache=prefix_cache)
    got = tight.generate(prompts(tight), GREEDY)
    assert tight.preemptions > 0
    assert [c.output_ids for c in got] == expected
    assert all(c.finish_reason == "length" and len(c.output_ids) == 40 for c in got)
    assert pages_accounted_for(tight)
    assert not tight.running and not tight.preempted


def test_the_oldest_request_is_never_preempted(cache_dir):
    engine = demo(96)
    first, *rest = (engine.add_request(p, GREEDY) for p in prompts(engine))
    while not first.finished:
        engine.step()
        assert first.preemptions == 0
    assert sum(r.preemptions for r in rest) > 0


def submit_and_wait(scheduler, jobs, timeout=300):
    """Submit (prompt, params) jobs; return per job its finish reason, its output length and,
    at the moment it finished, how many tokens every other job had."""
    done = threading.Event()
    counts = [0] * len(jobs)
    results: dict[int, tuple] = {}
    errors = []

    def callback(i):
        def on_output(out, error):
            if error is not None:
                errors.append(error)
                done.set()
                return
            counts[i] += 1
            if out.finished:
                results[i] = (out.request.finish_reason, counts[i], list(counts))
                if len(results) == len(jobs):
                    done.set()

        return on_output

    for i, (prompt, params) in enumerate(jobs):
        scheduler.submit(prompt, params, callback(i))
    assert done.wait(timeout=timeout), "requests did not finish"
    assert not errors, errors
    return results


def test_a_request_without_a_limit_does_not_hold_back_a_short_one(cache_dir):
    engine = demo(512)
    prompt = prompts(engine)[0]
    unlimited = SamplingParams(
        max_new_tokens=engine.max_context - len(prompt), temperature=0, ignore_eos=True
    )
    short = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    scheduler = Scheduler(engine, max_running=2)
    try:
        results = submit_and_wait(scheduler, [(prompt, unlimited), (prompt, short)])
    finally:
        scheduler.shutdown()
    reason, tokens, others_then = results[1]
    assert (reason, tokens) == ("length", 8)
    # It ran beside the long one: when it ended, the long one had made about as many tokens,
    # not all of its hundreds (a pool reserved for the long request's limit would make the
    # short one wait for all of them).
    assert others_then[0] <= 8 + 2
    assert results[0][:2] == ("length", engine.max_context - len(prompt))


def test_long_requests_filling_the_pool_are_preempted_not_failed(cache_dir):
    engine = demo(128)
    params = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    scheduler = Scheduler(engine, max_running=3)
    try:
        results = submit_and_wait(scheduler, [(p, params) for p in prompts(engine)])
        stats = scheduler.stats()
    finally:
        scheduler.shutdown()
    assert all(r[:2] == ("length", 60) for r in results.values())
    assert stats.preemptions > 0 and stats.preempted == 0


def test_the_pool_holds_the_models_context_where_memory_allows(cache_dir, monkeypatch):
    from freetoken.engine import runner

    engine = LLMEngine.from_config(
        EngineConfig(model=demo_checkpoint(), device="cpu", dtype="float32")
    )
    assert engine.max_context == engine.runner.config.max_position_embeddings == 32768
    assert engine.runner.kv.capacity_tokens >= 32768
    per_token = runner.kv_bytes_per_token(engine.runner.config, torch.float32)
    # With little memory free, the pool takes a quarter of it and the context follows it.
    monkeypatch.setattr(runner, "available_host_bytes", lambda: 4 * 1000 * per_token)
    small = LLMEngine.from_config(
        EngineConfig(model=demo_checkpoint(), device="cpu", dtype="float32")
    )
    assert small.max_context == small.runner.kv.capacity_tokens == 1008  # 63 pages of 16


def test_max_model_len_bounds_the_context(cache_dir):
    engine = LLMEngine.from_config(
        EngineConfig(model=demo_checkpoint(), device="cpu", dtype="float32", max_model_len=1000)
    )
    assert engine.max_context == 1000 and engine.runner.kv.capacity_tokens >= 1000
    with pytest.raises(FreetokenError, match="beyond the model's context of 32768"):
        LLMEngine.from_config(
            EngineConfig(model=demo_checkpoint(), device="cpu", max_model_len=40000)
        )
