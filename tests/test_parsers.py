"""Streaming output parsers: the events must not depend on how the model text is chunked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import freetoken
from freetoken.server.events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken.server.parsers import (
    PARSERS,
    OutputParser,
    make_parser,
    parser_for_template,
    prompt_opens_reasoning,
)

TEMPLATE = Path(freetoken.__file__).parent / "data" / "qwen3_chat_template.jinja"
ID = re.compile(r"call_[0-9a-f]{24}")


def parse(chunks: list[str], **options) -> list:
    parser = make_parser("qwen3", **options)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return events


def parsed(name: str, chunks, tools=None, **options) -> tuple[list[tuple], object]:
    """(the collapsed events, the parser) of parser `name` fed `chunks` then finished."""
    parser = make_parser(name, tools, **options)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return collapse(events + parser.finish()), parser


def calls(events: list[tuple]) -> list[tuple]:
    """(name, arguments as an object) of each call, from the collapsed events."""
    out = []
    for i, ev in enumerate(events):
        if ev[0] == "start":
            assert events[i + 1][0] == "args" and events[i + 2] == ("end", ev[1])
            out.append((ev[2], json.loads(events[i + 1][2])))
    return out


def collapse(events: list, ids: re.Pattern = ID) -> list[tuple]:
    """Consecutive deltas of one kind merged; ids checked (against `ids`) and replaced by the
    call index."""
    out: list[tuple] = []
    for ev in events:
        if isinstance(ev, TextDelta | ReasoningDelta):
            assert ev.text, "empty delta"
            item = ("text" if isinstance(ev, TextDelta) else "think", ev.text)
        elif isinstance(ev, ToolCallStart):
            assert ids.fullmatch(ev.id), ev.id
            item = ("start", ev.index, ev.name)
        elif isinstance(ev, ToolCallArgsDelta):
            assert ev.text, "empty delta"
            item = ("args", ev.index, ev.text)
        else:
            assert isinstance(ev, ToolCallEnd)
            item = ("end", ev.index)
        if out and item[0] in ("text", "think") and out[-1][0] == item[0]:
            out[-1] = (item[0], out[-1][1] + item[1])
        elif out and item[0] == "args" and out[-1][:2] == item[:2]:
            out[-1] = ("args", item[1], out[-1][2] + item[2])
        else:
            out.append(item)
    return out


def call(index: int, name: str, args: str) -> list[tuple]:
    return [("start", index, name), ("args", index, args), ("end", index)]


NESTED = '{"path": "a}b.py", "edits": [{"old": "say \\"hi\\" {", "new": "x</tool_call>y"}]}'
CASES: list[tuple[str, str, dict, list[tuple]]] = [
    (
        "plain",
        "Hello, world!\nThe answer is 42.",
        {},
        [("text", "Hello, world!\nThe answer is 42.")],
    ),
    (
        "lookalike",
        "a <b> and <tool and </think> and <thinking> x",
        {},
        [("text", "a <b> and <tool and </think> and <thinking> x")],
    ),
    (
        "reasoning",
        "<think>\nLet me think.\n\nOK.\n</think>\n\nThe answer.",
        {},
        [("think", "Let me think.\n\nOK."), ("text", "The answer.")],
    ),
    (
        "one call",
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        {},
        [("text", "I will check."), *call(0, "get_weather", '{"city": "Paris"}')],
    ),
    (
        "two calls",
        '<tool_call>\n{"name": "a", "arguments": {"x": 1, "y": [true, null, -2.5e3]}}\n'
        '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
        {},
        call(0, "a", '{"x": 1, "y": [true, null, -2.5e3]}') + call(1, "b", "{}"),
    ),
    (
        "reasoning and call",
        '<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": '
        '{"q": "rain?"}}\n</tool_call>',
        {},
        [("think", "Need the weather."), *call(0, "w", '{"q": "rain?"}')],
    ),
    (
        "nested args",
        f'<tool_call>\n{{"name": "edit", "arguments": {NESTED}}}\n</tool_call>',
        {},
        call(0, "edit", NESTED),
    ),
    (
        "string args",
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": \\"\\\\\\"q\\\\\\" \\u00e9 '
        '\\ud83d\\ude00\\"}"}\n</tool_call>',
        {},
        call(0, "f", '{"a": "\\"q\\" é 😀"}'),
    ),
    (
        "raw newline in a string",
        '<tool_call>\n{"name": "write", "arguments": {"text": "a\nb\tc"}}\n</tool_call>',
        {},
        call(0, "write", '{"text": "a\\nb\\tc"}'),
    ),
    (
        "other key order",
        '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>',
        {},
        call(0, "f", '{"a": 1}'),
    ),
    (
        "not json",
        "Try: <tool_call>\nget_weather(Paris)\n</tool_call> done",
        {},
        [("text", "Try:<tool_call>\nget_weather(Paris)\n</tool_call> done")],
    ),
    (
        "bad args after start",
        '<tool_call>\n{"name": "f", "arguments": {"a": "x", "b": tru}}\n</tool_call>\nok',
        {},
        [*call(0, "f", '{"a": "x", "b": null}'), ("text", "tru}}\n</tool_call>\nok")],
    ),
    (
        "truncated call",
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, "two',
        {},
        call(0, "f", '{"a": [1, "two"]}'),
    ),
    (
        "truncated header",
        '<tool_call>\n{"name": "f", "argu',
        {},
        [("text", '<tool_call>\n{"name": "f", "argu')],
    ),
    (
        "no closing tag",
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}',
        {},
        call(0, "f", '{"a": 1}'),
    ),
    (
        "unterminated think",
        "<think>\nstill thinking about </thin",
        {},
        [("think", "still thinking about </thin")],
    ),
    (
        "starts in reasoning",
        "I should call it.\n</think>\n\n<tool_call>\n"
        '{"name": "f", "arguments": {"n": 0}}\n</tool_call>',
        {"starts_in_reasoning": True},
        [("think", "I should call it."), *call(0, "f", '{"n": 0}')],
    ),
    (
        "no tool calls",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        {"tool_calls": False},
        [("text", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')],
    ),
]

# Untagged calls (parsers/untagged.py): Qwen2.5-Coder's own replies to a get_weather question.
OFFERED = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
PARIS = call(0, "get_weather", '{"city": "Paris"}')
GREET = FENCED.replace("get_weather", "greet")
CASES += [
    ("untagged bare (0.5B)", BARE, OFFERED, PARIS),
    ("untagged fenced (1.5B)", "\n" + FENCED + "\n", OFFERED, PARIS),
    ("untagged plain fence", "```\n" + BARE + "\n```", OFFERED, PARIS),
    ("untagged parameters", BARE.replace("arguments", "parameters"), OFFERED, PARIS),
    (
        "untagged list",
        f"[{BARE}, {BARE.replace('Paris', 'Rome')}]",
        OFFERED,
        [*PARIS, *call(1, "get_weather", '{"city": "Rome"}')],
    ),
    ("untagged, no tools offered", BARE, {}, [("text", BARE)]),
    ("untagged, a name not offered", GREET, OFFERED, [("text", GREET)]),
    ("untagged, then text", BARE + "\nDone.", OFFERED, [("text", BARE + "\nDone.")]),
    ("untagged, after text", "Sure: " + BARE, OFFERED, [("text", "Sure: " + BARE)]),
    ("untagged, cut short", BARE[:30], OFFERED, [("text", BARE[:30])]),
    ("another fence", "```python\nprint(1)\n```", OFFERED, [("text", "```python\nprint(1)\n```")]),
    ("json, not a call", '{"city": "Paris"}', OFFERED, [("text", '{"city": "Paris"}')]),
    ("tagged, tools offered", f"<tool_call>\n{BARE}\n</tool_call>", OFFERED, PARIS),
]
IDS = [case[0] for case in CASES]


@pytest.mark.parametrize(("name", "text", "options", "expected"), CASES, ids=IDS)
def test_whole_text(name, text, options, expected):
    events = parse([text], **options)
    assert collapse(events) == expected
    for item in collapse(events):
        if item[0] == "args":
            json.loads(item[2])  # the pieces concatenate to valid JSON


@pytest.mark.parametrize(("name", "text", "options", "expected"), CASES, ids=IDS)
def test_every_two_chunk_split(name, text, options, expected):
    for cut in range(len(text) + 1):
        assert collapse(parse([text[:cut], text[cut:]], **options)) == expected, cut


@pytest.mark.parametrize(("name", "text", "options", "expected"), CASES, ids=IDS)
def test_char_by_char(name, text, options, expected):
    assert collapse(parse(list(text), **options)) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_chunkings(data):
    _, text, options, expected = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=len(text))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert collapse(parse(chunks, **options)) == expected


def test_partial_markup_is_held_back():
    parser = make_parser("qwen3")
    for prefix in ["<", "<t", "<to", "<tool_cal", "<th", "<think"]:
        parser = make_parser("qwen3")
        events = parser.feed("Hi " + prefix)
        assert events == [TextDelta("Hi")]
        assert parser.finish() == [TextDelta(" " + prefix)]
    parser = make_parser("qwen3", starts_in_reasoning=True)
    assert parser.feed("hmm\n</th") == [ReasoningDelta("hmm")]
    assert parser.feed("ink>\n\nyes") == [TextDelta("yes")]
    assert parser.finish() == []


def test_args_stream_incrementally():
    content = "line of the file\\n" * 200
    text = (
        f'<tool_call>\n{{"name": "write", "arguments": {{"content": "{content}"}}}}\n</tool_call>'
    )
    parser = make_parser("qwen3")
    arrived = []  # (characters fed so far, args text so far)
    args = ""
    for i, c in enumerate(text):
        for ev in parser.feed(c):
            if isinstance(ev, ToolCallArgsDelta):
                args += ev.text
                arrived.append((i + 1, args))
    parser.finish()
    assert args == f'{{"content": "{content}"}}'
    assert parser.saw_tool_call
    # arguments are sent while they stream: most of them before the closing brace is fed
    args_end = text.index("}}\n</tool_call>")
    assert len(arrived) > 100
    assert len([a for n, a in arrived if n <= args_end]) > 100
    half = [a for n, a in arrived if n <= len(text) // 2][-1]
    assert len(half) > len(content) // 3
    # the same holds for arguments written as a JSON string
    text = (
        '<tool_call>\n{"name": "w", "arguments": "{\\"c\\": \\"'
        + "x" * 500
        + '\\"}"}\n</tool_call>'
    )
    parser = make_parser("qwen3")
    before_end = 0
    for i, c in enumerate(text):
        before_end += sum(isinstance(ev, ToolCallArgsDelta) for ev in parser.feed(c)) * (i < 510)
    assert before_end > 100


def test_call_ids_unique():
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n' * 20
    ids = []
    for _ in range(20):
        ids += [ev.id for ev in parse([text]) if isinstance(ev, ToolCallStart)]
    assert len(ids) == 400
    assert len(set(ids)) == 400
    assert all(ID.fullmatch(i) for i in ids)


def test_saw_tool_call():
    parser = make_parser("qwen3")
    parser.feed("<think>\n<tool_call> is only reasoning here\n</think>\n\nNo call.")
    parser.finish()
    assert not parser.saw_tool_call
    parser = make_parser("qwen3")
    parser.feed('<tool_call>\n{"name": "f", "arguments": {}')
    assert parser.saw_tool_call


def test_template_round_trip():
    """What the Qwen3 template writes for an assistant turn parses back into the same turn."""
    env = jinja2.Environment()
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    template = env.from_string(TEMPLATE.read_text())
    calls = [
        {"function": {"name": "read", "arguments": {"path": "src/a.py", "lines": [1, 20]}}},
        {"function": {"name": "grep", "arguments": {"pattern": 'def \\w+\\("', "dir": "."}}},
    ]
    messages = [
        {"role": "user", "content": "Look at a.py"},
        {
            "role": "assistant",
            "reasoning_content": "I should read it.\nThen grep.",
            "content": "Reading the file.",
            "tool_calls": calls,
        },
    ]
    rendered = template.render(messages=messages, tools=None, add_generation_prompt=False)
    turn = rendered.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    expected = [("think", "I should read it.\nThen grep."), ("text", "Reading the file.")]
    for i, c in enumerate(calls):
        expected += call(i, c["function"]["name"], json.dumps(c["function"]["arguments"]))
    assert collapse(parse([turn])) == expected
    assert collapse(parse(list(turn))) == expected


def test_parser_for_template():
    assert parser_for_template(TEMPLATE.read_text()) == "qwen3"
    assert parser_for_template(None) is None
    assert parser_for_template("") is None
    assert parser_for_template("{{ messages[0].content }}") is None


def test_registry():
    assert {"qwen3", "hermes", "plain"} <= set(PARSERS)
    for name in PARSERS:
        assert isinstance(make_parser(name), OutputParser)
    with pytest.raises(ValueError, match="unknown output parser"):
        make_parser("nope")
    plain = make_parser("plain")
    assert plain.feed("<tool_call>x") == [TextDelta("<tool_call>x")]
    assert plain.finish() == []
    assert not plain.saw_tool_call


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "</th",
    "\n",
    " ",
    "x",
    '{"name": "f", "arguments": ',
    '{"name": "g", "parameters": "',
    '{"arguments": ',
    '"name"',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    "\\u00e9",
    "\\ud83d",
    "\\ude00",
    "\\n",
    ",",
    ":",
    "-1.5",
    "0",
    "e",
    "true",
    "nul",
    '"a": ',
    "\t",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.data(), st.booleans())
def test_any_text_any_chunking(fragments, data, starts_in_reasoning):
    """Arbitrary markup soup: no crash, chunking never matters, calls are well formed."""
    text = "".join(fragments)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = collapse(parse([text], starts_in_reasoning=starts_in_reasoning))
    assert collapse(parse(chunks, starts_in_reasoning=starts_in_reasoning)) == whole
    open_call, next_index = None, 0
    for item in whole:
        if item[0] == "start":
            assert open_call is None and item[1] == next_index
            open_call, args = item[1], ""
        elif item[0] == "args":
            assert item[1] == open_call
            args += item[2]
        elif item[0] == "end":
            assert item[1] == open_call
            json.loads(args)
            args.encode()  # no lone surrogates
            open_call, next_index = None, next_index + 1
        else:
            assert open_call is None
    assert open_call is None


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.sampled_from('ab }{"\\\n</tool_call>é😀'), max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(st.sampled_from('k"\\}é'), max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.text("abc", max_size=3), JSON_VALUES, max_size=3),
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, 2]),
    st.data(),
)
def test_call_arguments_any_chunking(args, as_string, ascii_only, indent, data):
    """Well-formed calls (arguments as object or as string), then possibly damaged: no
    chunking changes the events, and the arguments always concatenate to valid JSON."""
    args_text = json.dumps(args, ensure_ascii=ascii_only, indent=indent)
    value = json.dumps(args_text) if as_string else args_text
    text = f'Go.\n<tool_call>\n{{"name": "f", "arguments": {value}}}\n</tool_call>\n'
    whole = collapse(parse([text]))
    assert whole == [("text", "Go."), *call(0, "f", args_text)]
    # damage it: drop or insert a character, or cut it short
    pos = data.draw(st.integers(0, len(text)))
    edit = data.draw(st.sampled_from(["drop", "insert", "cut"]))
    if edit == "cut":
        text = text[:pos]
    else:
        text = (
            text[:pos]
            + data.draw(st.sampled_from('"}]{,:\\x ')) * (edit == "insert")
            + (text[pos + 1 :] if edit == "drop" else text[pos:])
        )
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=20)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole = collapse(parse([text]))
    assert collapse(parse(chunks)) == whole
    for item in whole:
        if item[0] == "args":
            json.loads(item[2])
