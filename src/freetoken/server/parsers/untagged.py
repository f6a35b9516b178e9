"""Tool calls written without their tags, as Qwen2.5-Coder writes them.

Qwen2.5-Coder-Instruct's own chat template asks for each call's JSON inside `<tool_call>`
tags; the model (0.5B and 1.5B, greedy, measured in
benchmarks/results/2026-12-04-real-model-agents.md) writes the JSON alone instead, bare or in a
Markdown fence::

    {"name": "get_weather", "arguments": {"city": "Paris"}}

    ```json
    {
      "name": "get_weather",
      "arguments": {"city": "Paris"}
    }
    ```

Rule: where the request offers tools, a reply that is nothing but calls -- one JSON object whose
first key is "name", naming an offered tool, with "arguments" (or "parameters"), or a JSON list
of them; bare, or alone in one fence (``` or ```json) -- is those calls. Any other reply is
parsed as the tagged format (parsers/qwen.py). Decided from the text alone, whatever its
chunking: while the reply could still become such a call it is held; once it names an offered
tool it is held to the end and parsed whole (the arguments then come as one piece); as soon as
it cannot (other text first, a name not offered), what was held goes to the tagged parser. A
name that is not offered keeps the JSON as text: a model showing JSON is not calling a tool.
"""

from __future__ import annotations

import json

from freetoken.server.events import Event, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from freetoken.server.parsers.json_stream import WHITESPACE, new_call_id
from freetoken.server.parsers.qwen import _FAIL, _NEED, QwenParser, _match_header, _parse_whole_call

FENCE = "```"
_MATCH = "match"


def offered_names(tools: list | None) -> frozenset[str]:
    """The names of the request's tools (as the chat template takes them)."""
    names = set()
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return frozenset(names)


def _verdict(text: str, names: frozenset[str]) -> str:
    """_MATCH (the reply so far opens a call of an offered tool), _NEED (it may still) or
    _FAIL (it cannot)."""
    body = text.lstrip(WHITESPACE)
    if body.startswith(FENCE) or FENCE.startswith(body):
        if len(body) <= len(FENCE):
            return _NEED
        language, newline, body = body[len(FENCE) :].partition("\n")
        language = language.strip(WHITESPACE)
        if not newline:
            return _NEED if "json".startswith(language) else _FAIL
        if language not in ("", "json"):
            return _FAIL
        body = body.lstrip(WHITESPACE)
    if body.startswith("["):
        body = body[1:].lstrip(WHITESPACE)
    header = _match_header(body)
    if isinstance(header, str):
        return header
    return _MATCH if header[0] in names else _FAIL


def untagged_calls(text: str, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """(name, arguments JSON text) of each call when the whole reply is untagged calls of
    offered tools, else None."""
    body = text.strip(WHITESPACE)
    if body.startswith(FENCE):
        if len(body) < 2 * len(FENCE) or not body.endswith(FENCE):
            return None
        body = body[len(FENCE) : -len(FENCE)].partition("\n")[2]
    try:
        value = json.loads(body)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, dict) or next(iter(item), None) != "name":
            return None
        call = _parse_whole_call(json.dumps(item, ensure_ascii=False))
        if call is None or call[0] not in names:
            return None
        calls.append(call)
    return calls or None


class UntaggedQwenParser(QwenParser):
    """The Qwen / Hermes parser, taking a reply of untagged calls as calls (see above)."""

    takes_tools = True  # make_parser hands it the request's tools (their names)

    def __init__(
        self, *, starts_in_reasoning: bool = False, tool_calls: bool = True, tools=None
    ) -> None:
        super().__init__(starts_in_reasoning=starts_in_reasoning, tool_calls=tool_calls)
        self._names = offered_names(tools) if tool_calls else frozenset()
        # Deciding whether the reply is untagged calls: the text held meanwhile.
        self._deciding = bool(self._names) and not starts_in_reasoning
        self._held = ""

    def feed(self, text: str) -> list[Event]:
        if not self._deciding:
            return super().feed(text)
        self._held += text
        if _verdict(self._held, self._names) != _FAIL:
            return []
        return self._give_up()

    def finish(self) -> list[Event]:
        if not self._deciding:
            return super().finish()
        calls = untagged_calls(self._held, self._names)
        if calls is None:
            return self._give_up() + super().finish()
        self._deciding = False
        events: list[Event] = []
        for index, (name, arguments) in enumerate(calls):
            events += [
                ToolCallStart(index, new_call_id(), name),
                ToolCallArgsDelta(index, arguments),
                ToolCallEnd(index),
            ]
        self._n_calls = len(calls)
        return events

    def _give_up(self) -> list[Event]:
        """Not untagged calls: what was held is parsed as the tagged format."""
        self._deciding = False
        held, self._held = self._held, ""
        return super().feed(held)
