"""DeepSeek's DSML format end to end: the demo model served with the real DeepSeek-V4 and V3.2
chat templates (tests/data/templates) and scripted output, driven by the official SDKs. The
reasoning comes back as reasoning and a DSML call as a tool call, its arguments typed by their
`string` attribute, through OpenAI chat (whole and streamed), Anthropic messages and Responses;
the tool's result goes back through the template into the next prompt; a forced tool choice
opens the call as the template writes one.

The V4 checkpoint's tokenizer holds `｜DSML｜` as a special token (as a DeepSeek tokenizer may),
so its calls only parse because the parser reads the text with special tokens kept; the V3.2
one holds only DeepSeek's turn tokens."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest

from server_fixtures import (
    MODEL,
    WEATHER_ANSWER,
    WEATHER_ASK,
    WEATHER_THOUGHT,
    cpu_engine,
    demo_with_template,
    forced_tool_call,
    record_prompts,
    running_server,
    scripted,
)

TEMPLATES = Path(__file__).parent / "data" / "templates"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TURN_TOKENS = (BOS, EOS, "<｜User｜>", "<｜Assistant｜>")
DESCRIPTION = "Weather of a city"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS},
}
ARGUMENTS = {"city": "Paris", "days": 3}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}  # (the templates default to off)
RESULT = '{"sky": "sunny"}'
AFTER_RESULT = "The tool says sunny."


def dsml_call(wrapper: str = "tool_calls") -> str:
    """The weather call as DeepSeek writes it, after its answer text (none here)."""
    return (
        f'\n\n<｜DSML｜{wrapper}>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜{wrapper}>{EOS}"
    )


# what the model writes after a generation prompt that opened <think>
CALL = f"{WEATHER_THOUGHT}</think>{dsml_call()}"
ANSWER = f"{AFTER_RESULT}</think>{WEATHER_ANSWER}{EOS}"


def deepseek_checkpoint(dst: Path, template: str, special: tuple[str, ...]) -> Path:
    """The demo model with a recorded DeepSeek template, DeepSeek's turn tokens (and
    `special`) as special tokens, its BOS, and its end of sentence among the end tokens."""
    source = (TEMPLATES / template).read_text(encoding="utf-8")
    dst, tok = demo_with_template(dst, source, TURN_TOKENS + special)
    tok.bos_token = BOS
    tok.save_pretrained(dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    ends = gen.get("eos_token_id", [])
    gen["eos_token_id"] = [
        *(ends if isinstance(ends, list) else [ends]),
        tok.convert_tokens_to_ids(EOS),
    ]
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


@pytest.fixture(scope="module")
def v4_engine(tmp_path_factory):
    dst = tmp_path_factory.mktemp("deepseek-v4")
    return cpu_engine(deepseek_checkpoint(dst, "deepseek-ai-DeepSeek-V4.jinja", ("｜DSML｜",)))


@pytest.fixture(scope="module")
def v32_engine(tmp_path_factory):
    dst = tmp_path_factory.mktemp("deepseek-v3.2")
    return cpu_engine(deepseek_checkpoint(dst, "deepseek-ai-DeepSeek-V3.2.jinja", ()))


@pytest.fixture()
def v4(v4_engine):
    with running_server(v4_engine) as (base, core):
        yield v4_engine, base, core


@pytest.fixture()
def v32(v32_engine):
    with running_server(v32_engine) as (base, core):
        yield v32_engine, base, core


def script(engine, monkeypatch, text: str) -> None:
    """The model writes `text` (its tokens, up to and with the end of sentence)."""
    monkeypatch.setattr(engine, "_sample", scripted(engine, engine.tokenizer.encode(text)))


def openai_round_trip(engine, base: str, monkeypatch, call: str) -> list[str]:
    """OpenAI chat, thinking on: the scripted `call` comes back as reasoning and the weather
    call (whole and streamed), and the tool result leads to the scripted answer. Returns the
    prompts the engine was given."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    prompts = record_prompts(engine, monkeypatch)
    script(engine, monkeypatch, call)
    messages = [{"role": "user", "content": WEATHER_ASK}]
    request = dict(model=MODEL, tools=[WEATHER], max_tokens=100, extra_body=THINKING)
    whole = client.chat.completions.create(messages=messages, **request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == WEATHER_THOUGHT
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == ARGUMENTS  # days typed: 3, not "3"
    assert prompts[-1].endswith("<｜Assistant｜><think>")  # thinking on: the prompt opened it

    names, pieces, reasoning, finish = [], [], [], None
    for chunk in client.chat.completions.create(messages=messages, stream=True, **request):
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                pieces.append(d.function.arguments or "")
            assert not c.delta.content  # no markup leaks into the text
            finish = c.finish_reason or finish
    assert "".join(reasoning) == WEATHER_THOUGHT and finish == "tool_calls"
    assert names == ["get_weather"] and json.loads("".join(pieces)) == ARGUMENTS

    script(engine, monkeypatch, ANSWER)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": RESULT},
    ]
    second = client.chat.completions.create(messages=messages, **request)
    assert second.choices[0].message.content == WEATHER_ANSWER
    assert second.choices[0].message.model_extra["reasoning_content"] == AFTER_RESULT
    assert second.choices[0].finish_reason == "stop"
    return prompts


