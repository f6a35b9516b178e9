"""The GLM-4.5 output format (GLM-4.5, 4.5-Air, 4.6, 4.7), parsed as it streams.

What the model writes::

    <think>reasoning ...</think>
    answer text ...
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Reasoning and answer text follow the Qwen parser's rules (the same `<think>` tags, the same
whitespace handling: parsers/qwen.py). A call is held until `</tool_call>` (or the next
`<tool_call>`, or the end of output) and then parsed whole (parsers/typed_calls.py): the name
is the text before the first `<arg_key>` (GLM-4.7 writes no newline there; a name has no
spaces), then key / value pairs. A value is the text between its tags, typed by the request's
tool schema (typed_calls.py says how). A body that does not parse (no name, a key without its
value, text outside the pairs) is given back as answer text, tags included.
"""

from __future__ import annotations

import re

from freetoken.server.parsers.json_stream import WHITESPACE
from freetoken.server.parsers.qwen import CALL_OPEN, THINK_CLOSE
from freetoken.server.parsers.typed_calls import HeldCallParser, typed_arguments

KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = (
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
_PAIR = re.compile(
    re.escape(KEY_OPEN)
    + r"(.*?)"
    + re.escape(KEY_CLOSE)
    + r"\s*"
    + re.escape(VALUE_OPEN)
    + r"(.*?)"
    + re.escape(VALUE_CLOSE)
    + r"\s*",
    re.DOTALL,
)


_NAME = re.compile(r"[\w.:/-]+")  # a function name: no spaces, no markup


def parse_glm_call(body: str, strings: dict[str, set[str]]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call body, or None if it is not one."""
    start = body.find(KEY_OPEN)
    name = (body if start == -1 else body[:start]).strip(WHITESPACE)
    if not _NAME.fullmatch(name):
        return None
    pairs = []
    rest = "" if start == -1 else body[start:]
    pos = 0
    while pos < len(rest):
        m = _PAIR.match(rest, pos)
        if m is None:
            return None  # text outside the pairs, or a key without its value
        pairs.append((m[1].strip(WHITESPACE), m[2]))
        pos = m.end()
    return name, typed_arguments(name, pairs, strings)


class GlmParser(HeldCallParser):
    """Streaming parser for GLM-4.5 output (see the module docstring for the rules)."""

    @staticmethod
    def forced_call(tool: str | None, in_reasoning: bool) -> str:
        """A call's opening as GLM writes it; with a name, up to its first argument."""
        head = THINK_CLOSE if in_reasoning else ""
        return f"{head}{CALL_OPEN}" + ("" if tool is None else f"{tool}\n")

    def parse_call(self, body: str) -> list[tuple[str, str]] | None:
        call = parse_glm_call(body, self._strings)
        return None if call is None else [call]
