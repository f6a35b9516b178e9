"""The request bodies real coding agents send, against a real server.

`clients/requests.json` holds bodies captured from Claude Code, Codex CLI and OpenCode with
`clients/logging_proxy.py` (trimmed by `clients/trim_capture.py`): every field, message,
block and tool kind they send is there. Each fix of issue 12 has a test here.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from freetoken.config import EngineConfig
from freetoken.demo import demo_checkpoint
from freetoken.engine.generate import LLMEngine
from server_fixtures import running_server, scripted

MODEL = "freetoken-demo"
FIXTURES = json.loads((Path(__file__).parent / "clients" / "requests.json").read_text())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        config = EngineConfig(
            model=demo_checkpoint(), device="cpu", dtype="float32", kv_cache_tokens=6144
        )
        yield LLMEngine.from_config(config)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, MODEL) as (base, core):
        yield base, core


@pytest.fixture()
def reply(engine, monkeypatch):
    """Script the model's reply: `reply("text")` makes it answer that and end its turn;
    `reply(None)` makes it talk forever (one token, over and over)."""
    tok = engine.tokenizer
    eos = tok.token_id("<|im_end|>")

    def set_reply(text: str | None):
        script = tok.encode("go") if text is None else [*tok.encode(text), eos]
        monkeypatch.setattr(engine, "_sample", scripted(engine, script))

    set_reply("Hello from freetoken.")
    return set_reply


def body_of(name: str, **changes) -> dict:
    return {**json.loads(json.dumps(FIXTURES[name]["body"])), **changes}


def sse_events(response: httpx.Response) -> list[tuple[str | None, object]]:
    """(event name, data) of each SSE event, comments as (":", text)."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith(":"):
            events.append((":", line[1:].strip()))
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


def post_stream(server, name: str, **changes) -> list[tuple[str | None, object]]:
    body = body_of(name, **changes)
    path = FIXTURES[name]["endpoint"]
    with httpx.stream("POST", server[0] + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def rendered_prompt(server, name: str) -> str:
    """The prompt a fixture renders to, through the adapter's own path."""
    from freetoken.server import anthropic_api, openai_api, responses_api
    from freetoken.server.schemas import SCHEMAS

    core, body = server[1], body_of(name)
    endpoint = FIXTURES[name]["endpoint"]
    schema = {"/v1/messages": "messages", "/v1/responses": "responses"}.get(endpoint, "chat")
    parsed = SCHEMAS[schema].model_validate(body)  # as app.py parses it
    if endpoint == "/v1/messages":
        body = parsed
        ids = core.render(
            anthropic_api.template_messages(body),
            tools=anthropic_api.template_tools(body),
            **anthropic_api.reasoning(core, body),
        )
    elif endpoint == "/v1/responses":
        tools, names = responses_api.template_tools(parsed)
        ids = core.render(responses_api.template_messages(parsed, names), tools=tools)
    else:
        ids = core.render(
            openai_api.chat_messages(parsed.messages), tools=openai_api.chat_tools(parsed)
        )
    return core.tokenizer.decode(ids, skip_special_tokens=False)


# -- every captured body is served ------------------------------------------------------


# Claude Code's title request asks for structured output, which freetoken refuses (below).
ANSWERED = sorted(set(FIXTURES) - {"claude_code_title"})


@pytest.mark.parametrize("name", ANSWERED)
def test_every_captured_request_is_answered_with_a_whole_stream(server, reply, name):
    events = post_stream(server, name)
    endpoint = FIXTURES[name]["endpoint"]
    if endpoint == "/v1/messages":
        kinds = [e for e, _ in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        usage = events[-2][1]["usage"]
        assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0
        assert "cache_read_input_tokens" in events[0][1]["message"]["usage"]
    elif endpoint == "/v1/responses":
        final = events[-1][1]
        assert final["type"] == "response.completed"
        assert final["response"]["usage"]["output_tokens"] > 0
    else:
        assert events[-1] == (None, "[DONE]")
        [usage] = [d["usage"] for _, d in events[:-1] if d.get("usage")]  # include_usage
        assert usage["completion_tokens"] > 0


# -- Claude Code ------------------------------------------------------------------------


def test_claude_code_fields_are_accepted_and_mid_conversation_system_is_rendered(server):
    body = body_of("claude_code_turn")
    assert {"output_config", "thinking", "context_management", "metadata"} <= body.keys()
    prompt = rendered_prompt(server, "claude_code_turn")
    # The system message Claude Code puts after the first user turn stays where it stands.
    user_at = prompt.index("<|im_start|>user")
    assert prompt.index("<|im_start|>system\nAvailable agent types", user_at) > user_at
    # Its billing header is for Anthropic's servers, not the model (and changes per session).
    assert "x-anthropic-billing-header" not in prompt
    assert "You are a Claude agent" in prompt


def test_a_template_that_takes_system_first_only_gets_later_ones_as_user_turns(server):
    core = server[1]

    class FirstSystemOnly:
        def render_chat(self, messages, tools=None, **kwargs):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("System message must be at the beginning")
            return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "system", "content": "R"},
    ]
    bare = type(core).__new__(type(core))
    bare.tokenizer = FirstSystemOnly()
    text = bare._render(messages, None, {})
    assert text == "system:S|user:U|user:R"


