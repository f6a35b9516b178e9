"""The Anthropic-compatible API, driven by the official `anthropic` SDK against a real server."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from server_fixtures import MODEL, scripted


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)


USER = [{"role": "user", "content": "Hi there"}]
LONG = [{"role": "user", "content": "a " * 3000}]  # longer than the test server's context
# Sent as an extra field: recent SDKs no longer take `temperature` as an argument.
GREEDY = {"temperature": 0}


def test_message_and_stream_agree(client):
    whole = client.messages.create(
        model=MODEL, max_tokens=6, extra_body=GREEDY, system="Be brief.", messages=USER
    )
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 6
    text = "".join(b.text for b in whole.content if b.type == "text")
    with client.messages.stream(
        model=MODEL, max_tokens=6, extra_body=GREEDY, system="Be brief.", messages=USER
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_stream_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": USER, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/messages", json=body, timeout=60) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    middle = kinds[2:-2]
    assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
    assert set(middle[1:-1]) == {"content_block_delta"}


def test_count_tokens(client, engine):
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system="Be brief.")
    rendered = engine.tokenizer.render_chat([{"role": "system", "content": "Be brief."}, *USER])
    assert counted.input_tokens == len(engine.tokenizer.encode(rendered))


def test_tool_use_round_trip(engine, client, monkeypatch):
    tok = engine.tokenizer
    eos = tok.token_id("<|im_end|>")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    monkeypatch.setattr(engine, "_sample", scripted(engine, [*tok.encode(call), eos]))
    tools = [
        {
            "name": "get_weather",
            "description": "Current weather of a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with client.messages.stream(
        model=MODEL, max_tokens=100, tools=tools, messages=messages
    ) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}

    answer = "It is sunny in Paris."
    monkeypatch.setattr(engine, "_sample", scripted(engine, [*tok.encode(answer), eos]))
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=100, tools=tools, messages=messages)
    assert second.stop_reason == "end_turn"
    assert [b.text for b in second.content if b.type == "text"] == [answer]


def test_stop_sequence(client, engine, monkeypatch):
    tok = engine.tokenizer
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode("one two three four")))
    out = client.messages.create(
        model=MODEL, max_tokens=20, messages=USER, stop_sequences=["three"]
    )
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "three"
    assert out.content[0].text == "one two "


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": MODEL, "messages": USER}, 400, "invalid_request_error"),  # no max_tokens
        ({"model": "claude-x", "max_tokens": 5, "messages": USER}, 404, "not_found_error"),
        ({"model": MODEL, "max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
        ({"model": MODEL, "max_tokens": "5", "messages": USER}, 400, "invalid_request_error"),
        (
            {"model": MODEL, "max_tokens": 5, "messages": LONG},
            400,
            "invalid_request_error",
        ),
        (
            {"model": MODEL, "max_tokens": 5, "messages": USER, "foo": 1},
            400,
            "invalid_request_error",
        ),
    ],
)
def test_errors_have_anthropic_shape(server, client, body, status, kind):
    r = httpx.post(server[0] + "/v1/messages", json=body)
    assert r.status_code == status
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == kind
    assert payload["error"]["message"]
    ok = client.messages.create(model=MODEL, max_tokens=3, messages=USER)
    assert ok.stop_reason == "max_tokens"


def test_keepalive_pings_while_waiting(server, client, monkeypatch):
    from freetoken.server import anthropic_api

    monkeypatch.setattr(anthropic_api, "PING_INTERVAL", 0.001)  # every wait is "long"
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": USER, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/messages", json=body, timeout=60) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds.count("ping") >= 2 and kinds[-1] == "message_stop"
    with client.messages.stream(model=MODEL, max_tokens=4, messages=USER) as stream:
        assert stream.get_final_message().usage.output_tokens == 4  # the SDK skips pings


def test_repeated_prefix_reports_cache_reads(client):
    messages = [{"role": "user", "content": "A long shared context. " * 10}]
    first = client.messages.create(model=MODEL, max_tokens=3, messages=messages)
    again = client.messages.create(model=MODEL, max_tokens=3, messages=messages)
    assert again.usage.cache_read_input_tokens > 0
    total = again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert total == first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_tool_choice_any_and_named_force_a_call(engine, client, monkeypatch):
    tok = engine.tokenizer
    eos = tok.token_id("<|im_end|>")
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    rest = '{"city": "Paris"}}\n</tool_call>'
    monkeypatch.setattr(engine, "_sample", scripted(engine, [*tok.encode(rest), eos]))
    named = client.messages.create(
        model=MODEL,
        max_tokens=50,
        tools=tools,
        messages=messages,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    [use] = [b for b in named.content if b.type == "tool_use"]
    assert named.stop_reason == "tool_use" and use.input == {"city": "Paris"}

    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    monkeypatch.setattr(engine, "_sample", scripted(engine, [*tok.encode(call), eos]))
    anyone = client.messages.create(
        model=MODEL, max_tokens=50, tools=tools, messages=messages, tool_choice={"type": "any"}
    )
    [use] = [b for b in anyone.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Oslo"}
    with pytest.raises(anthropic.BadRequestError, match="not one of the tools"):
        client.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=tools,
            messages=messages,
            tool_choice={"type": "tool", "name": "get_time"},
        )
