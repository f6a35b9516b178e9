"""Kimi-K2's and Kimi-Linear's, MiniMax-M2's and Gemma-4's formats end to end: the demo model
served with each release's own chat template (tests/data/templates/) and the special tokens its
tokenizer has, its output scripted, driven by the official SDKs through the three APIs, whole
and streamed. The reasoning comes back as reasoning (OpenAI's `reasoning_content`, an Anthropic
thinking block, a Responses reasoning item), the call as a tool call with typed arguments
(`tool_calls`, a tool_use block, a function_call item), and the tool's result goes back through
the template into the next prompt, with the call and its reasoning as the template writes them.
(Kimi-Linear is an Instruct model: it writes no reasoning, and gets none back.)"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest

from server_fixtures import (
    MODEL,
    WEATHER,
    WEATHER_ANSWER,
    WEATHER_ASK,
    WEATHER_THOUGHT,
    cpu_engine,
    demo_with_template,
    forced_tool_call,
    record_prompts,
    running_server,
    scripted,
    tool_use_round_trip,
)

TEMPLATES = Path(__file__).parent / "data" / "templates"
ARGS = {"city": "Paris", "days": 3}
RESULT = '{"sky": "sunny"}'
SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
BEGIN, ARG, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
FRESH_ID = r"call_[0-9a-f]{24}"


@dataclass(frozen=True)
class Format:
    template: str  # the release's, in TEMPLATES
    parser: str
    special: tuple[str, ...]  # its tokenizer's special tokens, added to the demo's
    end: str  # the token that ends the model's turn
    call: str  # the model's output: reasoning WEATHER_THOUGHT, then get_weather(**ARGS)
    answer: str  # the model's output: the reply WEATHER_ANSWER
    forced_rest: str  # what it writes after a forced call's opening: get_weather(city="Rome")
    ids: tuple[str, str]  # the call's id: in the OpenAI APIs, in Anthropic's (patterns)
    written_back: tuple[str, ...]  # what the next prompt holds: the call, its reasoning, result
    more_ends: tuple[str, ...] = ()  # other tokens that end its output (after its calls)
    reasons: bool = True  # whether the model writes reasoning (WEATHER_THOUGHT) before its call
    # What the next prompt holds when the conversation came through Anthropic's API, where it
    # differs: a template that writes the request's call ids writes that API's (anthropic_api.py)


KIMI = Format(
    template="Kimi-K2-Thinking.jinja",
    parser="kimi_k2",
    special=(
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        SECTION,
        SECTION_END,
        BEGIN,
        ARG,
        END,
    ),
    end="<|im_end|>",
    call=f"<think>{WEATHER_THOUGHT}</think>{SECTION}{BEGIN}functions.get_weather:0{ARG}"
    f"{json.dumps(ARGS)}{END}{SECTION_END}<|im_end|>",
    answer=f"<think></think>{WEATHER_ANSWER}<|im_end|>",
    forced_rest=f'0{ARG}{{"city": "Rome"}}{END}{SECTION_END}<|im_end|>',
    # the model's own id; Anthropic's API allows only [a-zA-Z0-9_-] (anthropic_api.py)
    ids=(r"functions\.get_weather:0", "functions_get_weather_0"),
    written_back=(
        f"<think>{WEATHER_THOUGHT}</think>{SECTION}{BEGIN}functions.get_weather:0{ARG}"
        f"{json.dumps(ARGS)}{END}{SECTION_END}<|im_end|>",
        f"<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{RESULT}",
    ),
)
KIMI_LINEAR_CALL = (
    f"{SECTION}{BEGIN}functions.get_weather:0{ARG}{json.dumps(ARGS)}{END}{SECTION_END}"
)
KIMI_LINEAR = Format(
    template="Kimi-Linear-48B-A3B-Instruct.jinja",
    parser="kimi_k2",
    special=KIMI.special,
    end="<|im_end|>",
    # (an Instruct model: no reasoning, and its template writes none back)
    call=f"{KIMI_LINEAR_CALL}<|im_end|>",
    answer=f"{WEATHER_ANSWER}<|im_end|>",
    forced_rest=KIMI.forced_rest,
    ids=KIMI.ids,
    # its template writes the call's id as the request gives it: the model's own
    written_back=(
        f"<|im_assistant|>assistant<|im_middle|>{KIMI_LINEAR_CALL}<|im_end|>",
        f"<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{RESULT}<|im_end|>",
    ),
    reasons=False,
)
MINIMAX_CALL = (
    '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>'
    '\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>'
)
MINIMAX = Format(
    template="MiniMax-M2.jinja",
    parser="minimax_m2",
    special=("]~!b[", "]~b]", "[e~["),
    end="[e~[",
    # (the generation prompt opened <think>: the model goes on inside it)
    call=f"{WEATHER_THOUGHT}\n</think>\n\n{MINIMAX_CALL}[e~[",
    answer=f"</think>\n\n{WEATHER_ANSWER}[e~[",
    forced_rest='<parameter name="city">Rome</parameter>\n</invoke>\n</minimax:tool_call>[e~[',
    ids=(FRESH_ID, FRESH_ID),
    written_back=(
        f"]~b]ai\n<think>\n{WEATHER_THOUGHT}\n</think>\n\n\n{MINIMAX_CALL}[e~[",
        f"]~b]tool\n<response>{RESULT}</response>[e~[",
    ),
)


Q = '<|"|>'  # Gemma-4's string marks
GEMMA4_CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>"
GEMMA4 = Format(
    template="google-gemma-4-31B-it.jinja",
    parser="gemma4",
    special=(
        "<|turn>",
        "<turn|>",
        "<|channel>",
        "<channel|>",
        "<|tool_call>",
        "<tool_call|>",
        "<|tool_response>",
        "<tool_response|>",
        "<|tool>",
        "<tool|>",
        "<|think|>",
        Q,
    ),
    end="<turn|>",
    call=f"<|channel>thought\n{WEATHER_THOUGHT}<channel|>{GEMMA4_CALL}<|tool_response>",
    answer=f"{WEATHER_ANSWER}<turn|>",
    forced_rest=f"city:{Q}Rome{Q}}}<tool_call|><|tool_response>",
    ids=(FRESH_ID, FRESH_ID),
    # (the tools' results are written in the model's turn; the template writes the reasoning
    # of a turn with calls back, after the user's last message)
    written_back=(
        f"<|turn>model\n<|channel>thought\n{WEATHER_THOUGHT}\n<channel|>{GEMMA4_CALL}",
        f"<|tool_response>response:get_weather{{value:{Q}{RESULT}{Q}}}<tool_response|>",
    ),
    more_ends=("<|tool_response>",),
)


@pytest.fixture(
    scope="module",
    params=[KIMI, KIMI_LINEAR, MINIMAX, GEMMA4],
    ids=["kimi", "kimi-linear", "minimax", "gemma4"],
)
def fmt(request) -> Format:
    return request.param


@pytest.fixture(scope="module")
def engine(fmt, tmp_path_factory):
    """The demo model with the release's template and special tokens (in its vocabulary's
    unused rows), its turn's end among the end tokens."""
    template = (TEMPLATES / fmt.template).read_text()
    dst, tok = demo_with_template(tmp_path_factory.mktemp(fmt.parser), template, fmt.special)
    gen = json.loads((dst / "generation_config.json").read_text())
    ends = [tok.convert_tokens_to_ids(t) for t in (fmt.end, *fmt.more_ends)]
    gen["eos_token_id"] = [*gen["eos_token_id"], *ends]
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return cpu_engine(dst)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as s:
        yield s


