"""Admission by need: requests that run the KV pool dry are preempted, not failed."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken.config import EngineConfig
from freetoken.demo import demo_checkpoint
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.scheduler import IDLE_S, Scheduler


@pytest.fixture()
def small_engine(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    return LLMEngine.from_config(
        EngineConfig(model=demo_checkpoint(), device="cpu", dtype="float32", kv_cache_tokens=256)
    )


def test_requests_wait_for_kv_pages(small_engine):
    engine = small_engine
    kv = engine.runner.kv
    params = SamplingParams(max_new_tokens=kv.capacity_tokens // 3, temperature=0)
    prompt = engine.tokenizer.encode("Once upon a time")
    # Each request may grow to a third of the pool: three of them cannot all hold their KV
    # next to what the prefix cache holds, so the newest is preempted and resumed instead of
    # failing mid-decode.
    done = threading.Event()
    results: dict[int, list] = {i: [] for i in range(3)}
    errors = []

    def on_output(i):
        def callback(out, error):
            if error is not None:
                errors.append(error)
            elif out.finished:
                results[i].append(out.request.finish_reason)
                if all(results.values()):
                    done.set()

        return callback

    scheduler = Scheduler(engine, max_running=3)
    try:
        for i in range(3):
            scheduler.submit([*prompt, i + 10], params, on_output(i))
        assert done.wait(timeout=300), "requests did not finish"
    finally:
        scheduler.shutdown()
    assert not errors
    assert all(r == ["length"] for r in results.values())


def test_an_engine_takes_one_scheduler_at_a_time(small_engine):
    """Two schedulers' threads stepping one engine would each drop the other's outputs (its
    clients would wait forever): the second is refused until the first is shut down."""
    first = Scheduler(small_engine)
    try:
        with pytest.raises(RuntimeError, match="already driven"):
            Scheduler(small_engine)
    finally:
        first.shutdown()
    second = Scheduler(small_engine)
    second.shutdown()


def test_the_idle_chore_runs_once_when_the_engine_first_has_nothing_to_do(engine):
    """A server's one-time chore (the start's garbage freed) waits for the engine thread to
    idle, not for a request; it runs once, and a failing one leaves the engine serving."""
    ran = []

    def chore():
        ran.append(time.perf_counter())
        raise RuntimeError("a chore that fails")

    started = time.perf_counter()
    sched = Scheduler(engine, on_idle=chore)
    try:
        deadline = time.time() + 30
        while not ran and time.time() < deadline:
            time.sleep(0.05)
        assert len(ran) == 1 and ran[0] - started >= IDLE_S
        time.sleep(3 * IDLE_S)
        assert len(ran) == 1
        outputs = []
        done = threading.Event()

        def on_output(out, error):
            outputs.append((out, error))
            if error is not None or out.finished:
                done.set()

        sched.submit([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0), on_output)
        assert done.wait(60) and outputs[-1][1] is None and len(outputs) == 2
    finally:
        sched.shutdown()
