"""gpt-oss's Harmony format (server/parsers/harmony.py): reasoning, answer text, preambles and
tool calls from scripted output, the same events however the text is chunked, arguments that
always concatenate to valid JSON, and the forced call's opening."""

from __future__ import annotations

import json

import pytest

from freetoken.server.events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken.server.parsers import keeps_special_tokens, make_parser, parser_for_template
from freetoken.server.parsers.harmony import HEADER_LIMIT, HarmonyParser


def summary(events):
    """Events merged into (kind, text) runs, call ids replaced by their index."""
    out = []
    for e in events:
        if isinstance(e, ToolCallStart):
            out.append(("call", e.index, e.name))
            continue
        if isinstance(e, ToolCallEnd):
            out.append(("end", e.index))
            continue
        kind = {TextDelta: "text", ReasoningDelta: "reasoning", ToolCallArgsDelta: "args"}[type(e)]
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + e.text)
        else:
            out.append((kind, e.text))
    return out


def parse(text: str, pieces: list[int] | None = None):
    """Events of `text` fed in pieces cut at `pieces` (offsets)."""
    parser = HarmonyParser()
    events, last = [], 0
    for cut in [*(pieces or []), len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return events + parser.finish(), parser


def every_chunking(text: str):
    """The one summary every way of cutting `text` gives (single cuts, pairs of cuts near the
    markup, and one character at a time)."""
    whole, _ = parse(text)
    want = summary(whole)
    cuts = [[i] for i in range(len(text) + 1)]
    cuts += [[i, j] for i in range(0, len(text), 7) for j in range(i, len(text), 5)]
    cuts.append(list(range(1, len(text))))
    for pieces in cuts:
        events, _ = parse(text, pieces)
        assert summary(events) == want, pieces
    return want


def test_reasoning_then_the_answer():
    text = (
        "<|channel|>analysis<|message|>The user greets.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
    )
    assert every_chunking(text) == [("reasoning", "The user greets."), ("text", "Hello!")]


def test_a_tool_call_after_reasoning():
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "days": [1, 2]}<|call|>'
    )
    got = every_chunking(text)
    assert got == [
        ("reasoning", "Need the weather."),
        ("call", 0, "get_weather"),
        ("args", '{"city": "Paris", "days": [1, 2]}'),
        ("end", 0),
    ]
    _, parser = parse(text)
    assert parser.saw_tool_call


def test_the_recipient_may_come_before_the_channel_and_calls_follow_each_other():
    text = (
        "<|start|>assistant to=functions.read<|channel|>commentary json<|message|>"
        '{"path": "a.py"}<|call|>'
        "<|start|>assistant to=functions.write<|channel|>commentary<|message|>{}<|call|>"
    )
    got = every_chunking(" " + text[len("<|start|>assistant") :])  # as the prompt opened it
    assert got == [
        ("call", 0, "read"),
        ("args", '{"path": "a.py"}'),
        ("end", 0),
        ("call", 1, "write"),
        ("args", "{}"),
        ("end", 1),
    ]


def test_a_preamble_is_answer_text():
    text = (
        "<|channel|>commentary<|message|>Let me check.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.ls <|constrain|>json<|message|>"
        "{}<|call|>"
    )
    assert every_chunking(text)[:2] == [("text", "Let me check."), ("call", 0, "ls")]


@pytest.mark.parametrize(
    "body, want",
    [
        ('{"city": "Par', '{"city": "Par"}'),  # cut short: closed
        ('{"a": [1, {"b": tr', '{"a": [1, {"b": null}]}'),  # a literal cut: null
        ("not json at all", "{}"),  # not an object: replaced
        ("", "{}"),  # nothing
        ('{"a": 1} trailing', '{"a": 1}'),  # what follows the value is not arguments
    ],
)
def test_arguments_always_concatenate_to_valid_json(body, want):
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>" + body
    got = every_chunking(text)
    args = "".join(t for kind, *rest in got if kind == "args" for t in rest)
    assert json.loads(args) == json.loads(want)
    assert got[-1] == ("end", 0)


def test_text_without_the_markup_is_answer_text():
    assert every_chunking("Just plain words, no header.") == [
        ("text", "Just plain words, no header.")
    ]
    # a long stream that never writes <|message|> is released before the end
    parser = HarmonyParser()
    events = parser.feed("x" * (HEADER_LIMIT + 1))
    assert summary(events) == [("text", "x" * (HEADER_LIMIT + 1))]


def test_text_between_messages_is_kept():
    text = "<|channel|>final<|message|>A<|end|> stray<|start|>assistant<|channel|>final<|message|>B"
    assert every_chunking(text) == [("text", "A strayB")]


def test_the_forced_call_opening_continues_the_generation_prompt():
    parser = make_parser("harmony", starts_in_reasoning=False)
    opening = HarmonyParser.forced_call("get_weather", in_reasoning=False)
    events = parser.feed(opening) + parser.feed('{"city": "Rome"}') + parser.finish()
    assert summary(events) == [("call", 0, "get_weather"), ("args", '{"city": "Rome"}'), ("end", 0)]
    parser = make_parser("harmony")
    any_tool = HarmonyParser.forced_call(None, in_reasoning=False)
    events = parser.feed(any_tool + "ls <|constrain|>json<|message|>{}") + parser.finish()
    assert summary(events)[0] == ("call", 0, "ls")


def test_the_registry_knows_harmony_templates():
    assert parser_for_template("...<|start|>assistant<|channel|>final<|message|>...") == "harmony"
    assert keeps_special_tokens("harmony") and not keeps_special_tokens("qwen3")
