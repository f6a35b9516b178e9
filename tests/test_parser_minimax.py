"""The MiniMax-M2 output parser (server/parsers/minimax.py): reasoning, answer text and the
`<invoke>` calls of a `<minimax:tool_call>` block, typed by the request's tool schemas, the same
events however the text is chunked, read off what the release's own template
(tests/data/templates/) writes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken import chat_template
from freetoken.server.parsers import (
    forced_tool_call,
    keeps_special_tokens,
    parser_for_template,
)
from test_parsers import calls, parsed

TEMPLATE = (Path(__file__).parent / "data" / "templates" / "MiniMax-M2.jinja").read_text()
OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"


def tool(name: str, **types: str) -> dict:
    properties = {key: {"type": t} for key, t in types.items()}
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool("get_weather", city="string", days="integer", zip="string", tags="array"),
    tool("list_files"),
    tool("write", path="string", text="string"),
]


def parse(chunks, tools=TOOLS, **options):
    """(collapsed events, the parser)."""
    return parsed("minimax_m2", chunks, tools, **options)


def assistant_turn(message: dict) -> str:
    """What the template writes for `message`, an assistant turn after a user's."""
    chat = [{"role": "user", "content": "Weather in Paris?"}, message]
    text = chat_template.render(TEMPLATE, chat, TOOLS, add_generation_prompt=False)
    return text.split("]~b]ai\n")[-1].removesuffix("[e~[\n")


ARGS = {"city": "Paris", "days": 3, "zip": "75001", "tags": ["warm", "dry"]}
TURN = assistant_turn(
    {
        "role": "assistant",
        "reasoning_content": "They want the weather.",
        "content": "Let me look.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
            {"type": "function", "function": {"name": "list_files", "arguments": {}}},
        ],
    }
)


def test_the_templates_turn_parses_back_with_its_arguments_typed():
    written = (
        "<think>\nThey want the weather.\n</think>\n\nLet me look.\n"
        f'{OPEN}\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">3</parameter>\n<parameter name="zip">75001</parameter>\n'
        '<parameter name="tags">["warm", "dry"]</parameter>\n</invoke>\n'
        f'<invoke name="list_files">\n</invoke>\n{CLOSE}'
    )
    assert written == TURN
    events, parser = parse([TURN])
    assert events[:2] == [("think", "They want the weather."), ("text", "Let me look.")]
    # days is an integer and tags an array by the schema; zip, a string, stays one
    assert calls(events) == [("get_weather", ARGS), ("list_files", {})]
    assert len(events) == 2 + 3 * 2 and parser.saw_tool_call


def test_one_character_at_a_time_is_the_whole_text():
    assert parse(list(TURN))[0] == parse([TURN])[0]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_events_do_not_depend_on_the_chunking(data):
    cuts = sorted(data.draw(st.sets(st.integers(1, len(TURN) - 1), max_size=15)))
    chunks = [TURN[a:b] for a, b in itertools.pairwise([0, *cuts, len(TURN)])]
    assert parse(chunks)[0] == parse([TURN])[0]


def test_the_generation_prompt_opens_the_reasoning():
    prompt = chat_template.render(TEMPLATE, [{"role": "user", "content": "Hi"}])
    assert prompt.endswith("]~b]ai\n<think>\n")
    events, _ = parse(["Just a greeting.\n</think>\n\nHello!"], starts_in_reasoning=True)
    assert events == [("think", "Just a greeting."), ("text", "Hello!")]


def test_values_are_kept_as_written_and_blocks_follow_each_other():
    code = '\n<invoke name="x">\n</invoke> and <parameter name="y">\n'
    text = (
        f'{OPEN}\n<invoke name="write">\n<parameter name="path">a.xml</parameter>\n'
        f'<parameter name="text">{code}</parameter>\n</invoke>\n{CLOSE}\n'
        f'{OPEN}\n<invoke name="unknown">\n<parameter name="n">2.5</parameter>\n'
        f'<parameter name="s">hello world</parameter>\n</invoke>\n{CLOSE}'
    )
    events, _ = parse([text])
    assert calls(events) == [
        ("write", {"path": "a.xml", "text": code}),
        ("unknown", {"n": 2.5, "s": "hello world"}),
    ]
    assert not [e for e in events if e[0] == "text"]  # (no whitespace between calls as text)


@pytest.mark.parametrize(
    "block",
    [
        f"{OPEN}\nI will call get_weather\n{CLOSE}",  # prose, not invokes
        f'{OPEN}\n<invoke name="f">\n<parameter name="a">1</parameter>\nstray\n</invoke>\n{CLOSE}',
        f'{OPEN}\n<invoke name="f">\n<parameter name="a">1\n</invoke>\n{CLOSE}',  # unclosed value
        f"{OPEN}\n{CLOSE}",  # no invoke at all
    ],
)
def test_a_block_that_is_not_calls_comes_back_as_text(block):
    events, parser = parse([f"Before {block} after"])
    # (as the Qwen parser does: the space before the block's tag is dropped, the rest kept)
    assert events == [("text", f"Before{block} after")]
    assert not parser.saw_tool_call


def test_half_written_markup_is_text_at_the_end():
    assert parse(["Done. <minimax:tool"])[0] == [("text", "Done. <minimax:tool")]
    block = f'{OPEN}\n<invoke name="get_weather">\n<parameter name="city">Pa'
    # (the newline before the block's tag dropped, as the Qwen parser drops it)
    assert parse([f"Done.\n{block}"])[0] == [("text", f"Done.{block}")]
    # a block whose invokes are whole and only its closing is missing is calls
    whole = f'{OPEN}\n<invoke name="get_weather">\n<parameter name="city">Rome</parameter>\n'
    assert calls(parse([whole + "</invoke>\n</minimax:tool"])[0]) == [
        ("get_weather", {"city": "Rome"})
    ]


def test_the_template_picks_it_and_a_forced_call_opens_as_minimax_writes_it():
    assert parser_for_template(TEMPLATE) == "minimax_m2"
    assert not keeps_special_tokens("minimax_m2")  # its tags are plain text to its tokenizer
    opening = forced_tool_call("minimax_m2", "get_weather", True)
    assert opening == f'</think>\n\n{OPEN}\n<invoke name="get_weather">\n'
    assert forced_tool_call("minimax_m2", None, False) == f"{OPEN}\n"
    rest = f'<parameter name="days">4</parameter>\n</invoke>\n{CLOSE}'
    events, _ = parse([opening, rest], starts_in_reasoning=True)
    assert events == [("start", 0, "get_weather"), ("args", 0, '{"days": 4}'), ("end", 0)]


FRAGMENTS = [
    "<think>",
    "</think>",
    OPEN,
    CLOSE,
    '<invoke name="f">',
    "</invoke>",
    '<parameter name="days">',
    '<parameter name="city">',
    "</parameter>",
    "<minimax",
    "</inv",
    " ",
    "\n",
    "x y",
    "3",
    '["a"]',
    '"',
    "{",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=25), st.data(), st.booleans())
def test_any_markup_any_chunking(fragments, data, starts_in_reasoning):
    """Markup soup: no chunking changes the events, and every call's arguments are JSON."""
    text = "".join(fragments)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    tools = [tool("f", days="integer", city="string")]
    whole = parse([text], tools, starts_in_reasoning=starts_in_reasoning)[0]
    assert parse(chunks, tools, starts_in_reasoning=starts_in_reasoning)[0] == whole
    for item in whole:
        if item[0] == "args":
            json.loads(item[2])
