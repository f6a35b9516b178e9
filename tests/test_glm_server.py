"""GLM-4.5's format end to end: a checkpoint whose chat template writes GLM's `<arg_key>` /
`<arg_value>` calls, served with scripted output and driven by the official `openai` SDK:
reasoning comes back as reasoning, a call as a tool call with its arguments typed by the
request's schema (whole and streamed), and the tool result goes back through the template."""

from __future__ import annotations

import json

import openai
import pytest

from server_fixtures import (
    MODEL,
    cpu_engine,
    demo_with_template,
    record_prompts,
    running_server,
    scripted,
)

# GLM-4.5's template in miniature: its roles, its call and tool-result layout
TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools %}<|system|>\n# Tools{% for t in tools %}\n{{ t.function | tojson }}"
    "{% endfor %}\nWrite calls as <tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n</tool_call>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- set args = c.function.arguments %}"
    "\n<tool_call>{{ c.function.name }}"
    "{%- for k, v in args.items() %}\n<arg_key>{{ k }}</arg_key>\n<arg_value>"
    "{{ v if v is string else v | tojson }}</arg_value>{%- endfor %}\n</tool_call>"
    "{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|observation|>\n<tool_response>\n{{ m.content }}\n"
    "</tool_response>"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    """The demo model with GLM's chat template (which gets a call's arguments as an object,
    as the server hands them over)."""
    return demo_with_template(tmp_path_factory.mktemp("glm"), TEMPLATE)[0]


@pytest.fixture(scope="module")
def engine(glm_checkpoint):
    return cpu_engine(glm_checkpoint)


@pytest.fixture()
def server(engine):
    with running_server(engine) as s:
        yield s


def test_reasoning_and_a_typed_tool_call_round_trip(engine, server, monkeypatch):
    base, core = server
    assert core.parser_name == "glm45"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    tok = engine.tokenizer
    prompts = record_prompts(engine, monkeypatch)
    call = (
        "<think>The user wants the weather.</think>\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>3</arg_value>\n</tool_call><|im_end|>"
    )
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode(call)))
    messages = [{"role": "user", "content": "Weather in Paris for three days?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 3}

    names, args = [], []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100, stream=True
    ):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                args.append(d.function.arguments or "")
            assert not c.delta.content  # no markup leaks into the text
    assert names == ["get_weather"] and json.loads("".join(args)) == {"city": "Paris", "days": 3}

    # the result goes back through the template as GLM's observation; the model answers
    answer = "<think></think>It is sunny in Paris.<|im_end|>"
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode(answer)))
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": '{"sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100
    )
    assert "<arg_key>days</arg_key>\n<arg_value>3</arg_value>" in prompts[-1]
    assert "<|observation|>" in prompts[-1] and '{"sky": "sunny"}' in prompts[-1]
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"


def test_a_forced_tool_choice_opens_the_call_as_glm_writes_it(engine, server, monkeypatch):
    base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    tok = engine.tokenizer
    rest = "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call><|im_end|>"
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode(rest)))
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Rome?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=50,
    )  # fmt: skip
    [tool_call] = forced.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
