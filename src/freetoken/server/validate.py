"""What the adapters share in reading requests: content as text, stop lists, tool arguments,
and the chat template's own shapes for tools and past tool calls, whichever API sent them."""

from __future__ import annotations

import json
from typing import Any

from freetoken.server.errors import bad_request, shown
from freetoken.server.schemas import Part, location, parse_as

TEXT_PARTS = ("text", "input_text", "output_text")


def text_of(content: Any, where: tuple, anthropic: bool = False) -> str:
    """Message content as text: a string, or a list of text parts (schema Parts, or JSON
    objects parsed as them here)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, Part):
            part = parse_as(Part, part, (*where, i), anthropic)
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(
                f"{location((*where, i), anthropic)}: only text content parts are supported "
                f"(got {shown(part.type, 40)!r})"
            )
        parts.append(part.text)
    return "".join(parts)


def stop_list(value: str | list[str] | None) -> tuple[str, ...]:
    """A request's stop strings (typed by its schema), empty ones dropped."""
    if value is None:
        return ()
    return tuple(s for s in ([value] if isinstance(value, str) else value) if s)


def tool_arguments(value: Any) -> Any:
    """A tool call's arguments for the chat template: parsed when they are JSON text (the
    template serialises objects itself), else passed as they are (it prints strings)."""
    if isinstance(value, str):
        try:
            return json.loads(value or "{}")
        except ValueError:
            return value
    return value if value is not None else {}


def template_tool(name: str, description: str, parameters: Any) -> dict[str, Any]:
    """A tool as the chat template takes it (the OpenAI chat format), whichever API sent it."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def template_tool_call(call_id: Any, name: str, arguments: Any) -> dict[str, Any]:
    """A past tool call in an assistant message, as the chat template takes it."""
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}
