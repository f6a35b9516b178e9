"""DeepSeek's DSML output parser (server/parsers/dsml.py): reasoning, answer text and
`<｜DSML｜invoke>` calls (V4's `tool_calls` block, V3.2's `function_calls`), typed by their
`string` attribute; the same events however the text is chunked; and what the real chat
templates write for a past call parses back to that call."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken import chat_template
from freetoken.server.events import ToolCallArgsDelta, ToolCallStart
from freetoken.server.parsers import (
    forced_tool_call,
    keeps_special_tokens,
    make_parser,
    parser_for_template,
    prompt_opens_reasoning,
)
from test_parsers import calls, parsed

TEMPLATES = Path(__file__).parent / "data" / "templates"
V4, V32 = "deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V3.2.jinja"
EOS = "<｜end▁of▁sentence｜>"


def parse(chunks, name="dsml", **options):
    return parsed(name, chunks, None, **options)


def block(wrapper, *invokes):
    return f"\n\n<｜DSML｜{wrapper}>\n{''.join(invokes)}</｜DSML｜{wrapper}>"


def invoke(name, *params):
    return f'<｜DSML｜invoke name="{name}">\n{"".join(params)}</｜DSML｜invoke>\n'


def param(name, string, value):
    return f'<｜DSML｜parameter name="{name}" string="{string}">{value}</｜DSML｜parameter>\n'


WEATHER = (
    "They want the weather.</think>Let me look."
    + block(
        "tool_calls",
        invoke(
            "get_weather", param("city", "true", 'Paris "15e"\n<b>'), param("days", "false", "3")
        ),
        invoke(
            "edit",
            param("edits", "false", '[{"old": "x", "new": null}]'),
            param("flag", "false", "true"),
            param("note", "false", "not JSON"),
        ),
        invoke("list_files"),
    )
    + EOS
)
WEATHER_CALLS = [
    ("get_weather", {"city": 'Paris "15e"\n<b>', "days": 3}),
    ("edit", {"edits": [{"old": "x", "new": None}], "flag": True, "note": "not JSON"}),
    ("list_files", {}),
]


def test_reasoning_text_and_calls_typed_by_their_string_attribute():
    events, parser = parse([WEATHER], starts_in_reasoning=True)
    assert events[:2] == [("think", "They want the weather."), ("text", "Let me look.")]
    assert calls(events) == WEATHER_CALLS
    assert [e[0] for e in events].count("text") == 1  # no markup, no whitespace as text
    assert parser.saw_tool_call


def test_v3_2_writes_function_calls_and_a_think_block_of_its_own():
    text = "<think>\nHm.\n</think>\n\n" + block(
        "function_calls", invoke("f", param("n", "false", "2.5")), invoke("g")
    )
    for name in ("dsml", "dsml_v32"):  # each reads both wrappers
        events, _ = parse([text], name)
        assert events[0] == ("think", "Hm.")
        assert calls(events) == [("f", {"n": 2.5}), ("g", {})]


def test_values_that_are_not_strict_json_stay_text():
    text = block(
        "tool_calls",
        invoke(
            "f",
            param("a", "false", "NaN"),
            param("b", "false", "1e999"),
            param("c", "false", ""),
            param("d", "true", ""),
        ),
    )
    events, _ = parse([text])
    assert calls(events) == [("f", {"a": "NaN", "b": "1e999", "c": "", "d": ""})]


def test_a_string_value_streams_as_it_comes():
    parser = make_parser("dsml")
    head = block("tool_calls", invoke("write", param("text", "true", "")))
    head = head[: head.index("</｜DSML｜parameter>")]
    events = parser.feed(head + "line one\nli")
    assert isinstance(events[0], ToolCallStart) and events[0].name == "write"
    assert "".join(e.text for e in events[1:]) == '{"text": "line one\\nli'
    # a closing tag cut short is held until it is known to be one
    assert [e.text for e in parser.feed("ne two</｜DSML｜para")] == ["ne two"]
    events = parser.feed("meter>\n</｜DSML｜invoke>") + parser.finish()
    assert events[0] == ToolCallArgsDelta(0, '"}')


def test_the_end_of_output_closes_what_is_open():
    cut = block("tool_calls", invoke("f", param("a", "true", "abc"), param("n", "false", "7")))
    events, _ = parse([cut[: cut.index("bc</")] + "b</｜DSML｜param"])
    assert calls(events) == [("f", {"a": "ab"})]
    events, _ = parse([cut[: cut.index("7") + 1]])
    assert calls(events) == [("f", {"a": "abc", "n": 7})]
    events, _ = parse([cut[: cut.index('<｜DSML｜parameter name="n"')] + "<｜DSML｜par"])
    assert calls(events) == [("f", {"a": "abc"})]


@pytest.mark.parametrize(
    "text",
    [
        "See <｜DSML｜tool_calls> in the docs.",  # the wrapper's tag in prose
        "Writing <｜DSML｜tool_ca",  # a tag cut off by the end of output
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f',  # a block whose call never opened
        "<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>",  # a block without calls
        '<｜DSML｜invoke name="f">\n</｜DSML｜invoke>',  # an invoke outside any block
    ],
)
def test_dsml_markup_that_never_becomes_a_call_is_text(text):
    events, parser = parse([text])
    # (as in the Qwen parser, whitespace before an opening tag is dropped)
    assert events == [("text", text.replace(" <｜DSML｜tool_calls>", "<｜DSML｜tool_calls>"))]
    assert not parser.saw_tool_call


def test_a_broken_call_ends_where_it_breaks_and_the_rest_is_text():
    broken = invoke("f", param("a", "true", "x"), "oops ", param("b", "true", "y"))
    text = block("tool_calls", broken)
    events, _ = parse([text])
    assert calls(events) == [("f", {"a": "x"})]
    assert events[-1][0] == "text" and events[-1][1].startswith("oops <｜DSML｜parameter")
    # a call left open is closed by the next one or by the block's end
    unclosed = '<｜DSML｜invoke name="f">\n' + param("a", "true", "1")
    text = f"<｜DSML｜tool_calls>\n{unclosed}{unclosed}</｜DSML｜tool_calls>{EOS}"
    events, _ = parse([text])
    assert calls(events) == [("f", {"a": "1"}), ("f", {"a": "1"})]
    assert [e for e in events if e[0] == "text"] == []


def test_the_end_of_sentence_is_dropped_and_text_may_follow_a_block():
    events, _ = parse(["Done." + EOS])
    assert events == [("text", "Done.")]
    events, _ = parse([block("tool_calls", invoke("f")) + "\nAfter." + EOS])
    assert calls(events) == [("f", {})] and events[-1] == ("text", "After.")


TEXTS = [WEATHER, WEATHER.replace("tool_calls", "function_calls"), WEATHER[:200], WEATHER[:-60]]


@pytest.mark.parametrize("text", TEXTS, ids=["v4", "v3.2", "cut early", "cut late"])
@pytest.mark.parametrize("starts_in_reasoning", [True, False])
def test_one_character_at_a_time_is_the_same_as_whole(text, starts_in_reasoning):
    whole = parse([text], starts_in_reasoning=starts_in_reasoning)[0]
    assert parse(list(text), starts_in_reasoning=starts_in_reasoning)[0] == whole


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(TEXTS), st.data())
def test_the_events_do_not_depend_on_the_chunking(text, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=20)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    assert parse(chunks, starts_in_reasoning=True)[0] == parse([text], starts_in_reasoning=True)[0]


FRAGMENTS = [
    "<think>",
    "</think>",
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    "<｜DSML｜function_calls>",
    '<｜DSML｜invoke name="f">',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="a" string="true">',
    '<｜DSML｜parameter name="b" string="false">',
    '<｜DSML｜parameter name="c">',
    "</｜DSML｜parameter>",
    "<｜DSML｜",
    "</｜DSML｜para",
    EOS,
    "\n",
    " ",
    "x",
    '"',
    "\\",
    "{",
    "}",
    "[1, 2]",
    "NaN",
    "<",
    ">",
    "é😀",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.data(), st.booleans())
def test_any_markup_any_chunking(fragments, data, starts_in_reasoning):
    """Markup soup: no crash, chunking never matters, every call's arguments a JSON object."""
    text = "".join(fragments)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    whole, _ = parse([text], starts_in_reasoning=starts_in_reasoning)
    assert parse(chunks, starts_in_reasoning=starts_in_reasoning)[0] == whole
    for _, arguments in calls(whole):
        assert isinstance(arguments, dict)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_damaged_calls_any_chunking(data):
    """Well-formed calls, damaged anywhere (a character dropped, markup inserted, the text cut
    short): chunking never matters and every call's arguments are a JSON object."""
    text = TEXTS[data.draw(st.integers(0, 1))]
    pos = data.draw(st.integers(0, len(text)))
    edit = data.draw(st.sampled_from(["drop", "insert", "cut"]))
    if edit == "cut":
        text = text[:pos]
    elif edit == "drop":
        text = text[:pos] + text[pos + 1 :]
    else:
        text = text[:pos] + data.draw(st.sampled_from(FRAGMENTS)) + text[pos:]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=20)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    whole, _ = parse([text], starts_in_reasoning=True)
    assert parse(chunks, starts_in_reasoning=True)[0] == whole
    assert all(isinstance(arguments, dict) for _, arguments in calls(whole))


