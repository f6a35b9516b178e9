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


# Claude Code opens its system prompt with a billing header for Anthropic's servers, which read
# it and do not show it to the model. Its text changes with the conversation (captured:
# `cc_version=2.1.197.1c0`, `.363`, `.c40`), so keeping it would also keep conversations from
# reusing each other's cached prompt prefix.
_BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(system: Any, where: str) -> str:
    """A system prompt (a string or text blocks) as text, without the billing header."""
    if isinstance(system, list):
        system = [
            b
            for b in _text_only(system)
            if not (isinstance(b.get("text"), str) and b["text"].startswith(_BILLING_HEADER))
        ]
    return text_of(system, where)


def template_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic system + messages -> the chat template's message dicts."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system and (text := system_text(system, "system")):
        out.append({"role": "system", "content": text})
    messages = field(body, "messages", list)
    if not messages:
        raise ApiError(400, "invalid_request_error", "messages must not be empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, "invalid_request_error", f"messages[{i}] must be an object")
        role = field(m, "role", str)
        if role == "system":
            # Mid-conversation system messages (the `mid-conversation-system` beta Claude
            # Code uses): rendered where they stand.
            out.append(
                {"role": "system", "content": system_text(m.get("content"), f"messages[{i}]")}
            )
            continue
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


def reasoning(core: GenerationCore, body: dict[str, Any]) -> dict[str, Any]:
    """`thinking` and `output_config.effort` as chat template arguments, where the template
    has them (see GenerationCore.reasoning_options)."""
    thinking = field(body, "thinking", dict, {}).get("type")
    effort = field(field(body, "output_config", dict, {}), "effort", str, None)
    on = {"disabled": False, "enabled": True}.get(thinking)  # adaptive: the template decides
    return core.reasoning_options(effort=effort, thinking=on)


def _request(core: GenerationCore, body: dict[str, Any]) -> tuple[str, GenerationRequest]:
    model = core.check_model(field(body, "model", str))
    tools = template_tools(body)
    prompt = core.render(template_messages(body), tools=tools, **reasoning(core, body))
    forced = ForcedOutput()
    if (tool := messages_tool_choice(body)) is not None:
        prompt, forced = core.force_tool_call(prompt, tools, tool)
    max_tokens = field(body, "max_tokens", int)
    if max_tokens < 1:
        raise ApiError(400, "invalid_request_error", "max_tokens must be at least 1")
    try:
        params = SamplingParams(
            max_new_tokens=core.output_budget(prompt, max_tokens),
            temperature=field(body, "temperature", float, 1.0),
            top_p=field(body, "top_p", float, 1.0),
            top_k=field(body, "top_k", int, 0),
            stop=stop_list(body.get("stop_sequences")),
        )
    except ValueError as e:
        raise ApiError(400, "invalid_request_error", str(e)) from e
    return model, GenerationRequest(prompt, params, tools=tools, forced=forced)


async def messages(core: GenerationCore, body: dict[str, Any]):
    stream = field(body, "stream", bool, False)
    model, req = _request(core, body)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    generation = core.start(req)
    if stream:
        return _stream(generation, mid, model, len(req.prompt_ids))
    events = generation
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
    """Anthropic usage: `input_tokens` counts only the prompt tokens the cache did not hold."""
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


# Seconds without an event (a long prefill) before a keep-alive `ping`.
PING_INTERVAL = 10.0
# How long a stream waits for the engine to admit its request, so message_start can report
# the prompt tokens the cache holds; past this (a long queue) it starts without them, and
# message_delta carries the whole usage at the end.
ADMISSION_WAIT = 5.0


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _stream(events, mid: str, model: str, prompt_tokens: int) -> AsyncIterator[str]:
    cached = await events.cached_tokens(ADMISSION_WAIT)
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
                "usage": _usage(ev.Usage(prompt_tokens, 0, cached or 0)),
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
                    "usage": _usage(usage),
                },
            )
            yield _sse("message_stop", {})


def count_tokens(core: GenerationCore, body: dict[str, Any]) -> dict[str, int]:
    core.check_model(field(body, "model", str))
    prompt = core.render(
        template_messages(body), tools=template_tools(body), **reasoning(core, body)
    )
    return {"input_tokens": len(prompt)}
