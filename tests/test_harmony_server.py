"""Harmony end to end (gpt-oss's format): a checkpoint whose tokenizer holds Harmony's special
tokens and whose chat template writes channels, served with scripted output and driven by the
official `openai` SDK: reasoning comes back as reasoning, a call on the commentary channel as a
tool call (whole and streamed), the tool result goes back through the template, and
`reasoning_effort` reaches the template."""

from __future__ import annotations

import json

import pytest

from server_fixtures import (
    WEATHER_ANSWER,
    WEATHER_THOUGHT,
    cpu_engine,
    demo_with_template,
    forced_tool_call,
    running_server,
    tool_use_round_trip,
)

SPECIAL = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]
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
    call = (
        f"<|channel|>analysis<|message|>{WEATHER_THOUGHT}<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    # the model answers on the final channel
    answer = f"<|channel|>final<|message|>{WEATHER_ANSWER}<|return|>"
    prompts = tool_use_round_trip(
        engine, base, monkeypatch, WEATHER, call, {"city": "Paris"}, answer, reasoning_effort="high"
    )
    assert "Reasoning: high" in prompts[0]  # reasoning_effort reached the template
    assert "to=functions.get_weather" in prompts[-1]  # the call went back through it


def test_a_forced_tool_choice_opens_the_call_in_harmony(engine, server, monkeypatch):
    rest = '{"city": "Rome"}<|call|>'
    tool_call = forced_tool_call(engine, server[0], monkeypatch, WEATHER, rest, "Rome?")
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