def test_the_templates_pick_it_and_a_forced_call_opens_as_they_write_it():
    assert parser_for_template((TEMPLATES / V4).read_text()) == "dsml"
    flash = (TEMPLATES / "deepseek-ai-DeepSeek-V4-Flash-0731.jinja").read_text()
    assert parser_for_template(flash) == "dsml"
    assert parser_for_template((TEMPLATES / V32).read_text()) == "dsml_v32"
    assert keeps_special_tokens("dsml") and keeps_special_tokens("dsml_v32")
    opening = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    assert forced_tool_call("dsml", "get_weather", False) == opening
    assert forced_tool_call("dsml", "get_weather", True) == "</think>" + opening
    assert forced_tool_call("dsml_v32", None, False) == (
        '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="'
    )
    # the forced opening fed first (after a prompt that opened <think>), the model's after it
    rest = param("city", "true", "Lima") + "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS
    events, _ = parse(
        [forced_tool_call("dsml", "get_weather", True), rest], starts_in_reasoning=True
    )
    assert events == [("start", 0, "get_weather"), ("args", 0, '{"city": "Lima"}'), ("end", 0)]
    events, _ = parse([forced_tool_call("dsml", None, False), 'f">\n', "</｜DSML｜invoke>"])
    assert calls(events) == [("f", {})]