def test_reasoning_settings_reach_the_template(server):
    from freetoken.server import anthropic_api, responses_api
    from freetoken.server.schemas import CountTokensRequest

    def body(**fields):
        return CountTokensRequest.model_validate({"model": MODEL, "messages": [], **fields})

    core = server[1]
    assert "enable_thinking" in core.template_source  # the demo's Qwen3 template
    off = body(thinking={"type": "disabled"})
    assert anthropic_api.reasoning(core, off) == {"enable_thinking": False}
    assert anthropic_api.reasoning(core, body(thinking={"type": "adaptive"})) == {}
    # No reasoning_effort in Qwen3's template: an effort reaches only templates that read it.
    assert anthropic_api.reasoning(core, body(output_config={"effort": "high"})) == {}
    from freetoken.server.schemas import ResponsesRequest

    off_effort = ResponsesRequest.model_validate(
        {"model": MODEL, "input": "x", "reasoning": {"effort": "none"}}
    )
    assert responses_api.reasoning(core, off_effort) == {"enable_thinking": False}
    plain = core.tokenizer.decode(
        core.render([{"role": "user", "content": "hi"}]), skip_special_tokens=False
    )
    closed = core.tokenizer.decode(
        core.render([{"role": "user", "content": "hi"}], **anthropic_api.reasoning(core, off)),
        skip_special_tokens=False,
    )
    assert closed == plain + "<think>\n\n</think>\n\n"


def test_claude_code_tool_result_turn_reuses_the_prompt_and_streams_cache_reads(server, reply):
    first = post_stream(server, "claude_code_turn")
    start = first[0][1]["message"]["usage"]
    again = post_stream(server, "claude_code_tool_result")
    usage = again[0][1]["message"]["usage"]  # message_start, before any text
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert (
        usage["cache_read_input_tokens"]
        >= start["input_tokens"] + start["cache_read_input_tokens"] - 16
    )  # the first turn's prompt, up to its last partial page
    assert usage["cache_read_input_tokens"] / total > 0.8
    assert again[-2][1]["usage"]["cache_read_input_tokens"] == usage["cache_read_input_tokens"]


