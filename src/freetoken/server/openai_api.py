"""OpenAI adapter: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
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
    template_tool_call,
    text_of,
    tool_arguments,
)

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


def check_model(core: GenerationCore, body: dict[str, Any]) -> str:
    return core.check_model(field(body, "model", str))


def sampling(core: GenerationCore, body: dict[str, Any], prompt_ids: list[int]) -> SamplingParams:
    max_tokens = field(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = field(body, "max_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, "invalid_request_error", "max_tokens must be at least 1")
    if field(body, "n", int, 1) != 1:
        raise ApiError(400, "invalid_request_error", "only n=1 is supported")
    try:
        return SamplingParams(
            max_new_tokens=core.output_budget(prompt_ids, max_tokens),
            temperature=field(body, "temperature", float, 1.0),
            top_p=field(body, "top_p", float, 1.0),
            top_k=field(body, "top_k", int, 0),
            min_p=field(body, "min_p", float, 0.0),
            repetition_penalty=field(body, "repetition_penalty", float, 1.0),
            seed=field(body, "seed", int, None),
            stop=stop_list(body.get("stop")),
        )
    except ValueError as e:
        raise ApiError(400, "invalid_request_error", str(e)) from e


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's message dicts."""
    messages = field(body, "messages", list)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, "invalid_request_error", f"messages[{i}] must be an object")
        role = field(m, "role", str)
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, "invalid_request_error", f"messages[{i}]: unknown role '{role}'")
        msg: dict[str, Any] = {"role": role, "content": text_of(m.get("content"), f"messages[{i}]")}
        if role == "assistant":
            if m.get("reasoning_content"):
                msg["reasoning_content"] = field(m, "reasoning_content", str)
            calls = field(m, "tool_calls", list, [])
            if calls:
                msg["tool_calls"] = [_template_call(c, i) for c in calls]
        if role == "tool":
            msg["tool_call_id"] = field(m, "tool_call_id", str, "")
        out.append(msg)
    return out


def _template_call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise ApiError(400, "invalid_request_error", f"messages[{i}].tool_calls: bad tool call")
    arguments = tool_arguments(fn.get("arguments"))
    return template_tool_call(call.get("id"), field(fn, "name", str), arguments)


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = field(body, "tools", list, [])
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function" or "function" not in t:
            raise ApiError(400, "invalid_request_error", "tools must be function tools")
    return tools


def chat_tool_choice(choice: Any) -> str | None:
    """A chat `tool_choice`: None when the model decides (or no tool may be called), else
    REQUIRED or a tool name."""
    if choice in ("auto", "none"):
        return None
    if choice == "required":
        return REQUIRED
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if isinstance(name, str) and choice.get("type") == "function":  # (a dict, then)
        return name
    raise ApiError(
        400,
        "invalid_request_error",
        "tool_choice must be 'auto', 'none', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
    )


async def chat_completions(core: GenerationCore, body: dict[str, Any]):
    model = check_model(core, body)
    stream = field(body, "stream", bool, False)
    tools = chat_tools(body)
    template_kwargs = {
        **core.reasoning_options(effort=field(body, "reasoning_effort", str, None)),
        **field(body, "chat_template_kwargs", dict, {}),  # e.g. enable_thinking
    }
    prompt = core.render(chat_messages(body), tools=tools, **template_kwargs)
    forced = ForcedOutput()
    if (tool := chat_tool_choice(body.get("tool_choice", "auto"))) is not None:
        prompt, forced = core.force_tool_call(prompt, tools, tool)
    params = sampling(core, body, prompt)
    req = GenerationRequest(prompt, params, tools=tools, forced=forced)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if stream:
        options = field(body, "stream_options", dict, {})
        usage = field(options, "include_usage", bool, False)
        return _chat_stream(core.start(req), cid, created, model, usage)
    return await _chat_whole(core.start(req), cid, created, model)


async def _chat_whole(events, cid, created, model) -> dict[str, Any]:
    text, reasoning, calls, usage, finish = [], [], {}, None, None
    async for e in events:
        if isinstance(e, ev.TextDelta):
            text.append(e.text)
        elif isinstance(e, ev.ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ev.ToolCallStart):
            calls[e.index] = {
                "id": e.id,
                "type": "function",
                "function": {"name": e.name, "arguments": ""},
            }
        elif isinstance(e, ev.ToolCallArgsDelta):
            calls[e.index]["function"]["arguments"] += e.text
        elif isinstance(e, ev.Usage):
            usage = e
        elif isinstance(e, ev.Finish):
            finish = e
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": FINISH[finish.reason],
                "logprobs": None,
            }
        ],
        "usage": usage_json(usage),
    }


def usage_json(u: ev.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def sse(data: Any) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


# Seconds without an event (a long prefill) before a keep-alive: an SSE comment, which the
# OpenAI SDKs skip, so clients and proxies with idle timeouts do not give up.
KEEPALIVE_INTERVAL = 10.0
KEEPALIVE = ": keep-alive\n\n"


async def _chat_stream(events, cid, created, model, include_usage) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    async for e in with_keepalive(events, KEEPALIVE_INTERVAL):
        if e is None:
            yield KEEPALIVE
        elif isinstance(e, ev.TextDelta):
            yield chunk({"content": e.text})
        elif isinstance(e, ev.ReasoningDelta):
            yield chunk({"reasoning_content": e.text})
        elif isinstance(e, ev.ToolCallStart):
            yield chunk(
                {
                    "tool_calls": [
                        {
                            "index": e.index,
                            "id": e.id,
                            "type": "function",
                            "function": {"name": e.name, "arguments": ""},
                        }
                    ]
                }
            )
        elif isinstance(e, ev.ToolCallArgsDelta):
            yield chunk({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        elif isinstance(e, ev.Usage):
            usage = e
        elif isinstance(e, ev.Finish):
            yield chunk({}, FINISH[e.reason])
    if include_usage:
        yield sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage_json(usage),
            }
        )
    yield sse("[DONE]")


async def completions(core: GenerationCore, body: dict[str, Any]):
    model = check_model(core, body)
    stream = field(body, "stream", bool, False)
    prompt = field(body, "prompt", str)
    if not prompt:
        raise ApiError(400, "invalid_request_error", "prompt must not be empty")
    prompt_ids = core.tokenizer.encode(prompt)
    params = sampling(core, body, prompt_ids)
    req = GenerationRequest(prompt_ids, params, parse_output=False)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def payload(text: str, finish: str | None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        }

    events = core.start(req)
    if stream:

        async def chunks():
            async for e in with_keepalive(events, KEEPALIVE_INTERVAL):
                if e is None:
                    yield KEEPALIVE
                elif isinstance(e, ev.TextDelta):
                    yield sse(payload(e.text, None))
                elif isinstance(e, ev.Finish):
                    yield sse(payload("", FINISH[e.reason]))
            yield sse("[DONE]")

        return chunks()
    text, usage, finish = [], None, None
    async for e in events:
        if isinstance(e, ev.TextDelta):
            text.append(e.text)
        elif isinstance(e, ev.Usage):
            usage = e
        elif isinstance(e, ev.Finish):
            finish = e
    return {**payload("".join(text), FINISH[finish.reason]), "usage": usage_json(usage)}


def models(core: GenerationCore) -> dict[str, Any]:
    """The served model, with its context length under the names clients read (vLLM's
    `max_model_len`; `context_length` as llama-server and LM Studio-style clients take it)."""
    return {
        "object": "list",
        "data": [
            {
                "id": core.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "freetoken",
                "max_model_len": core.max_context,
                "context_length": core.max_context,
            }
        ],
    }
