"""Harmony end to end (gpt-oss's format): a checkpoint whose tokenizer holds Harmony's special
tokens and whose chat template writes channels, served with scripted output and driven by the
official `openai` SDK: reasoning comes back as reasoning, a call on the commentary channel as a
tool call (whole and streamed), the tool result goes back through the template, and
`reasoning_effort` reaches the template."""

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

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>"]  # fmt: skip
TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.\n"
    'Reasoning: {{ reasoning_effort | default("medium") }}\n'
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools"
    "{%- for t in tools %}\n{{ t.function.name }}: {{ t.function.description }}{%- endfor %}"
    "<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- for c in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions."
    "{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments if c.function.arguments is string else c.function.arguments"
    " | tojson }}<|call|>{%- endfor %}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def harmony_checkpoint(tmp_path_factory):
    """The demo model with Harmony's special tokens (in its vocabulary's unused rows), its
    template, and `<|return|>` / `<|call|>` among the end tokens, as gpt-oss has them."""
    dst, tok = demo_with_template(tmp_path_factory.mktemp("harmony"), TEMPLATE, tuple(SPECIAL))
    assert len(tok) <= json.loads((dst / "config.json").read_text())["vocab_size"]
    gen = json.loads((dst / "generation_config.json").read_text())
    ends = gen.get("eos_token_id", [])
    ends = ends if isinstance(ends, list) else [ends]
    gen["eos_token_id"] = ends + tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


@pytest.fixture(scope="module")
def engine(harmony_checkpoint):
    return cpu_engine(harmony_checkpoint)


@pytest.fixture()
def server(engine):
    with running_server(engine) as s:
        yield s


def test_reasoning_and_a_tool_call_round_trip(engine, server, monkeypatch):
    base, core = server
    assert core.parser_name == "harmony"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    tok = engine.tokenizer
    prompts = record_prompts(engine, monkeypatch)
    call = (
        "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode(call)))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100, reasoning_effort="high"
    )
    assert "Reasoning: high" in prompts[-1]  # reasoning_effort reached the template
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}

    # streamed: the reasoning, then the call's name and arguments in pieces
    names, args, reasoning = [], [], []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100, stream=True
    ):
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                args.append(d.function.arguments or "")
            assert not c.delta.content  # no markup leaks into the text
    assert "".join(reasoning) == "The user wants the weather."
    assert names == ["get_weather"] and json.loads("".join(args)) == {"city": "Paris"}

    # the result goes back through the template; the model answers on the final channel
    answer = "<|channel|>final<|message|>It is sunny in Paris.<|return|>"
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode(answer)))
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": '{"sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=100
    )
    assert "to=functions.get_weather" in prompts[-1] and '{"sky": "sunny"}' in prompts[-1]
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"


def test_a_forced_tool_choice_opens_the_call_in_harmony(engine, server, monkeypatch):
    base, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    tok = engine.tokenizer
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode('{"city": "Rome"}<|call|>')))
    forced = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Rome?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=50,
    )  # fmt: skip
    [tool_call] = forced.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
