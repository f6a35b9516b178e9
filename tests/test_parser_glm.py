"""The GLM-4.5 output parser (server/parsers/glm.py): reasoning, answer text and
`<arg_key>` / `<arg_value>` tool calls, the same events however the text is chunked; argument
types from the request's tool schemas."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.server.parsers import forced_tool_call, parser_for_template
from test_parsers import calls, parsed


def tool(name: str, **types: str) -> dict:
    properties = {key: {"type": t} for key, t in types.items()}
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool("get_weather", city="string", days="integer", code="string"),
    tool("edit", path="string", edits="array"),
]


def parse(chunks, tools=TOOLS, **options):
    return parsed("glm45", chunks, tools, **options)


WEATHER = (
    "<think>They want the weather.</think>\nLet me look.\n"
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>code</arg_key>\n"
    "<arg_value>75001</arg_value>\n</tool_call>"
)


def test_reasoning_text_and_a_call_with_arguments_typed_by_the_schema():
    events, parser = parse([WEATHER])
    assert events[0] == ("think", "They want the weather.")
    assert events[1] == ("text", "Let me look.")
    # days is an integer by the schema; code, a string, stays one though it reads as a number
    assert calls(events) == [("get_weather", {"city": "Paris", "days": 3, "code": "75001"})]
    assert parser.saw_tool_call


def test_glm_4_7_writes_no_newline_after_the_name_and_calls_follow_each_other():
    text = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
        '\n<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>a <b> "c".py</arg_value>\n'
        '<arg_key>edits</arg_key>\n<arg_value>[{"old": "x", "new": "</arg_key>"}]'
        "</arg_value>\n</tool_call>"
    )
    events, _ = parse([text])
    assert calls(events) == [
        ("get_weather", {"city": "Oslo"}),
        ("edit", {"path": 'a <b> "c".py', "edits": [{"old": "x", "new": "</arg_key>"}]}),
    ]
    assert [e[0] for e in events].count("text") == 0  # no whitespace between calls as text


def test_without_a_schema_values_that_read_as_json_are_json():
    text = (
        "<tool_call>unknown\n<arg_key>n</arg_key><arg_value>2.5</arg_value>"
        "<arg_key>s</arg_key><arg_value>hello world</arg_value>"
        '<arg_key>o</arg_key><arg_value>{"a": [1, true, null]}</arg_value></tool_call>'
    )
    events, _ = parse([text], tools=None)
    want = {"n": 2.5, "s": "hello world", "o": {"a": [1, True, None]}}
    assert calls(events) == [("unknown", want)]


def test_a_call_with_no_arguments_and_one_cut_off_by_the_end_of_output():
    events, _ = parse(["<tool_call>list_files\n</tool_call>"])
    assert calls(events) == [("list_files", {})]
    events, _ = parse(
        ["<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Rome</arg_value>\n</tool_c"]
    )
    assert calls(events) == [("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize(
    "body",
    [
        "\n<arg_key>city</arg_key><arg_value>x</arg_value>",  # no name
        "Sure, I can do that",  # prose, not a name
        "get_weather\n<arg_key>city</arg_key>",  # a key without its value
        "get_weather\n<arg_key>city</arg_key><arg_value>x</arg_value> and then some",  # stray text
    ],
)
def test_a_body_that_is_not_a_call_comes_back_as_text(body):
    events, parser = parse([f"Before <tool_call>{body}</tool_call> after"])
    # (as the Qwen parser does: the space before the call's tag is dropped, the rest kept)
    assert events == [("text", f"Before<tool_call>{body}</tool_call> after")]
    assert not parser.saw_tool_call


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_events_do_not_depend_on_the_chunking(data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(WEATHER) - 1), max_size=12)))
    bounds = [0, *cuts, len(WEATHER)]
    chunks = [WEATHER[a:b] for a, b in itertools.pairwise(bounds)]
    assert parse(chunks)[0] == parse([WEATHER])[0]


def test_the_template_picks_it_and_a_forced_call_opens_as_glm_writes_it():
    template = "{% for m in messages %}<|{{ m.role }}|>{% endfor %}<arg_key>{{ k }}</arg_key>"
    assert parser_for_template(template) == "glm45"
    assert forced_tool_call("glm45", "get_weather", False) == "<tool_call>get_weather\n"
    assert forced_tool_call("glm45", None, True) == "</think><tool_call>"
    # a forced opening fed first, the model's continuation after it
    events, _ = parse(
        [
            "<tool_call>get_weather\n",
            "<arg_key>city</arg_key><arg_value>Lima",
            "</arg_value></tool_call>",
        ]
    )
    assert calls(events) == [("get_weather", {"city": "Lima"})]


def test_values_are_strict_json_and_schemas_that_allow_strings_keep_them():
    tools = [tool("f", a="string"), tool("g")]
    tools[1]["function"]["parameters"]["properties"] = {
        "maybe": {"type": ["string", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "choice": {"enum": ["1", "2"]},
        "n": {"type": "number"},
    }
    text = (
        "<tool_call>g\n<arg_key>maybe</arg_key><arg_value>123</arg_value>"
        "<arg_key>either</arg_key><arg_value>true</arg_value>"
        "<arg_key>choice</arg_key><arg_value>1</arg_value>"
        "<arg_key>n</arg_key><arg_value>NaN</arg_value></tool_call>"
        "<tool_call>h\n<arg_key>x</arg_key><arg_value>Infinity</arg_value>"
        "<arg_key>y</arg_key><arg_value>1e999</arg_value></tool_call>"
    )
    events, _ = parse([text], tools=tools)
    assert calls(events) == [
        ("g", {"maybe": "123", "either": "true", "choice": "1", "n": "NaN"}),
        ("h", {"x": "Infinity", "y": "1e999"}),
    ]
