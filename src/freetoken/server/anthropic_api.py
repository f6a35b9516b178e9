"""Anthropic adapter: /v1/messages (stream and not) and /v1/messages/count_tokens.

As in openai_api.py, each endpoint is `prepare_*` (off the event loop) then `answer_*`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from freetoken.server import events as ev
from freetoken.server.core import (
    REQUIRED,
    ForcedOutput,
    GenerationCore,
    GenerationRequest,
    failed,
    with_keepalive,
)
from freetoken.server.errors import bad_request, shown
from freetoken.server.schemas import (
    CountTokensRequest,
    MessagesBase,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    location,
    parse_as,
)
from freetoken.server.validate import stop_list, template_tool, template_tool_call

STOP_REASON = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "stop_sequence": "stop_sequence",
}
_NOT_IN_TOOL_USE_IDS = re.compile(r"[^a-zA-Z0-9_-]")


# A Kimi call id as its tool_use block carries it (`functions.NAME:IDX` -> `functions_NAME_IDX`).
_KIMI_TOOL_USE_ID = re.compile(r"functions_(.+)_(\d+)")


def model_call_id(call_id: str, parser: str | None) -> str:
    """A tool_use id a request replays, as the model wrote it: Kimi's ids come back from
    `_tool_use_block`'s form to `functions.NAME:IDX`, so the prompt renders the model's own
    tokens (and reuses the prefix the cache holds of them); others as they are."""
    if parser == "kimi_k2" and (m := _KIMI_TOOL_USE_ID.fullmatch(call_id)):
        return f"functions.{m[1]}:{m[2]}"
    return call_id


def _tool_use_block(start: ev.ToolCallStart) -> dict[str, Any]:
    """A call's tool_use block, its input still empty. The call's id as Anthropic's API has
    them (`^[a-zA-Z0-9_-]+$`; its servers refuse any other in a conversation a client replays
    there): other characters become `_`, as Kimi's `functions.get_weather:0` becomes
    `functions_get_weather_0` (parsers/kimi.py)."""
    call_id = _NOT_IN_TOOL_USE_IDS.sub("_", start.id)
    return {"type": "tool_use", "id": call_id, "name": start.name, "input": {}}


# Claude Code opens its system prompt with a billing header for Anthropic's servers, which read
# it and do not show it to the model. Its text changes with the conversation (captured:
# `cc_version=2.1.197.1c0`, `.363`, `.c40`), so keeping it would also keep conversations from
# reusing each other's cached prompt prefix.
_BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(system: str | list[dict[str, Any]], where: tuple) -> str:
    """A system prompt (a string or text blocks) as text, without the billing header."""
    if isinstance(system, list):
        blocks = [parse_as(TextBlock, b, (*where, i), ANTHROPIC) for i, b in enumerate(system)]
        return "".join(b.text for b in blocks if not b.text.startswith(_BILLING_HEADER))
    return system


ANTHROPIC = True  # errors located as Anthropic writes them (messages.0.content)
# Blocks each role may hold, by type; redacted thinking is dropped.
USER_BLOCKS = {"text": TextBlock, "tool_result": ToolResultBlock}
ASSISTANT_BLOCKS = {"text": TextBlock, "thinking": ThinkingBlock, "tool_use": ToolUseBlock}


def _blocks(content: str | list[dict[str, Any]], kinds: dict, where: tuple) -> list:
    if isinstance(content, str):
        return [TextBlock(type="text", text=content)]
    out = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "redacted_thinking" and "thinking" in kinds:
            continue
        if kind not in kinds:
            raise bad_request(
                f"{location((*where, j), ANTHROPIC)}: unsupported block type "
                f"{shown(str(kind), 40)!r}"
            )
        out.append(parse_as(kinds[kind], block, (*where, j), ANTHROPIC))
    return out


def template_messages(body: MessagesBase, parser: str | None = None) -> list[dict[str, Any]]:
    """Anthropic system + messages -> the chat template's message dicts (tool call ids as
    the model of `parser` writes them: `model_call_id`)."""
    out: list[dict[str, Any]] = []
    if body.system and (text := system_text(body.system, ("system",))):
        out.append({"role": "system", "content": text})
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages")
    for i, m in enumerate(body.messages):
        where = ("messages", i, "content")
        if m.role == "system":
            # Mid-conversation system messages (the `mid-conversation-system` beta Claude
            # Code uses): rendered where they stand.
            out.append({"role": "system", "content": system_text(m.content, where)})
        elif m.role == "user":
            text = []
            for b in _blocks(m.content, USER_BLOCKS, where):
                if isinstance(b, ToolResultBlock):
                    result = tool_result_text(b.content, (*where, "content"))
                    call_id = model_call_id(b.tool_use_id, parser)
                    out.append({"role": "tool", "tool_call_id": call_id, "content": result})
                else:
                    text.append(b.text)
            if text:
                out.append({"role": "user", "content": "".join(text)})
        elif m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": ""}
            calls = []
            for b in _blocks(m.content, ASSISTANT_BLOCKS, where):
                if isinstance(b, TextBlock):
                    msg["content"] += b.text
                elif isinstance(b, ThinkingBlock):
                    msg["reasoning_content"] = b.thinking
                else:
                    call_id = model_call_id(b.id, parser)
                    calls.append(template_tool_call(call_id, b.name, b.input or {}))
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            raise bad_request(f"messages.{i}.role: unknown role '{shown(m.role, 40)}'")
    return out


def tool_result_text(content: str | list[dict[str, Any]] | None, where: tuple) -> str:
    """A tool result's content as text. Blocks other than text (an image a tool read) become
    a note in their place, so the model knows something was there."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, block in enumerate(content):
        if block.get("type") == "text":
            parts.append(parse_as(TextBlock, block, (*where, j), ANTHROPIC).text)
        else:
            kind = shown(str(block.get("type")), 40)
            parts.append(f"[{kind} omitted: this model reads text only]")
    return "".join(parts)


