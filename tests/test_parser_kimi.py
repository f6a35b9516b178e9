"""The Kimi-K2 output parser (server/parsers/kimi.py): reasoning, answer text and the call
section's calls with the model's own ids, the same events however the text is chunked, read
off what the release's own template (tests/data/templates/) writes."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken import chat_template
from freetoken.server.events import ToolCallArgsDelta, ToolCallStart
from freetoken.server.parsers import (
    forced_tool_call,
    keeps_special_tokens,
    make_parser,
    parser_for_template,
)
from test_parsers import collapse

TEMPLATES = Path(__file__).parent / "data" / "templates"
FRESH = re.compile(r"call_[0-9a-f]{24}")  # an id the parser made up
IDS = re.compile(rf"(functions\.)?[\w.]+(:\d+)?|{FRESH.pattern}")  # the model's, or fresh
SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
BEGIN, ARGS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def parse(chunks, **options):
    """(collapsed events, the calls' ids ("fresh" for one the parser made up), the parser)."""
    parser = make_parser("kimi_k2", **options)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    ids = [
        "fresh" if FRESH.fullmatch(e.id) else e.id for e in events if isinstance(e, ToolCallStart)
    ]
    return collapse(events, IDS), ids, parser


def call(index: int, name: str, args: str) -> list[tuple]:
    return [("start", index, name), ("args", index, args), ("end", index)]


def assistant_turn(template: str, message: dict) -> str:
    """What the template writes for `message`, an assistant turn after a user's."""
    source = (TEMPLATES / template).read_text()
    chat = [{"role": "user", "content": "Weather in Paris?"}, message]
    text = chat_template.render(source, chat, add_generation_prompt=False)
    return text.split("<|im_assistant|>assistant<|im_middle|>")[-1].removesuffix("<|im_end|>")


WEATHER_CALLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    },
    {"type": "function", "function": {"name": "list_files", "arguments": {}}},
]
# What K2-Thinking's template writes for a turn with reasoning, text and two calls
TURN = assistant_turn(
    "Kimi-K2-Thinking.jinja",
    {
        "role": "assistant",
        "reasoning_content": "They want the weather.",
        "content": "Let me look.",
        "tool_calls": WEATHER_CALLS,
    },
)
EXPECTED = [
    ("think", "They want the weather."),
    ("text", "Let me look."),
    *call(0, "get_weather", '{"city": "Paris", "days": 3}'),
    *call(1, "list_files", "{}"),
]


def test_the_templates_turn_parses_back_with_the_templates_call_ids():
    written = (
        f"<think>They want the weather.</think>Let me look.{SECTION}"
        f'{BEGIN}functions.get_weather:0{ARGS}{{"city": "Paris", "days": 3}}{END}'
        f"{BEGIN}functions.list_files:1{ARGS}{{}}{END}{SECTION_END}"
    )
    assert written == TURN
    events, ids, parser = parse([TURN])
    assert events == EXPECTED
    # the ids the template writes before each result, so a client sending them back matches
    assert ids == ["functions.get_weather:0", "functions.list_files:1"]
    assert parser.saw_tool_call


def test_one_character_at_a_time_is_the_whole_text():
    assert parse(list(TURN))[:2] == parse([TURN])[:2]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_events_do_not_depend_on_the_chunking(data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(TURN) - 1), max_size=15)))
    chunks = [TURN[a:b] for a, b in itertools.pairwise([0, *cuts, len(TURN)])]
    assert parse(chunks)[:2] == parse([TURN])[:2]


def test_the_instruct_templates_turn_has_no_reasoning():
    message = {"role": "assistant", "content": "", "tool_calls": WEATHER_CALLS}
    assert parse([assistant_turn("Kimi-K2-Instruct.jinja", message)])[0] == EXPECTED[2:]


def test_arguments_stream_as_they_are_written():
    text = f'{SECTION}{BEGIN}functions.write:0{ARGS}{{"text": "{"x" * 300}"}}{END}{SECTION_END}'
    parser = make_parser("kimi_k2")
    pieces_before_the_end = 0
    for i, c in enumerate(text):
        events = parser.feed(c)
        if i < len(text) - 100:
            pieces_before_the_end += sum(isinstance(e, ToolCallArgsDelta) for e in events)
    assert pieces_before_the_end > 100


def test_reasoning_the_prompt_opened_and_reasoning_left_open_before_the_calls():
    events, _, _ = parse(["still thinking\n</think>\n\nThe answer."], starts_in_reasoning=True)
    assert events == [("think", "still thinking"), ("text", "The answer.")]
    # no </think>: the call section ends the reasoning (its markers are never reasoning)
    text = f'<think>I will look it up.{SECTION}{BEGIN}functions.f:0{ARGS}{{"a": 1}}{END}'
    events, _, _ = parse([text])
    assert events == [("think", "I will look it up."), *call(0, "f", '{"a": 1}')]
    events, _, _ = parse(
        [f'Hmm{BEGIN}functions.f:0{ARGS}{{"a": 1}}{END}'], starts_in_reasoning=True
    )
    assert events == [("think", "Hmm"), *call(0, "f", '{"a": 1}')]