def script(engine, monkeypatch, text: str) -> None:
    monkeypatch.setattr(engine, "_sample", scripted(engine, engine.tokenizer.encode(text)))


def test_openai_chat_gives_reasoning_and_a_typed_call_and_takes_the_result(
    fmt, engine, server, monkeypatch
):
    base, core = server
    assert core.parser_name == fmt.parser  # picked from the release's template
    thought = WEATHER_THOUGHT if fmt.reasons else None
    prompts = tool_use_round_trip(
        engine, base, monkeypatch, WEATHER, fmt.call, ARGS, fmt.answer, thought
    )
    for text in fmt.written_back:
        assert text in prompts[-1]


def test_anthropic_gives_a_thinking_block_and_a_tool_use(fmt, engine, server, monkeypatch):
    client = anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)
    prompts = record_prompts(engine, monkeypatch)
    script(engine, monkeypatch, fmt.call)
    tools = [
        {
            "name": "get_weather",
            "description": "Weather of a city",
            "input_schema": WEATHER["function"]["parameters"],
        }
    ]
    messages = [{"role": "user", "content": WEATHER_ASK}]
    whole = client.messages.create(model=MODEL, max_tokens=100, tools=tools, messages=messages)
    with client.messages.stream(
        model=MODEL, max_tokens=100, tools=tools, messages=messages
    ) as stream:
        streamed = stream.get_final_message()
    for reply in (whole, streamed):
        assert reply.stop_reason == "tool_use"
        *thinking, use = reply.content
        if fmt.reasons:
            assert [(b.type, b.thinking) for b in thinking] == [("thinking", WEATHER_THOUGHT)]
        else:
            assert thinking == []
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == ARGS
        assert re.fullmatch(fmt.ids[1], use.id)

    script(engine, monkeypatch, fmt.answer)
    # (the result of the whole reply's call, under its id: Gemma-4's template names a result
    # by the call whose id it carries, and fails on a result of no call)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": whole.content[-1].id, "content": RESULT}
            ],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=100, tools=tools, messages=messages)
    assert [b.text for b in second.content if b.type == "text"] == [WEATHER_ANSWER]
    for text in fmt.written_back:
        assert text in prompts[-1]


