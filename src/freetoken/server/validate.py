"""Readers for the free-form JSON inside requests (content blocks, Responses items, tool
results: objects whose fields depend on their `type`, which the schemas leave open): a wrong
type becomes a 400 that names the field, not a traceback; and the chat template's own shapes
for tools and past tool calls, whichever API sent them."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from freetoken.server.errors import ApiError

_MISSING = object()
_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = _MISSING):
    """`body[key]` checked against `kind`; `default` when absent or null (required if none)."""
    value = body.get(key)
    if value is None:
        if default is _MISSING:
            raise ApiError(400, "invalid_request_error", f"missing required field '{key}'")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    # bool is an int in Python, not in JSON: true is no valid max_tokens.
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        names = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
        raise ApiError(400, "invalid_request_error", f"'{key}' must be {names}")
    return value


def text_of(content: Any, where: str) -> str:
    """Message content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, BaseModel):  # a schema's Part
                part = part.model_dump()
            if not isinstance(part, dict) or part.get("type") not in (
                "text",
                "input_text",
                "output_text",
            ):
                raise ApiError(
                    400, "invalid_request_error", f"{where}: only text content parts are supported"
                )
            parts.append(field(part, "text", str))
        return "".join(parts)
    raise ApiError(400, "invalid_request_error", f"{where}: content must be a string or a list")


def stop_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise ApiError(400, "invalid_request_error", "'stop' must be a string or an array of strings")


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