@pytest.mark.parametrize(
    "body",
    [
        f"{BEGIN}functions.ping:0{ARGS}{END}",  # the end at once
        f"{BEGIN}functions.ping:0{ARGS} \n{END}",
        f"{BEGIN}functions.ping:0{END}",  # no argument marker
        f"{BEGIN}ping:0{ARGS}{{}}{END}",  # no functions. prefix
        f"{BEGIN}functions.ping{ARGS}{{}}{END}",  # no index
    ],
)
def test_a_call_without_arguments_has_an_empty_object(body):
    events, _, _ = parse([f"{SECTION}{body}{SECTION_END}"])
    assert events == call(0, "ping", "{}")


def test_singular_section_markers_and_calls_outside_a_section():
    text = (
        f"<|tool_call_section_begin|>{BEGIN}functions.a:0{ARGS}{{}}{END}"
        f"<|tool_call_section_end|>{BEGIN}functions.b:1{ARGS}[1]{END}"
    )
    events, _, _ = parse([text])
    assert events == [*call(0, "a", "{}"), *call(1, "b", "[1]")]


def test_half_written_markup_is_text_at_the_end():
    assert parse(["Done. <|tool_call_beg"])[0] == [("text", "Done. <|tool_call_beg")]
    cut = f"Done.{SECTION}{BEGIN}functions.get_wea"
    assert parse([cut])[0] == [("text", f"Done.{BEGIN}functions.get_wea")]
    # arguments cut short are closed into valid JSON, as the Qwen parser closes them
    events, _, _ = parse([f'{BEGIN}functions.f:0{ARGS}{{"city": "Par'])
    assert events == call(0, "f", '{"city": "Par"}')


def test_a_header_that_is_not_an_id_comes_back_as_text():
    text = f"See {BEGIN}I will call it{ARGS}{{}}{END} later"
    events, _, parser = parse([text])
    assert events == [("text", f"See{BEGIN}I will call it{ARGS}{{}}{END} later")]
    assert not parser.saw_tool_call
    events, _, _ = parse([f"{BEGIN}functions.f:0{ARGS}city=Paris{END}"])
    assert events == [("text", f"{BEGIN}functions.f:0{ARGS}city=Paris{END}")]
    # two headers run together (found by test_parsers' any-chunking property): not an id
    twice = f"{BEGIN}functions.f:0functions.f:0{ARGS}{{}}{END}"
    events, _, parser = parse([twice])
    assert events == [("text", twice)] and not parser.saw_tool_call


def test_an_id_used_twice_in_a_reply_gets_a_fresh_one():
    once = f"{BEGIN}functions.f:0{ARGS}{{}}{END}"
    _, ids, _ = parse([once * 2])
    assert ids == ["functions.f:0", "fresh"]


def test_the_templates_pick_it_and_a_forced_call_leaves_the_index_to_the_model():
    for name in (
        "Kimi-K2-Instruct.jinja",
        "Kimi-K2-Thinking.jinja",
        "moonshotai-Kimi-K2.jinja",
        "Kimi-Linear-48B-A3B-Instruct.jinja",
    ):
        assert parser_for_template((TEMPLATES / name).read_text()) == "kimi_k2"
    assert keeps_special_tokens("kimi_k2")  # the markup is special tokens in Kimi's tokenizer
    opening = forced_tool_call("kimi_k2", "get_weather", False)
    assert opening == f"{SECTION}{BEGIN}functions.get_weather:"
    assert forced_tool_call("kimi_k2", None, True) == f"</think>{SECTION}{BEGIN}functions."
    events, ids, _ = parse([opening, f'2{ARGS}{{"city": "Lima"}}{END}{SECTION_END}'])
    assert events == call(0, "get_weather", '{"city": "Lima"}')
    assert ids == ["functions.get_weather:2"]
    assert json.loads(events[1][2]) == {"city": "Lima"}


FRAGMENTS = [
    "<think>",
    "</think>",
    SECTION,
    SECTION_END,
    BEGIN,
    ARGS,
    END,
    "functions.f:0",
    "g:1",
    "<|tool_call",
    "<|tool_calls_sec",
    " ",
    "\n",
    "x y",
    "{",
    "}",
    '"a": ',
    "1",
    '"',
    "[",
    "]",
    ",",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=25), st.data(), st.booleans())
def test_any_markup_any_chunking(fragments, data, starts_in_reasoning):
    """Markup soup: no chunking changes the events, and every call's arguments are JSON."""
    text = "".join(fragments)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    whole = parse([text], starts_in_reasoning=starts_in_reasoning)[:2]
    assert parse(chunks, starts_in_reasoning=starts_in_reasoning)[:2] == whole
    for item in whole[0]:
        if item[0] == "args":
            json.loads(item[2])