ARGUMENTS = {"city": 'Zürich <b>\n"x"', "days": 3, "units": ["C", None], "strict": False}


@pytest.mark.parametrize("template", [V4, V32])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("as_text", [True, False])
def test_what_the_template_writes_for_a_call_parses_back_to_it(template, thinking, as_text):
    """The assistant turn the real template renders for a past call, read as model output
    after its generation prompt, gives that call back (the arguments as a JSON string or an
    object in the message)."""
    source = (TEMPLATES / template).read_text()
    arguments = json.dumps(ARGUMENTS) if as_text else ARGUMENTS
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
                {"type": "function", "function": {"name": "now", "arguments": {}}},
            ],
        },
    ]
    special = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": EOS}
    prompt = chat_template.render(
        source, messages[:1], None, True, special, enable_thinking=thinking
    )
    full = chat_template.render(source, messages, None, False, special, enable_thinking=thinking)
    # The generation prompt ends by opening <think> or closing it (V3.2's as `<think></think>`,
    # where its past turns have `</think>` alone): the model writes what follows that.
    marker = "<think>" if thinking else "</think>"
    assert prompt.endswith(marker) and prompt_opens_reasoning(prompt) == thinking
    turn = full[full.rindex("<｜Assistant｜>") :]
    output = turn[turn.index(marker) + len(marker) :]
    events, _ = parse([output], parser_for_template(source), starts_in_reasoning=thinking)
    assert calls(events) == [("get_weather", ARGUMENTS), ("now", {})]
    texts = [e for e in events if e[0] in ("think", "text")]
    assert texts == ([("think", "Use the tool.")] if thinking else []) + [("text", "Checking.")]
