"""OpenAI Responses adapter: POST /v1/responses (stream and not), function tools, reasoning."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from freetoken.server import events as ev
from freetoken.server.core import ForcedOutput, GenerationCore, GenerationRequest
from freetoken.server.errors import ApiError
from freetoken.server.openai_api import chat_tool_choice, check_model, sampling
from freetoken.server.validate import (
    field,
    template_tool,
    template_tool_call,
    text_of,
    tool_arguments,
)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def template_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` + `input` (a string or a list of items) -> the template's messages."""
    out: list[dict[str, Any]] = []
    instructions = field(body, "instructions", str, None)
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = field(body, "input", (str, list))
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not items:
        raise ApiError(400, "invalid_request_error", "input must not be empty")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, "invalid_request_error", f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = field(item, "role", str)
            if role == "developer":
                role = "system"
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, "invalid_request_error", f"input[{i}]: unknown role '{role}'")
            out.append({"role": role, "content": text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            arguments = tool_arguments(item.get("arguments"))
            call = template_tool_call(item.get("call_id"), field(item, "name", str), arguments)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id", ""),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind != "reasoning":
            raise ApiError(400, "invalid_request_error", f"input[{i}]: unsupported type '{kind}'")
    return out


def template_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    if body.get("tool_choice") == "none":
        return []
    out = []
    for t in field(body, "tools", list, []):
        if not isinstance(t, dict) or t.get("type") != "function" or "name" not in t:
            raise ApiError(400, "invalid_request_error", "only function tools are supported")
        parameters = t.get("parameters", {"type": "object"})
        out.append(template_tool(t["name"], t.get("description", ""), parameters))
    return out


class _Builder:
    """Folds core events into Responses output items, and says which stream events each makes."""

    def __init__(self):
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None

    def _start(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = self._close()
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        out.append(("response.output_item.added", {"output_index": index, "item": _snapshot(item)}))
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            out.append(("response.content_part.added", _part(item, index, part=dict(part))))
        return out

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [
                ("response.output_text.done", _part(item, index, text=part["text"])),
                ("response.content_part.done", _part(item, index, part=dict(part))),
            ]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(("response.reasoning_text.done", _part(item, index, text=part["text"])))
        elif item["type"] == "function_call":
            out += [
                (
                    "response.function_call_arguments.done",
                    {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]},
                )
            ]
        out.append(("response.output_item.done", {"output_index": index, "item": _snapshot(item)}))
        return out

    def feed(self, e: ev.Event) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        if isinstance(e, ev.TextDelta | ev.ReasoningDelta):
            kind, new_item, event = _TEXT_ITEMS[type(e)]
            if self.open is None or self.open["type"] != kind:
                out += self._start(new_item())
            self.open["content"][0]["text"] += e.text
            out.append((event, _part(self.open, len(self.output) - 1, delta=e.text)))
        elif isinstance(e, ev.ToolCallStart):
            out += self._start(
                {
                    "type": "function_call",
                    "id": _id("fc"),
                    "call_id": e.id,
                    "name": e.name,
                    "arguments": "",
                    "status": "in_progress",
                }
            )
        elif isinstance(e, ev.ToolCallArgsDelta):
            self.open["arguments"] += e.text
            out.append(
                (
                    "response.function_call_arguments.delta",
                    {
                        "item_id": self.open["id"],
                        "output_index": len(self.output) - 1,
                        "delta": e.text,
                    },
                )
            )
        elif isinstance(e, ev.ToolCallEnd):
            out += self._close()
        return out

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        return self._close()


def _part(item: dict[str, Any], index: int, **fields: Any) -> dict[str, Any]:
    """An event about the (single) content part of output item `index`."""
    return {"item_id": item["id"], "output_index": index, "content_index": 0, **fields}


def _message_item() -> dict[str, Any]:
    return {
        "type": "message",
        "id": _id("msg"),
        "status": "in_progress",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "", "annotations": []}],
    }


def _reasoning_item() -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": ""}],
    }


# Text-like events: the output item they go into, and the stream event of each delta.
_TEXT_ITEMS = {
    ev.TextDelta: ("message", _message_item, "response.output_text.delta"),
    ev.ReasoningDelta: ("reasoning", _reasoning_item, "response.reasoning_text.delta"),
}


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def _response(rid, created, model, body, output, status, usage: ev.Usage | None, finish):
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"}
        if finish is not None and finish.reason == "length"
        else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "usage": None
        if usage is None
        else {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        },
    }


async def responses(core: GenerationCore, body: dict[str, Any]):
    model = check_model(core, body)
    tools = template_tools(body)
    prompt = core.render(template_messages(body), tools=tools)
    forced = ForcedOutput()
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict) and choice.get("type") == "function":
        # The Responses API names the tool at the top level of the choice.
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if (tool := chat_tool_choice(choice)) is not None:
        prompt, forced = core.force_tool_call(prompt, tools, tool)
    chat_like = {**body, "max_tokens": body.get("max_output_tokens")}
    req = GenerationRequest(prompt, sampling(core, chat_like, prompt), tools=tools, forced=forced)
    rid, created = _id("resp"), int(time.time())
    events = core.start(req)
    if field(body, "stream", bool, False):
        return _stream(events, rid, created, model, body)
    builder, usage, finish = _Builder(), None, None
    async for e in events:
        builder.feed(e)
        usage = e if isinstance(e, ev.Usage) else usage
        finish = e if isinstance(e, ev.Finish) else finish
    builder.finish()
    status = "incomplete" if finish.reason == "length" else "completed"
    return _response(rid, created, model, body, builder.output, status, usage, finish)


async def _stream(events, rid, created, model, body) -> AsyncIterator[str]:
    seq = 0

    def sse(kind: str, data: dict[str, Any]) -> str:
        nonlocal seq
        seq += 1
        return (
            f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n"
        )

    start = _response(rid, created, model, body, [], "in_progress", None, None)
    yield sse("response.created", {"response": start})
    yield sse("response.in_progress", {"response": start})
    builder, usage, finish = _Builder(), None, None
    async for e in events:
        for kind, data in builder.feed(e):
            yield sse(kind, data)
        usage = e if isinstance(e, ev.Usage) else usage
        finish = e if isinstance(e, ev.Finish) else finish
    for kind, data in builder.finish():
        yield sse(kind, data)
    status = "incomplete" if finish.reason == "length" else "completed"
    final = _response(rid, created, model, body, builder.output, status, usage, finish)
    yield sse(
        "response.completed" if status == "completed" else "response.incomplete",
        {"response": final},
    )
