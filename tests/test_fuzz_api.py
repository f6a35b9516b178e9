"""Generated requests, valid and hostile, against a real server on all five POST endpoints.

Every answer must be a success or a 4xx in the called API's own error shape, never a 5xx,
never a hang (each request has a deadline), and the server must answer a good request after
each batch. The model's replies are scripted to two tokens, so a valid request costs one short
generation and the suite covers ~2,200 requests in CI time. Examples are derandomized: CI
runs the same requests every time (docs/reliability.md records the counts).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_fixtures import MODEL, demo_engine, running_server, scripted

TIMEOUT = 30.0  # a request that takes longer is a hang
GOOD_EVERY = 100  # a good request after every this many generated ones

# -- JSON of every kind ----------------------------------------------------------------

# Text with what broke tokenizers and JSON encoders: lone surrogates, NULs, controls, emoji.
text = st.text(st.characters(codec=None, exclude_categories=()), max_size=24)
keys = st.text(st.characters(codec="utf-8"), max_size=10)
numbers = (
    st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, 1, -1, 2**31, 2**64, 1e308, 5e-324, 0.5])
)
scalars = st.none() | st.booleans() | numbers | text
json_value = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=10,
)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a valid value (7 in 8), sometimes anything at all."""
    return st.integers(0, 7).flatmap(lambda i: json_value if i == 0 else valid)


def body_of(required: dict, optional: dict, base: dict) -> st.SearchStrategy:
    """Objects with the required fields (each sometimes missing or wrong; a third of the time
    those of `base`, a valid request), some optional ones, and now and then a field the API
    does not have."""
    extra = st.dictionaries(
        st.sampled_from(["temprature", "foo", "", "x" * 40]), json_value, max_size=1
    )

    @st.composite
    def build(draw):
        body = {}
        for key, value in required.items():
            if draw(st.integers(0, 2)) == 0:
                body[key] = base[key]
            elif draw(st.integers(0, 19)):  # 1 in 20: left out
                body[key] = draw(maybe(value))
        for key, value in optional.items():
            if draw(st.integers(0, 9)) == 0:
                body[key] = draw(maybe(value))
        if draw(st.integers(0, 9)) == 0:
            body.update(draw(extra))
        return body

    return build()