def test_v4_openai_chat_reasoning_and_a_typed_call_round_trip(v4, monkeypatch):
    engine, base, core = v4
    assert core.parser_name == "dsml" and core.parser_keeps_special
    prompts = openai_round_trip(engine, base, monkeypatch, CALL)
    # the call, its reasoning (kept: the conversation has tools) and the result went back
    assert (
        f"<｜Assistant｜><think>{WEATHER_THOUGHT}</think>{dsml_call()}"
        f"<｜User｜><tool_result>{RESULT}</tool_result><｜Assistant｜><think>"
    ) in prompts[-1]


def test_v3_2_openai_chat_round_trip_in_function_calls(v32, monkeypatch):
    engine, base, core = v32
    assert core.parser_name == "dsml_v32"
    prompts = openai_round_trip(
        engine, base, monkeypatch, f"{WEATHER_THOUGHT}</think>" + dsml_call("function_calls")
    )
    assert prompts[-1].endswith(
        f"{dsml_call('function_calls')}\n\n<function_results>\n<result>{RESULT}</result>\n"
        "</function_results>\n\n<think>"
    )


def test_v4_anthropic_messages_thinking_and_tool_use(v4, monkeypatch):
    engine, base, _ = v4
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    prompts = record_prompts(engine, monkeypatch)
    script(engine, monkeypatch, CALL)
    tool = {"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}
    messages = [{"role": "user", "content": WEATHER_ASK}]
    request = dict(
        model=MODEL, max_tokens=100, tools=[tool], thinking={"type": "enabled", "budget_tokens": 64}
    )
    whole = client.messages.create(messages=messages, **request)
    assert prompts[-1].endswith("<think>")  # `thinking` turned the template's on
    assert whole.stop_reason == "tool_use"
    assert [b.type for b in whole.content] == ["thinking", "tool_use"]
    thinking, use = whole.content
    assert thinking.thinking == WEATHER_THOUGHT
    assert use.name == "get_weather" and use.input == ARGUMENTS

    with client.messages.stream(messages=messages, **request) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[0].thinking == WEATHER_THOUGHT
    assert streamed.content[1].input == ARGUMENTS

    script(engine, monkeypatch, ANSWER)
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
        },
    ]
    second = client.messages.create(messages=messages, **request)
    assert [(b.type, getattr(b, "text", None)) for b in second.content][-1] == (
        "text",
        WEATHER_ANSWER,
    )
    assert second.stop_reason == "end_turn"
    assert f"{dsml_call()}<｜User｜><tool_result>{RESULT}</tool_result>" in prompts[-1]


def test_v4_responses_reasoning_and_function_call_items(v4, monkeypatch):
    engine, base, _ = v4
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    prompts = record_prompts(engine, monkeypatch)
    script(engine, monkeypatch, CALL)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": DESCRIPTION,
        "parameters": PARAMETERS,
    }
    request = dict(model=MODEL, tools=[tool], max_output_tokens=100, extra_body=THINKING)
    whole = client.responses.create(input=WEATHER_ASK, **request)
    assert whole.status == "completed"
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    reasoning, call = whole.output
    assert reasoning.content[0].text == WEATHER_THOUGHT
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGUMENTS
    assert not whole.output_text

    deltas, done = [], []
    for event in client.responses.create(input=WEATHER_ASK, stream=True, **request):
        if event.type == "response.function_call_arguments.delta":
            deltas.append(event.delta)
        if event.type == "response.output_item.done":
            done.append(event.item)
        assert event.type != "response.output_text.delta"
    assert [item.type for item in done] == ["reasoning", "function_call"]
    assert json.loads("".join(deltas)) == ARGUMENTS == json.loads(done[1].arguments)

    script(engine, monkeypatch, ANSWER)
    history = [
        {"role": "user", "content": WEATHER_ASK},
        *[item.model_dump(exclude_none=True) for item in whole.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
    ]
    second = client.responses.create(input=history, **request)
    assert second.output_text == WEATHER_ANSWER
    assert (
        f"<think>{WEATHER_THOUGHT}</think>{dsml_call()}<｜User｜><tool_result>{RESULT}"
    ) in prompts[-1]


@pytest.mark.parametrize("version", ["v4", "v32"])
def test_a_forced_tool_choice_opens_the_call_as_the_template_writes_it(
    version, request, monkeypatch
):
    engine, base, _ = request.getfixturevalue(version)
    wrapper = "tool_calls" if version == "v4" else "function_calls"
    prompts = record_prompts(engine, monkeypatch)
    rest = (
        '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜{wrapper}>{EOS}"
    )
    tool_call = forced_tool_call(engine, base, monkeypatch, WEATHER, rest, "Rome?")
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
    # thinking off: the prompt closed <think>, and the call's opening follows it
    assert prompts[-1].endswith(
        f'</think>\n\n<｜DSML｜{wrapper}>\n<｜DSML｜invoke name="get_weather">\n'
    )
