"""Tool calls written as markup around raw-text values (GLM-4.5's `<arg_value>`, MiniMax-M2's
`<parameter>`), held whole and typed by the request's tool schemas.

Such a call cannot stream its arguments as the model writes them: a value's type is only known
once it is whole. `HeldCallParser` holds each call (from `call_open`) until `call_close` (or the
next `call_open`, or the end of output) and hands its text to the format's `parse_call`; what
does not parse is given back as answer text, tags included. Reasoning and answer text follow
the Qwen parser's rules (parsers/qwen.py).

A value is kept as the text the model wrote when the request's schema for the parameter lets
it be a string (the templates write strings raw); otherwise it is its JSON value where it reads
as strict JSON (the templates write other values as JSON), else the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from freetoken.server.parsers.json_stream import json_or_text, partial_tag_len
from freetoken.server.parsers.qwen import QwenParser


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


def typed_arguments(
    tool: str, pairs: Iterable[tuple[str, str]], strings: dict[str, set[str]]
) -> str:
    """The arguments JSON of a call of `tool` from its (name, raw value) pairs; `strings`:
    what `string_parameters` gives for the request's tools."""
    args = {
        key: value if key in strings.get(tool, ()) else json_or_text(value) for key, value in pairs
    }
    return json.dumps(args, ensure_ascii=False)


class HeldCallParser(QwenParser):
    """The Qwen parser, with each call held whole and parsed by `parse_call` (see above)."""

    takes_tools = True  # make_parser hands it the request's tools (their schemas' types)

    def __init__(self, *, starts_in_reasoning: bool = False, tools=None) -> None:
        super().__init__(starts_in_reasoning=starts_in_reasoning)
        self._strings = string_parameters(tools)

    def parse_call(self, body: str) -> list[tuple[str, str]] | None:
        """(name, arguments JSON) of each call in a whole call body (between the tags), or
        None where it is not calls."""
        raise NotImplementedError

    def _in_header(self, final: bool) -> bool:
        """The call body, collected until it ends and then parsed whole."""
        self._body += self._buf
        self._buf = ""
        body, close = self._body, self.call_close
        ends = [(i, tag) for tag in (close, self.call_open) if (i := body.find(tag)) != -1]
        if not ends and not final:
            return False
        if ends:
            end, tag = min(ends)
            text, closer = body[:end], tag if tag == close else ""
            rest = body[end + len(closer) :]  # (a next call's opening stays, to open its call)
        else:  # the end of output: a closing tag cut short there is not part of the body
            text, rest, closer = body[: len(body) - partial_tag_len(body, (close,))], "", ""
        return self._whole_call(self.parse_call(text), text, closer, rest)