short_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
small_int = st.integers(-1, 8)
sampling = {
    "temperature": st.floats(-0.2, 3) | st.just(0),
    "top_p": st.floats(-0.1, 1.2),
    "top_k": st.integers(-1, 200),
    "min_p": st.floats(-0.1, 1.2),
    "repetition_penalty": st.floats(-0.2, 3),
    "stream": st.booleans(),
}
openai_sampling = {
    **sampling,
    "max_tokens": small_int,
    "seed": st.integers(-5, 2**65),
    "stop": short_text | st.lists(short_text, max_size=3),
    "n": small_int,
    "logprobs": st.booleans(),
    "frequency_penalty": st.floats(-3, 3),
    "presence_penalty": st.floats(-3, 3),
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "17", "999999999", "x", "²"]), st.floats(-200, 200), max_size=2
    ),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": short_text,
}
chat_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"]), "text": maybe(short_text)}
)
function = st.fixed_dictionaries(
    {
        "name": maybe(st.sampled_from(["get_weather", "run"])),
        "parameters": maybe(
            st.just({"type": "object", "properties": {"city": {"type": "string"}}})
        ),
    }
)
chat_tool = st.fixed_dictionaries({"type": maybe(st.just("function")), "function": maybe(function)})
chat_message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
        "content": maybe(short_text | st.lists(chat_part, max_size=3)),
    },
    optional={
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": short_text,
                    "type": st.just("function"),
                    "function": maybe(
                        st.fixed_dictionaries({"name": short_text, "arguments": maybe(short_text)})
                    ),
                }
            ),
            max_size=2,
        ),
        "tool_call_id": short_text,
    },
)
tool_choice = st.sampled_from(["auto", "none", "required", "sometimes"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": maybe(short_text)})}
)
chat_bodies = body_of(
    {"model": st.just(MODEL), "messages": st.lists(chat_message, max_size=4)},
    {
        **openai_sampling,
        "tools": st.lists(chat_tool, max_size=2),
        "tool_choice": tool_choice,
        "response_format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object"])}
        ),
        "reasoning_effort": st.sampled_from(["none", "low", "high"]),
        "chat_template_kwargs": st.dictionaries(
            st.sampled_from(["enable_thinking", "tools", "chat_template", "x"]),
            json_value,
            max_size=2,
        ),
        "max_completion_tokens": small_int,
    },
    {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]},
)
completion_bodies = body_of(
    {"model": st.just(MODEL), "prompt": short_text},
    {**openai_sampling, "echo": st.booleans(), "suffix": short_text, "best_of": small_int},
    {"model": MODEL, "prompt": "Once upon"},
)
anthropic_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": maybe(short_text)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": short_text,
            "content": maybe(
                short_text
                | st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image"]), "text": short_text}
                    ),
                    max_size=2,
                )
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": short_text,
            "name": maybe(short_text),
            "input": json_value,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["thinking", "image", "document"]), "thinking": maybe(short_text)}
    ),
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["user", "assistant", "system"])),
        "content": maybe(short_text | st.lists(anthropic_block, max_size=3)),
    }
)
anthropic_fields = {
    "system": short_text
    | st.lists(
        st.fixed_dictionaries({"type": st.just("text"), "text": maybe(short_text)}), max_size=2
    ),
    "tools": st.lists(
        st.fixed_dictionaries(
            {"name": maybe(short_text), "input_schema": maybe(st.just({"type": "object"}))}
        ),
        max_size=2,
    ),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "none", "tool", "maybe"])},
        optional={"name": short_text},
    ),
    "thinking": st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "adaptive", "on"])}
    ),
    "output_config": st.fixed_dictionaries({"effort": st.sampled_from(["low", "high"])}),
}
messages_bodies = body_of(
    {
        "model": st.just(MODEL),
        "messages": st.lists(anthropic_message, max_size=4),
        "max_tokens": small_int,
    },
    {
        **anthropic_fields,
        **{k: sampling[k] for k in ("temperature", "top_p", "top_k", "stream")},
        "stop_sequences": st.lists(short_text, max_size=2),
        "metadata": st.fixed_dictionaries({"user_id": short_text}),
    },
    {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
)
count_tokens_bodies = body_of(
    {"model": st.just(MODEL), "messages": st.lists(anthropic_message, max_size=4)},
    anthropic_fields,
    {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]},
)
# (each item's type sometimes of another JSON type: a list or object one was a 500 or a reset)
responses_item = st.one_of(
    st.fixed_dictionaries(
        {
            "type": maybe(st.just("message")),
            "role": maybe(st.sampled_from(["user", "assistant", "developer"])),
            "content": maybe(
                short_text
                | st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": maybe(
                                st.sampled_from(["input_text", "output_text", "input_image"])
                            ),
                            "text": maybe(short_text),
                        }
                    ),
                    max_size=2,
                )
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": maybe(st.sampled_from(["function_call", "custom_tool_call"])),
            "name": maybe(short_text),
            "call_id": short_text,
            "arguments": maybe(short_text),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": maybe(st.just("function_call_output")),
            "call_id": short_text,
            "output": json_value,
        }
    ),
    st.fixed_dictionaries(
        {"type": maybe(st.sampled_from(["reasoning", "web_search_call"])), "summary": json_value}
    ),
)
responses_tool = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "custom"]), "name": maybe(short_text)}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("namespace"),
            "name": maybe(short_text),
            "tools": maybe(
                st.lists(
                    st.fixed_dictionaries({"type": st.just("function"), "name": short_text}),
                    max_size=2,
                )
            ),
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search"])}),
)
responses_bodies = body_of(
    {"model": st.just(MODEL), "input": short_text | st.lists(responses_item, max_size=4)},
    {
        **sampling,
        "instructions": short_text,
        "tools": st.lists(responses_tool, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"])
        | st.fixed_dictionaries({"type": st.just("function"), "name": short_text}),
        "max_output_tokens": small_int,
        "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["none", "low"])}),
        "text": st.fixed_dictionaries(
            {"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_schema"])})}
        ),
        "previous_response_id": short_text,
        "store": st.booleans(),
    },
    {"model": MODEL, "input": "Hello"},
)
# Bodies that are not JSON objects at all: bytes, broken and very deep JSON.
raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b'{"model": NaN}', b"\xff\xfe"]),
    st.integers(900, 5000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(900, 3000).map(
        lambda depth: b'{"model": "test-model", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    ),
    json_value.map(lambda v: json.dumps(v).encode()),
)

ENDPOINTS = {
    "/v1/chat/completions": chat_bodies,
    "/v1/completions": completion_bodies,
    "/v1/responses": responses_bodies,
    "/v1/messages": messages_bodies,
    "/v1/messages/count_tokens": count_tokens_bodies,
}
EXAMPLES = {
    "/v1/chat/completions": 500,
    "/v1/completions": 350,
    "/v1/responses": 450,
    "/v1/messages": 500,
    "/v1/messages/count_tokens": 250,
}
RAW_EXAMPLES = 200
GOOD = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    },
}