def messages_tool_choice(body: MessagesBase) -> str | None:
    """None when the model decides (or no tool may be called), else REQUIRED or a tool name."""
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return None
    if choice.type == "any":
        return REQUIRED
    if choice.name is None:
        raise bad_request("tool_choice: a choice of type 'tool' needs a 'name'")
    return choice.name


def template_tools(body: MessagesBase) -> list[dict[str, Any]]:
    if not body.tools or (body.tool_choice is not None and body.tool_choice.type == "none"):
        return []
    return [
        template_tool(t.name, t.description or "", t.input_schema or {"type": "object"})
        for t in body.tools
    ]


def reasoning(core: GenerationCore, body: MessagesBase) -> dict[str, Any]:
    """`thinking` and `output_config.effort` as chat template arguments, where the template
    has them (see GenerationCore.reasoning_options)."""
    thinking = body.thinking.type if body.thinking is not None else None
    effort = body.output_config.effort if body.output_config is not None else None
    on = {"disabled": False, "enabled": True}.get(thinking)  # adaptive: the template decides
    return core.reasoning_options(effort=effort, thinking=on)


def render(core: GenerationCore, body: MessagesBase) -> tuple[list[int], list[dict[str, Any]]]:
    """The prompt's tokens and the template's tools."""
    tools = template_tools(body)
    kwargs = {
        **reasoning(core, body),
        **core.template_kwargs(getattr(body, "chat_template_kwargs", None)),
    }
    return core.render(template_messages(body, core.parser_name), tools=tools, **kwargs), tools


@dataclass
class Prepared:
    request: GenerationRequest
    model: str
    stream: bool


def prepare_messages(core: GenerationCore, body: MessagesRequest) -> Prepared:
    model = core.check_model(body.model)
    if body.output_config is not None and body.output_config.format is not None:
        raise bad_request(
            "output_config.format (structured output) is not supported: no constrained decoding yet"
        )
    prompt, tools = render(core, body)
    forced = ForcedOutput()
    if (tool := messages_tool_choice(body)) is not None:
        prompt, forced = core.force_tool_call(prompt, tools, tool)
    if body.max_tokens < 1:
        raise bad_request("max_tokens: must be at least 1")
    params = core.sampling_params(
        max_new_tokens=core.output_budget(prompt, body.max_tokens),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=stop_list(body.stop_sequences),
        speculative=body.speculative,
    )
    return Prepared(
        GenerationRequest(prompt, params, tools=tools, forced=forced), model, bool(body.stream)
    )