def test_responses_give_a_reasoning_item_and_a_function_call(fmt, engine, server, monkeypatch):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
    prompts = record_prompts(engine, monkeypatch)
    script(engine, monkeypatch, fmt.call)
    tool = {"type": "function", **WEATHER["function"]}
    ask = {"model": MODEL, "input": WEATHER_ASK, "tools": [tool], "max_output_tokens": 100}
    whole = client.responses.create(**ask)
    [streamed] = [
        e.response
        for e in client.responses.create(**ask, stream=True)
        if e.type == "response.completed"
    ]
    for response in (whole, streamed):
        *reasoning, call = response.output
        if fmt.reasons:
            [item] = reasoning
            assert item.type == "reasoning" and item.content[0].text == WEATHER_THOUGHT
        else:
            assert reasoning == []
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == ARGS
        assert re.fullmatch(fmt.ids[0], call.call_id)

    script(engine, monkeypatch, fmt.answer)
    thought = [
        {
            "type": "reasoning",
            "id": item.id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": WEATHER_THOUGHT}],
        }
        for item in reasoning
    ]
    second = client.responses.create(
        model=MODEL,
        tools=[tool],
        input=[
            {"role": "user", "content": WEATHER_ASK},
            *thought,
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
        ],
    )
    assert second.output_text == WEATHER_ANSWER
    for text in fmt.written_back:
        assert text in prompts[-1]


def test_a_forced_tool_choice_opens_the_call_as_the_model_writes_it(
    fmt, engine, server, monkeypatch
):
    tool_call = forced_tool_call(engine, server[0], monkeypatch, WEATHER, fmt.forced_rest, "Rome?")
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
    assert re.fullmatch(fmt.ids[0], tool_call.id)


def test_kimi_ids_replayed_through_anthropic_come_back_as_the_models_own():
    """Anthropic's tool_use ids allow only [a-zA-Z0-9_-]: Kimi's `functions.NAME:IDX` goes
    out as `functions_NAME_IDX` and comes back as the model wrote it (names with `_` too);
    other parsers' ids are left as they are."""
    from freetoken.server.anthropic_api import model_call_id

    assert model_call_id("functions_get_weather_0", "kimi_k2") == "functions.get_weather:0"
    assert model_call_id("functions_read_12", "kimi_k2") == "functions.read:12"
    assert model_call_id("toolu_01abc", "kimi_k2") == "toolu_01abc"
    assert model_call_id("functions_get_weather_0", "qwen3") == "functions_get_weather_0"
