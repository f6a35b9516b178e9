"""Gemma-4's output format, parsed as it streams.

What the model writes (its chat template, `google-gemma-4-31B-it.jinja`; the markup is special
tokens in Gemma's tokenizer, kept in the decoded text for this parser: `keeps_special_tokens`)::

    <|channel>thought
    reasoning ...<channel|>answer text ...<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,
    days:3}<tool_call|><|tool_call>call:list_files{}<tool_call|><|tool_response>

* `<|channel>thought` ... `<channel|>` is reasoning, under the Qwen parser's rules for
  `<think>` ... `</think>` (parsers/qwen.py): the newline after the opening and the newlines
  around the closing are dropped. Without thinking the generation prompt writes an empty
  channel, so the output starts in answer text either way.
* `<|tool_call>call:NAME{ARGS}<tool_call|>` is a call, held whole (parsers/typed_calls.py) and
  read here: ARGS is the template's own notation (`format_argument`): `key:value` pairs, a
  string between `<|"|>` marks (raw, any text), numbers, `true` / `false`, `null` (or Jinja's
  `None`), `{...}` objects whose keys may be bare or marked, `[...]` lists. The values are
  typed by that notation, not by the request's schemas. A call that does not read so is
  given back as answer text, tags included.
* `<|tool_response>`, which the model writes after its calls to hand the turn to the tools,
  only groups calls: it is dropped (it is normally among the end tokens).
"""

from __future__ import annotations

import json
import re
from typing import Any

from freetoken.server.parsers.typed_calls import HeldCallParser

THINK_OPEN, THINK_CLOSE = "<|channel>thought", "<channel|>"
CALL_OPEN, CALL_CLOSE, RESPONSE = "<|tool_call>", "<tool_call|>", "<|tool_response>"
QUOTE = '<|"|>'
_NAME = re.compile(r"\s*call:([^{}\s<>]+)\s*(?=\{)")
_KEY = re.compile(r"\s*([^:{}\[\],<>\s]+)\s*:")
_ATOM = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null|None)(?=\s*[,}\]])")
_ATOMS = {"true": True, "false": False, "null": None, "None": None}


class _NotArgs(Exception):
    """The text is not the template's argument notation."""


def _value(text: str, pos: int) -> tuple[Any, int]:
    """The value at `pos` and the position after it."""
    pos = len(text) - len(text[pos:].lstrip())
    if text.startswith(QUOTE, pos):
        end = text.find(QUOTE, pos + len(QUOTE))
        if end == -1:
            raise _NotArgs
        return text[pos + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", pos):
        return _object(text, pos)
    if text.startswith("[", pos):
        items, pos = [], pos + 1
        while not text[pos:].lstrip().startswith("]"):
            item, pos = _value(text, pos)
            items.append(item)
            pos = _after_item(text, pos, "]")
        return items, text.index("]", pos) + 1
    atom = _ATOM.match(text, pos)
    if atom is None:
        raise _NotArgs
    word = atom[1]
    return _ATOMS[word] if word in _ATOMS else json.loads(word), atom.end()


def _object(text: str, pos: int) -> tuple[dict[str, Any], int]:
    """The `{key:value,...}` at `pos` (keys bare or between quote marks)."""
    out, pos = {}, pos + 1
    while not text[pos:].lstrip().startswith("}"):
        rest = text[pos:].lstrip()
        if rest.startswith(QUOTE):
            start = len(text) - len(rest) + len(QUOTE)
            end = text.find(QUOTE, start)
            if end == -1 or not text[end + len(QUOTE) :].lstrip().startswith(":"):
                raise _NotArgs
            key, pos = text[start:end], text.index(":", end + len(QUOTE)) + 1
        elif key_match := _KEY.match(text, pos):
            key, pos = key_match[1], key_match.end()
        else:
            raise _NotArgs
        out[key], pos = _value(text, pos)
        pos = _after_item(text, pos, "}")
    return out, text.index("}", pos) + 1


def _after_item(text: str, pos: int, close: str) -> int:
    """Past the comma after an item, or at the closing bracket."""
    rest = text[pos:].lstrip()
    if rest.startswith(","):
        return len(text) - len(rest) + 1
    if not rest.startswith(close):
        raise _NotArgs
    return pos


def parse_call(body: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of one whole call body (`call:NAME{...}`), or None."""
    head = _NAME.match(body)
    if head is None:
        return None
    try:
        args, end = _object(body, head.end())
    except (_NotArgs, ValueError, IndexError):
        return None
    if body[end:].strip():
        return None
    return [(head[1], json.dumps(args, ensure_ascii=False))]


class Gemma4Parser(HeldCallParser):
    """Streaming parser for Gemma-4 output (see the module docstring for the rules)."""

    keeps_special_tokens = True  # the markup is special tokens: the detokeniser must keep them
    think_open, think_close = THINK_OPEN, THINK_CLOSE
    call_open, call_close = CALL_OPEN, CALL_CLOSE
    grouping_tags = (RESPONSE,)
    reasoning_ends = (CALL_OPEN,)

    @staticmethod
    def forced_call(tool: str | None, in_reasoning: bool) -> str:
        """A call's opening as Gemma-4 writes it; with a name, up to its arguments."""
        head = THINK_CLOSE if in_reasoning else ""
        return f"{head}{CALL_OPEN}call:" + ("" if tool is None else f"{tool}{{")

    def parse_call(self, body: str) -> list[tuple[str, str]] | None:
        return parse_call(body)
