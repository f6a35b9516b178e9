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
`<tool_call>`, or the end of output) and then parsed whole: the name is the text before the
first `<arg_key>` (GLM-4.7 writes no newline there), then key / value pairs. A value is the
text between its tags, as a string, when the request's tool schema says the parameter is a
string; otherwise its JSON value where it reads as JSON (GLM's template writes non-string
arguments as JSON), else the string. A body that does not parse (no name, a key without its
value, text outside the pairs) is given back as answer text, tags included.
"""

from __future__ import annotations

import json
import re
from typing import Any

from freetoken.server.parsers.json_stream import WHITESPACE, partial_tag_len
from freetoken.server.parsers.qwen import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, QwenParser

KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = (
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
_PAIR = re.compile(
    re.escape(KEY_OPEN) + r"(.*?)" + re.escape(KEY_CLOSE) + r"\s*"
    + re.escape(VALUE_OPEN) + r"(.*?)" + re.escape(VALUE_CLOSE) + r"\s*",
    re.DOTALL,
)  # fmt: skip


def string_parameters(tools: list[dict[str, Any]] | None) -> dict[str, set[str]]:
    """tool name -> the names of its parameters whose schema type is a string."""
    out: dict[str, set[str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (
            ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        )
        out[str(fn.get("name"))] = {
            k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"
        }
    return out


def parse_glm_call(body: str, strings: dict[str, set[str]]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call body, or None if it is not one."""
    start = body.find(KEY_OPEN)
    name = (body if start == -1 else body[:start]).strip(WHITESPACE)
    if not name or any(c in name for c in "<>\n"):
        return None
    args: dict[str, Any] = {}
    rest = "" if start == -1 else body[start:]
    pos = 0
    while pos < len(rest):
        m = _PAIR.match(rest, pos)
        if m is None:
            return None  # text outside the pairs, or a key without its value
        key, value = m[1].strip(WHITESPACE), m[2]
        if key in strings.get(name, ()):
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
        pos = m.end()
    return name, json.dumps(args, ensure_ascii=False)


class GlmParser(QwenParser):
    """Streaming parser for GLM-4.5 output (see the module docstring for the rules)."""

    takes_tools = True  # make_parser hands it the request's tools (their schemas' types)

    def __init__(self, *, starts_in_reasoning: bool = False, tools=None) -> None:
        super().__init__(starts_in_reasoning=starts_in_reasoning)
        self._strings = string_parameters(tools)

    @staticmethod
    def forced_call(tool: str | None, in_reasoning: bool) -> str:
        """A call's opening as GLM writes it; with a name, up to its first argument."""
        head = THINK_CLOSE if in_reasoning else ""
        return f"{head}{CALL_OPEN}" + ("" if tool is None else f"{tool}\n")

    def _in_header(self, final: bool) -> bool:
        """The call body, collected until it ends and then parsed whole."""
        self._body += self._buf
        self._buf = ""
        body = self._body
        ends = [(i, tag) for tag in (CALL_CLOSE, CALL_OPEN) if (i := body.find(tag)) != -1]
        if not ends and not final:
            return False
        if ends:
            end, tag = min(ends)
            text, closer = body[:end], tag if tag == CALL_CLOSE else ""
            rest = body[end + len(closer) :]  # (a next <tool_call> stays, to open its call)
        else:  # the end of output: a closing tag cut short there is not part of the body
            text, rest, closer = body[: len(body) - partial_tag_len(body, (CALL_CLOSE,))], "", ""
        call = parse_glm_call(text, self._strings)
        if call is not None:
            self._start_call(call[0])
            self._args(call[1])
            self._end_call()
        else:
            self._text(CALL_OPEN + text + closer)
        return self._to_text(rest, after_call=call is not None)
