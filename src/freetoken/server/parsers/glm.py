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
first `<arg_key>` (GLM-4.7 writes no newline there; a name has no spaces), then key / value
pairs. A value is the text between its tags, as a string, when the request's tool schema lets
the parameter be a string; otherwise its JSON value where it reads as strict JSON (GLM's
template writes non-string arguments as JSON), else the string. A body that does not parse (no
name, a key without its value, text outside the pairs) is given back as answer text, tags
included.
"""

from __future__ import annotations

import json
import re
from typing import Any

from freetoken.server.parsers.json_stream import WHITESPACE, json_or_text, partial_tag_len
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


_NAME = re.compile(r"[\w.:/-]+")  # a function name: no spaces, no markup


def _allows_string(schema: Any) -> bool:
    """Whether a JSON schema lets a value be a string (a type list, anyOf / oneOf, an enum of
    strings)."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    if any(_allows_string(s) for key in ("anyOf", "oneOf") for s in schema.get(key) or ()):
        return True
    return kind is None and any(isinstance(v, str) for v in schema.get("enum") or ())


def string_parameters(tools: list[dict[str, Any]] | None) -> dict[str, set[str]]:
    """tool name -> the names of its parameters whose schema lets them be strings."""
    out: dict[str, set[str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        fn = fn if isinstance(fn, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[str(fn.get("name"))] = {k for k, v in props.items() if _allows_string(v)}
    return out


def parse_glm_call(body: str, strings: dict[str, set[str]]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call body, or None if it is not one."""
    start = body.find(KEY_OPEN)
    name = (body if start == -1 else body[:start]).strip(WHITESPACE)
    if not _NAME.fullmatch(name):
        return None
    args: dict[str, Any] = {}
    rest = "" if start == -1 else body[start:]
    pos = 0
    while pos < len(rest):
        m = _PAIR.match(rest, pos)
        if m is None:
            return None  # text outside the pairs, or a key without its value
        key, value = m[1].strip(WHITESPACE), m[2]
        args[key] = value if key in strings.get(name, ()) else json_or_text(value)
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
        return self._whole_call(parse_glm_call(text, self._strings), text, closer, rest)