def test_claude_code_title_request_asking_for_structured_output_is_refused_by_name(server):
    """No constrained decoding: the JSON schema would not be honoured, so it is refused, not
    dropped. Claude Code goes on without a title (checked with Claude Code 2.1.197 -p)."""
    body = body_of("claude_code_title")
    assert body["output_config"]["format"]["type"] == "json_schema"
    r = httpx.post(server[0] + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "output_config.format" in error["message"]
    # The same request without the format is answered.
    events = post_stream(server, "claude_code_title", output_config={"effort": "high"})
    assert events[-1][0] == "message_stop"


def test_the_sdk_reads_cache_reads_from_a_stream(server, reply):
    client = anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the sea " * 20}]
    for _ in range(2):
        with client.messages.stream(model=MODEL, max_tokens=8, messages=messages) as stream:
            final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 100


# -- Codex ------------------------------------------------------------------------------


def test_codex_hosted_tools_are_skipped_and_namespaces_flattened(server):
    from freetoken.server import responses_api
    from freetoken.server.schemas import ResponsesRequest

    body = body_of("codex_turn")
    kinds = {t["type"] for t in body["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds and "client_metadata" in body
    tools, names = responses_api.template_tools(ResponsesRequest.model_validate(body))
    exposed = [t["function"]["name"] for t in tools]
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    inner = namespace["tools"][0]["name"]
    assert inner in exposed and names[inner].namespace == namespace["name"]
    assert len(exposed) == len(set(exposed))
    assert not any("web_search" in name for name in exposed)


def test_a_call_of_a_namespaced_tool_comes_back_with_its_namespace(server, engine, reply):
    body = body_of("codex_turn")
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    name = namespace["tools"][0]["name"]
    call = json.dumps({"name": name, "arguments": {"target": "a1"}})
    reply(f"<tool_call>\n{call}\n</tool_call>")
    events = post_stream(server, "codex_turn")
    [item] = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert item["type"] == "function_call" and item["name"] == name
    assert item["namespace"] == namespace["name"]
    assert json.loads(item["arguments"]) == {"target": "a1"}
    # Codex sends that call back in the next turn's input, namespace and all.
    history = body_of("codex_namespace_call")
    assert any(i.get("namespace") for i in history["input"])
    assert f'"name": "{name}"' in rendered_prompt(server, "codex_namespace_call")


def test_custom_tools_take_one_string_and_answer_as_custom_calls(server, reply):
    body = {
        "model": MODEL,
        "input": "patch it",
        "stream": True,
        "tools": [{"type": "custom", "name": "apply_patch", "description": "Apply a patch"}],
    }
    patch = "*** Begin Patch\n*** End Patch"
    reply(
        "<tool_call>\n"
        + json.dumps({"name": "apply_patch", "arguments": {"input": patch}})
        + "\n</tool_call>"
    )
    with httpx.stream("POST", server[0] + "/v1/responses", json=body, timeout=60) as r:
        events = sse_events(r)
    [item] = [d["item"] for e, d in events if e == "response.output_item.done"]
    assert item == {**item, "type": "custom_tool_call", "name": "apply_patch", "input": patch}
    assert "_arguments" not in item
    follow = {
        **body,
        "stream": False,
        "input": [
            {"role": "user", "content": "patch it"},
            {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": patch},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        ],
    }
    reply("Patched.")
    r = httpx.post(server[0] + "/v1/responses", json=follow, timeout=60)
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "Patched."


def test_reasoning_items_go_back_into_the_turn_they_led_to(server):
    from freetoken.server import responses_api
    from freetoken.server.schemas import ResponsesRequest

    items = [
        {"role": "user", "content": "q"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "let me think"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    ]
    body = ResponsesRequest(model=MODEL, input=items)
    messages = responses_api.template_messages(body, {})
    assert messages[-1]["reasoning_content"] == "let me think"
    assert messages[-1]["tool_calls"][0]["function"]["name"] == "f"


def test_responses_streams_send_keepalive_events_the_sdk_skips(server, reply, monkeypatch):
    from freetoken.server import responses_api

    monkeypatch.setattr(responses_api, "KEEPALIVE_INTERVAL", 0.001)
    events = post_stream(server, "codex_turn")
    keepalives = [d for e, d in events if e == "keepalive"]
    assert keepalives and all(
        d == {"type": "keepalive", "sequence_number": d["sequence_number"]} for d in keepalives
    )
    numbers = [d["sequence_number"] for _, d in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    with client.responses.stream(model=MODEL, input="hi") as stream:
        assert stream.get_final_response().output_text == "Hello from freetoken."


# -- OpenCode and the OpenAI chat API --------------------------------------------------


def test_chat_streams_send_comment_keepalives_the_sdk_skips(server, reply, monkeypatch):
    from freetoken.server import openai_api

    monkeypatch.setattr(openai_api, "KEEPALIVE_INTERVAL", 0.001)
    events = post_stream(server, "opencode_turn")
    assert (":", "keep-alive") in events and events[-1] == (None, "[DONE]")
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).endswith(".")
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60) as r:
        completions = sse_events(r)
    assert (":", "keep-alive") in completions and completions[-1] == (None, "[DONE]")


def test_max_tokens_beyond_the_room_left_is_cut_to_it(server, engine, reply):
    reply(None)  # a reply that never ends by itself
    core = server[1]
    body = body_of("opencode_turn", stream=False)
    prompt = len(core.render(body["messages"], tools=body["tools"]))
    room = 7
    words = core.max_context - prompt - room
    filler = {"role": "user", "content": "x" + " x" * (words - 10)}
    body["messages"] = [body["messages"][0], filler, *body["messages"][1:]]
    exact = core.max_context - len(core.render(body["messages"], tools=body["tools"]))
    assert body["max_tokens"] == 32000 and 0 < exact <= 32
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == exact


def test_a_prompt_beyond_the_context_gets_each_apis_own_words(server):
    core = server[1]
    long = [{"role": "user", "content": "word " * (core.max_context + 10)}]
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": MODEL, "messages": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {core.max_context} tokens" in r.json()["error"]["message"]
    body = {"model": MODEL, "max_tokens": 32000, "messages": long}
    r = httpx.post(server[0] + "/v1/messages", json=body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    # Claude Code compacts the conversation on exactly this wording.
    assert message.startswith("prompt is too long: ") and message.endswith(
        f" tokens > {core.max_context} maximum"
    )


def test_a_request_without_a_limit_gets_the_checkpoints_default(server, engine, reply):
    reply(None)
    assert engine.tokenizer.default_max_new_tokens == 256  # the demo's generation_config
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=300)
    assert r.json()["usage"]["completion_tokens"] == 256


def test_models_report_the_context_and_the_base_url_answers(server):
    core = server[1]
    [model] = httpx.get(server[0] + "/v1/models").json()["data"]
    assert model["max_model_len"] == model["context_length"] == core.max_context
    assert httpx.head(server[0] + "/").status_code == 200


# -- streams that end early -------------------------------------------------------------


def test_closing_a_keepalive_stream_mid_wait_cancels_cleanly():
    from freetoken.server.core import with_keepalive

    cleaned = []

    async def slow_events():
        try:
            await asyncio.sleep(3600)
            yield "never"
        finally:
            cleaned.append(True)

    async def main():
        stream = with_keepalive(slow_events(), 0.01)
        assert await anext(stream) is None  # a keep-alive while the events' step runs
        # The client leaves now: before the fix this raised "aclose(): asynchronous
        # generator is already running".
        await stream.aclose()

    asyncio.run(main())
    assert cleaned == [True]


def test_a_client_leaving_mid_stream_is_cancelled_without_errors(server, reply, monkeypatch):
    import time

    from freetoken.server import anthropic_api

    reply(None)
    monkeypatch.setattr(anthropic_api, "PING_INTERVAL", 0.001)  # a keep-alive step pending
    body = {
        "model": MODEL,
        "max_tokens": 2000,
        "stream": True,
        "messages": [{"role": "user", "content": "go on"}],
    }
    with httpx.stream("POST", server[0] + "/v1/messages", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break  # leave mid-stream
    deadline = time.time() + 10
    while (
        httpx.get(server[0] + "/v1/stats").json()["requests"]["running"] and time.time() < deadline
    ):
        time.sleep(0.05)
    assert httpx.get(server[0] + "/v1/stats").json()["requests"]["running"] == 0
