"""The HTTP server around a hybrid-attention model (tiny Qwen3-Next, recurrent state pool and
anchor checkpoints): multi-turn reuse reaches the client's usage fields, concurrent streams
finish, bad input leaves it serving."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from freetoken.config import EngineConfig
from freetoken.engine.generate import LLMEngine
from server_fixtures import MODEL, running_server
from tiny_models import build_chat_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = build_chat_model("qwen3_next", tmp_path_factory.mktemp("hybrid") / "m")
    engine = LLMEngine.from_config(
        EngineConfig(
            model=path, device="cpu", dtype="float32", kv_cache_tokens=4096, state_anchors=8
        )
    )
    with running_server(engine, MODEL, max_running=4) as (base, _core):
        yield base


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def ask(client, messages, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=5, **kw
    )


def test_second_turn_resumes_from_an_anchor(client, server):
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files. " * 8},
    ]
    first = ask(client, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or "ok"},
        {"role": "user", "content": "Now open the first one."},
    ]
    second = ask(client, messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The system and first user messages end on <|im_end|>: an anchor the second turn resumes
    # from; the rest of the prompt is recomputed.
    assert 20 < cached < second.usage.prompt_tokens
    stats = httpx.get(server + "/v1/stats").json()
    assert stats["prefix_reuse"]["anchor_restores"] >= 1


def test_concurrent_streams_and_bad_input(client, server):
    results = {}

    def stream(i):
        chunks = ask(client, [{"role": "user", "content": f"Count to {i}."}], stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    bad = httpx.post(
        server + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
    )
    for t in threads:
        t.join(timeout=120)
    assert bad.status_code == 400
    assert sorted(results) == [0, 1, 2]
    assert ask(client, [{"role": "user", "content": "Still there?"}]).choices[0].finish_reason