# -- the server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    engine = demo_engine()
    tok = engine.tokenizer
    engine._sample = scripted(engine, [*tok.encode("Hi"), tok.token_id("<|im_end|>")])
    with (
        running_server(engine, MODEL) as (base, core),
        httpx.Client(base_url=base, timeout=TIMEOUT) as client,
    ):
        yield client, core


def check_error_shape(path: str, r: httpx.Response) -> None:
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error", body
        assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str)
    else:
        error = body["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), body
        assert {"param", "code"} <= error.keys()


def check_stream(path: str, r: httpx.Response) -> None:
    lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    last = lines[-1][6:]
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert last == "[DONE]", lines[-3:]
    elif path == "/v1/messages":
        assert json.loads(last)["type"] == "message_stop", lines[-3:]
    else:
        assert json.loads(last)["type"] in ("response.completed", "response.incomplete")


def send(client: httpx.Client, path: str, content: bytes) -> int:
    """One request, checked; returns its status."""
    headers = {"content-type": "application/json"}
    with client.stream("POST", path, content=content, headers=headers) as r:
        assert r.status_code < 500, (r.status_code, r.read()[:300], content[:300])
        assert r.status_code != 422  # FastAPI's own validation shape: never ours
        if r.status_code >= 400:
            r.read()
            check_error_shape(path, r)
        elif r.headers["content-type"].startswith("text/event-stream"):
            check_stream(path, r)
        else:
            r.read()
            assert isinstance(r.json(), dict)
    return r.status_code


def good_request_answered(client: httpx.Client) -> None:
    for path, body in GOOD.items():
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text


def fuzz(client, path: str, strategy, examples: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    count = 0

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(body):
        nonlocal count
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        status = send(client, path, content)
        statuses[status] = statuses.get(status, 0) + 1
        count += 1
        if count % GOOD_EVERY == 0:
            good_request_answered(client)

    run()
    good_request_answered(client)
    assert count >= examples
    return statuses


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_generated_requests_get_answers_or_api_shaped_4xx(server, path):
    client, _ = server
    statuses = fuzz(client, path, ENDPOINTS[path], EXAMPLES[path])
    # The generators reach both sides: answers and refusals.
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses
    stats = client.get("/v1/stats").json()["requests"]
    assert stats["running"] == 0 and stats["queued"] == 0  # nothing left behind
    print(f"{path}: {sum(statuses.values())} requests, statuses {sorted(statuses.items())}")


def test_bodies_that_are_not_json_objects_get_api_shaped_400s(server):
    client, _ = server
    for path in ENDPOINTS:
        statuses = fuzz(client, path, raw_bodies, RAW_EXAMPLES // len(ENDPOINTS))
        assert set(statuses) <= {400, 404}, statuses