def answer_messages(core: GenerationCore, prepared: Prepared):
    """Submit: the stream, or a coroutine of the whole message."""
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    generation = core.start(prepared.request)
    if prepared.stream:
        return _stream(generation, mid, prepared.model, len(prepared.request.prompt_ids))
    return _whole(generation, mid, prepared.model)


async def _whole(events, mid: str, model: str) -> dict[str, Any]:
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
            content.append(_tool_use_block(e))
            args[len(content) - 1] = []
        elif isinstance(e, ev.ToolCallArgsDelta):
            args[max(args)].append(e.text)
        elif isinstance(e, ev.Usage):
            usage = e
        elif isinstance(e, ev.Finish):
            finish = e
        elif isinstance(e, ev.Failure):
            raise failed(e)
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
    yield _message_start(mid, model, ev.Usage(prompt_tokens, 0, cached or 0))
    yield _sse("ping", {})
    index, open_kind = -1, None

    def close():
        return _sse("content_block_stop", {"index": index})

    async for e in with_keepalive(events, PING_INTERVAL):
        if e is None:
            yield _sse("ping", {})
        elif isinstance(e, ev.TextDelta | ev.ReasoningDelta):
            sent, index, open_kind = _text_events(e, index, open_kind)
            for event in sent:
                yield event
        elif isinstance(e, ev.ToolCallStart):
            if open_kind is not None:
                yield close()
            index, open_kind = index + 1, "tool_use"
            yield _sse(
                "content_block_start",
                {
                    "index": index,
                    "content_block": _tool_use_block(e),
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
            yield _message_delta(e, usage)
            yield _sse("message_stop", {})
        elif isinstance(e, ev.Failure):
            # Anthropic's own mid-stream error event (an overloaded_error when the server
            # shuts down, which clients retry).
            yield f"event: error\ndata: {json.dumps(failed(e).anthropic_body())}\n\n"
            return


def _message_start(mid: str, model: str, usage: ev.Usage) -> str:
    message = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(usage),
    }
    return _sse("message_start", {"message": message})


def _message_delta(e: ev.Finish, usage: ev.Usage) -> str:
    delta = {"stop_reason": STOP_REASON[e.reason], "stop_sequence": e.stop_sequence}
    return _sse("message_delta", {"delta": delta, "usage": _usage(usage)})


def _text_events(
    e: ev.TextDelta | ev.ReasoningDelta, index: int, open_kind: str | None
) -> tuple[list[str], int, str]:
    """A text or thinking delta's events: where the open block is of another kind, it is
    closed (a thinking block given its empty signature first) and a block of this kind
    started; then the delta. With the index and kind of the block open after them."""
    kind = "text" if isinstance(e, ev.TextDelta) else "thinking"
    sent = []
    if open_kind != kind:
        if open_kind is not None:
            if open_kind == "thinking":
                signature = {"type": "signature_delta", "signature": ""}
                sent.append(_sse("content_block_delta", {"index": index, "delta": signature}))
            sent.append(_sse("content_block_stop", {"index": index}))
        index, open_kind = index + 1, kind
        block = (
            {"type": "text", "text": ""}
            if kind == "text"
            else {"type": "thinking", "thinking": "", "signature": ""}
        )
        sent.append(_sse("content_block_start", {"index": index, "content_block": block}))
    delta = (
        {"type": "text_delta", "text": e.text}
        if kind == "text"
        else {"type": "thinking_delta", "thinking": e.text}
    )
    sent.append(_sse("content_block_delta", {"index": index, "delta": delta}))
    return sent, index, open_kind


def count_tokens(core: GenerationCore, body: CountTokensRequest) -> dict[str, int]:
    core.check_model(body.model)
    prompt, _ = render(core, body)
    return {"input_tokens": len(prompt)}
