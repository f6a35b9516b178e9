"""Anthropic adapter: /v1/messages (stream and not) and /v1/messages/count_tokens."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from freetoken.engine.sampling import SamplingParams
from freetoken.server import events as ev
from freetoken.server.core import (
    REQUIRED,
    ForcedOutput,
    GenerationCore,
    GenerationRequest,
    with_keepalive,
)
from freetoken.server.errors import ApiError
from freetoken.server.validate import (
    field,
    stop_list,
    template_tool,
    template_tool_call,
    text_of,
)

STOP_REASON = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "stop_sequence": "stop_sequence",
}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, "invalid_request_error", f"{where}: content must be a string or a list")
    for block in content:
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, "invalid_request_error", f"{where}: every block needs a 'type'")
    return content


def template_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic system + messages -> the chat template's message dicts."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append(
            {
                "role": "system",
                "content": text_of(system, "system")
                if not isinstance(system, list)
                else text_of(_text_only(system), "system"),
            }
        )
    messages = field(body, "messages", list)
    if not messages:
        raise ApiError(400, "invalid_request_error", "messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, "invalid_request_error", f"messages[{i}] must be an object")
        role = field(m, "role", str)
        if role not in ("user", "assistant"):
            raise ApiError(400, "invalid_request_error", f"messages[{i}]: unknown role '{role}'")
        blocks = _blocks(m.get("content"), f"messages[{i}]")
        if role == "user":
            text = []
            for b in blocks:
                if b["type"] == "tool_result":
                    content = b.get("content")
                    result = (
                        content
                        if isinstance(content, str)
                        else text_of(_text_only(content or []), f"messages[{i}].tool_result")
                    )
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": b.get("tool_use_id", ""),
                            "content": result,
                        }
                    )
                elif b["type"] == "text":
                    text.append(field(b, "text", str))
                else:
                    raise ApiError(
                        400,
                        "invalid_request_error",
                        f"messages[{i}]: unsupported block type '{b['type']}'",
                    )
            if text:
                out.append({"role": "user", "content": "".join(text)})
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            calls = []
            for b in blocks:
                if b["type"] == "text":
                    msg["content"] += field(b, "text", str)
                elif b["type"] == "thinking":
                    msg["reasoning_content"] = field(b, "thinking", str)
                elif b["type"] == "tool_use":
                    name = field(b, "name", str)
                    calls.append(template_tool_call(b.get("id"), name, b.get("input") or {}))
                elif b["type"] != "redacted_thinking":
                    raise ApiError(
                        400,
                        "invalid_request_error",
                        f"messages[{i}]: unsupported block type '{b['type']}'",
                    )
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _text_only(blocks: list[Any]) -> list[dict[str, Any]]:
    return [b for b in blocks if isinstance(b, dict) and b.get("type") == "text"]


def messages_tool_choice(body: dict[str, Any]) -> str | None:
    """None when the model decides (or no tool may be called), else REQUIRED or a tool name."""
    choice = field(body, "tool_choice", dict, {"type": "auto"})
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return None
    if kind == "any":
        return REQUIRED
    if kind == "tool" and isinstance(choice.get("name"), str):
        return choice["name"]
    raise ApiError(
        400, "invalid_request_error", "tool_choice.type must be auto, any, none or tool (+ name)"
    )


def template_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = field(body, "tools", list, [])
    choice = field(body, "tool_choice", dict, {"type": "auto"})
    if choice.get("type") == "none":
        return []
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ApiError(400, "invalid_request_error", "every tool needs a 'name'")
        parameters = t.get("input_schema", {"type": "object"})
        out.append(template_tool(t["name"], t.get("description", ""), parameters))
    return out


def _request(core: GenerationCore, body: dict[str, Any]) -> tuple[str, GenerationRequest]:
    model = core.check_model(field(body, "model", str))
    tools = template_tools(body)
    prompt = core.render(template_messages(body), tools=tools)
    forced = ForcedOutput()
    if (tool := messages_tool_choice(body)) is not None:
        prompt, forced = core.force_tool_call(prompt, tools, tool)
    max_tokens = field(body, "max_tokens", int)
    if max_tokens < 1:
        raise ApiError(400, "invalid_request_error", "max_tokens must be at least 1")
    try:
        params = SamplingParams(
            max_new_tokens=core.check_length(prompt, max_tokens),
            temperature=field(body, "temperature", float, 1.0),
            top_p=field(body, "top_p", float, 1.0),
            top_k=field(body, "top_k", int, 0),
            stop=stop_list(body.get("stop_sequences")),
        )
    except ValueError as e:
        raise ApiError(400, "invalid_request_error", str(e)) from e
    return model, GenerationRequest(prompt, params, tools=tools, forced=forced)


async def messages(core: GenerationCore, body: dict[str, Any]):
    model, req = _request(core, body)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    events = core.start(req)
    if field(body, "stream", bool, False):
        return _stream(events, mid, model, len(req.prompt_ids))
    content: list[dict[str, Any]] = []
    args: dict[int, list[str]] = {}
    usage, finish = None, None
    async for e in events:
        if isinstance(e, ev.TextDelta | ev.ReasoningDelta):
            kind, key = (
                ("text", "text") if isinstance(e, ev.TextDelta) else ("thinking", "thinking")
            )
            if not content or content[-1]["type"] != kind:
                content.append(
                    {"type": kind, key: ""} | ({"signature": ""} if kind == "thinking" else {})
                )
            content[-1][key] += e.text
        elif isinstance(e, ev.ToolCallStart):
            content.append({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            args[len(content) - 1] = []
        elif isinstance(e, ev.ToolCallArgsDelta):
            args[max(args)].append(e.text)
        elif isinstance(e, ev.Usage):
            usage = e
        elif isinstance(e, ev.Finish):
            finish = e
    for i, parts in args.items():
        content[i]["input"] = json.loads("".join(parts) or "{}")
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": STOP_REASON[finish.reason],
        "stop_sequence": finish.stop_sequence,
        "usage": _usage(usage),
    }


def _usage(u: ev.Usage) -> dict[str, int]:
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


# Seconds without an event (a long prefill) before a keep-alive `ping`.
PING_INTERVAL = 10.0


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _stream(events, mid: str, model: str, prompt_tokens: int) -> AsyncIterator[str]:
    yield _sse(
        "message_start",
        {
            "message": {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            }
        },
    )
    yield _sse("ping", {})
    index, open_kind = -1, None

    def close():
        return _sse("content_block_stop", {"index": index})

    async for e in with_keepalive(events, PING_INTERVAL):
        if e is None:
            yield _sse("ping", {})
        elif isinstance(e, ev.TextDelta | ev.ReasoningDelta):
            kind = "text" if isinstance(e, ev.TextDelta) else "thinking"
            if open_kind != kind:
                if open_kind is not None:
                    if open_kind == "thinking":
                        yield _sse(
                            "content_block_delta",
                            {"index": index, "delta": {"type": "signature_delta", "signature": ""}},
                        )
                    yield close()
                index, open_kind = index + 1, kind
                block = (
                    {"type": "text", "text": ""}
                    if kind == "text"
                    else {"type": "thinking", "thinking": "", "signature": ""}
                )
                yield _sse("content_block_start", {"index": index, "content_block": block})
            delta = (
                {"type": "text_delta", "text": e.text}
                if kind == "text"
                else {"type": "thinking_delta", "thinking": e.text}
            )
            yield _sse("content_block_delta", {"index": index, "delta": delta})
        elif isinstance(e, ev.ToolCallStart):
            if open_kind is not None:
                yield close()
            index, open_kind = index + 1, "tool_use"
            yield _sse(
                "content_block_start",
                {
                    "index": index,
                    "content_block": {"type": "tool_use", "id": e.id, "name": e.name, "input": {}},
                },
            )
        elif isinstance(e, ev.ToolCallArgsDelta):
            yield _sse(
                "content_block_delta",
                {"index": index, "delta": {"type": "input_json_delta", "partial_json": e.text}},
            )
        elif isinstance(e, ev.ToolCallEnd):
            yield close()
            open_kind = None
        elif isinstance(e, ev.Usage):
            usage = e
        elif isinstance(e, ev.Finish):
            if open_kind is not None:
                yield close()
            yield _sse(
                "message_delta",
                {
                    "delta": {
                        "stop_reason": STOP_REASON[e.reason],
                        "stop_sequence": e.stop_sequence,
                    },
                    "usage": {"output_tokens": usage.completion_tokens},
                },
            )
            yield _sse("message_stop", {})


def count_tokens(core: GenerationCore, body: dict[str, Any]) -> dict[str, int]:
    core.check_model(field(body, "model", str))
    return {"input_tokens": len(core.render(template_messages(body), tools=template_tools(body)))}
