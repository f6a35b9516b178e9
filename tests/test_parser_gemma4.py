"""The Gemma-4 output parser (server/parsers/gemma4.py): reasoning, answer text and calls in the
template's own argument notation, the same events however the text is chunked, read off what
the release's template (tests/data/templates/, recorded unchanged) writes."""

from __future__ import annotations

import hashlib
import re
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

TEMPLATES = Path(__file__).parent / "data" / "templates"
NAME = "google-gemma-4-31B-it.jinja"
TEMPLATE = (TEMPLATES / NAME).read_text()
Q = '<|"|>'
# a call whose arguments hold every kind of value the template's notation writes
ARGS = {
    "city": 'Paris, "FR"\n{x:1}',
    "days": 3,
    "ratio": -2.5,
    "exact": False,
    "note": None,
    "opts": {"deep": True, "tags": ["a", 2, []], "inner": {}},
}
CALLS = [
    {"type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
    {"type": "function", "function": {"name": "list_files", "arguments": {}}},
]
TURN = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "They want the weather.",
    "tool_calls": CALLS,
}


def written(message: dict) -> str:
    """What the template writes for `message`, an assistant turn after a user's: the model's
    output for it, up to where the tools' turn begins."""
    chat = [{"role": "user", "content": "Weather in Paris?"}, message]
    text = chat_template.render(TEMPLATE, chat, add_generation_prompt=False)
    return text.split("<|turn>model\n")[-1]


def test_the_fixture_is_the_recorded_template_unchanged():
    readme = (TEMPLATES / "README.md").read_text()
    digest = re.search(rf"([0-9a-f]{{64}})  {re.escape(NAME)}", readme)[1]
    assert hashlib.sha256((TEMPLATES / NAME).read_bytes()).hexdigest() == digest


def test_the_template_picks_the_parser_and_renders_as_transformers_does():
    from transformers.utils.chat_template_utils import render_jinja_template

    assert parser_for_template(TEMPLATE) == "gemma4" and keeps_special_tokens("gemma4")
    chat = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        TURN,
        {"role": "tool", "content": "sunny"},
    ]
    [theirs], _ = render_jinja_template(
        conversations=[chat], chat_template=TEMPLATE, add_generation_prompt=True
    )
    assert chat_template.render(TEMPLATE, chat) == theirs


def test_a_templated_turn_parses_back_to_its_reasoning_and_typed_calls():
    text = written(TURN)
    assert text.startswith("<|channel>thought\n") and "call:get_weather{" in text
    events, parser = parsed("gemma4", [text])
    assert events[0] == ("think", "They want the weather.")
    assert calls(events) == [("get_weather", ARGS), ("list_files", {})]
    assert not [e for e in events if e[0] == "text"] and parser.saw_tool_call


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=60))
def test_the_events_do_not_depend_on_the_chunking(sizes):
    text = "<|channel>thought\nHm.\n<channel|>Sure: " + written(TURN).split("<channel|>")[1]
    chunks, at = [], 0
    for size in sizes:
        chunks.append(text[at : at + size])
        at += size
    chunks.append(text[at:])
    events = parsed("gemma4", chunks)[0]
    assert events == parsed("gemma4", [text])[0]
    assert events[:2] == [("think", "Hm."), ("text", "Sure:")] and len(calls(events)) == 2


@pytest.mark.parametrize(
    "body",
    [
        "call:get_weather{city:Paris}",  # a string without its marks
        f"call:get_weather{{city:{Q}Paris}}",  # a string left open
        "call:get_weather{days:3} and more",  # text after the arguments
        "get_weather{days:3}",  # no `call:`
    ],
)
def test_what_is_not_a_call_comes_back_as_text(body):
    events, parser = parsed("gemma4", [f"Ok.<|tool_call>{body}<tool_call|>"])
    assert events == [("text", f"Ok.<|tool_call>{body}<tool_call|>")]
    assert not parser.saw_tool_call


def test_a_forced_call_opens_as_the_model_writes_it():
    opening = forced_tool_call("gemma4", "get_weather", True)
    assert opening == "<channel|><|tool_call>call:get_weather{"
    events, _ = parsed(
        "gemma4", [opening.removeprefix("<channel|>") + f"city:{Q}Rome{Q}}}", "<tool_call|>"]
    )
    assert calls(events) == [("get_weather", {"city": "Rome"})]
    assert forced_tool_call("gemma4", None, False) == "<|tool_call>call:"
