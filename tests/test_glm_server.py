"""GLM-4.5's format end to end: a checkpoint whose chat template writes GLM's `<arg_key>` /
`<arg_value>` calls, served with scripted output and driven by the official `openai` SDK:
reasoning comes back as reasoning, a call as a tool call with its arguments typed by the
request's schema (whole and streamed), and the tool result goes back through the template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_fixtures import (
    WEATHER,
    WEATHER_ANSWER,
    WEATHER_THOUGHT,
    cpu_engine,
    demo_with_template,
    forced_tool_call,
    running_server,
    tool_use_round_trip,
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
    call = (
        f"<think>{WEATHER_THOUGHT}</think>\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
        "<arg_value>3</arg_value>\n</tool_call><|im_end|>"
    )
    answer = f"<think></think>{WEATHER_ANSWER}<|im_end|>"
    # (the days' value typed by the request's schema: 3, not "3")
    prompts = tool_use_round_trip(
        engine, base, monkeypatch, WEATHER, call, {"city": "Paris", "days": 3}, answer
    )
    # the result went back through the template as GLM's observation
    assert "<arg_key>days</arg_key>\n<arg_value>3</arg_value>" in prompts[-1]
    assert "<|observation|>" in prompts[-1]


def test_a_forced_tool_choice_opens_the_call_as_glm_writes_it(engine, server, monkeypatch):
    rest = "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call><|im_end|>"
    tool_call = forced_tool_call(engine, server[0], monkeypatch, WEATHER, rest, "Rome?")
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}


# GLM-4.7-Flash's real template (GLM-5.x writes the same format): no newlines in a call, and
# the generation prompt opens <think> unless thinking is turned off
RECORDED = Path(__file__).parent / "data" / "templates" / "GLM-4.7-Flash.jinja"


@pytest.fixture(scope="module")
def glm47_engine(tmp_path_factory):
    template = RECORDED.read_text(encoding="utf-8")
    return cpu_engine(demo_with_template(tmp_path_factory.mktemp("glm47"), template)[0])


def test_the_recorded_glm_4_7_template_picks_glm45_and_round_trips_a_call(
    glm47_engine, monkeypatch
):
    call = (
        f"{WEATHER_THOUGHT}</think><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value>"
        "</tool_call><|im_end|>"
    )
    answer = f"</think>{WEATHER_ANSWER}<|im_end|>"
    with running_server(glm47_engine) as (base, core):
        assert core.parser_name == "glm45"
        prompts = tool_use_round_trip(
            glm47_engine, base, monkeypatch, WEATHER, call, {"city": "Paris", "days": 3}, answer
        )
    assert prompts[0].endswith("<|user|>Weather in Paris?<|assistant|><think>")
    # the call (with its reasoning, the turn after the last user message) and the result
    assert prompts[-1].endswith(
        f"<|assistant|><think>{WEATHER_THOUGHT}</think><tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
        '<arg_value>3</arg_value></tool_call><|observation|><tool_response>{"sky": "sunny"}'
        "</tool_response><|assistant|><think>"
    )
