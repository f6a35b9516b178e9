"""OpenAI adapter: /v1/chat/completions, /v1/completions, /v1/models.

Each endpoint is two steps: `prepare_*` (validate what the schema cannot, render the chat,
tokenize: CPU work, run off the event loop by app.py) and `answer_*` (submit, then the whole
answer or its stream).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from freetoken.engine.sampling import SamplingParams
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
from freetoken.server.schemas import ChatMessage, ChatRequest, CompletionRequest, Sampling
from freetoken.server.validate import stop_list, template_tool_call, text_of, tool_arguments

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls"}


@dataclass
class Prepared:
    request: GenerationRequest
    model: str
    stream: bool
    include_usage: bool = False
    echo: str = ""  # completions: the prompt text, given back before the completion


def refuse_unsupported(body: Sampling) -> None:
    """Options that would change the answer and that freetoken cannot honour: a 400 naming
    each, rather than an answer that silently lacks it."""
    if body.logprobs or body.top_logprobs:
        raise bad_request("logprobs are not supported", param="logprobs")
    if (body.n or 1) != 1:
        raise bad_request("only n=1 is supported", param="n")
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        raise bad_request(
            f"response_format {fmt.type!r} is not supported (no constrained decoding): only 'text'",
            param="response_format",
        )
    for name in ("audio", "prediction", "functions", "function_call", "web_search_options"):
        if getattr(body, name, None) is not None:
            raise bad_request(f"'{name}' is not supported", param=name)
    if getattr(body, "suffix", None):
        raise bad_request("'suffix' (insertion) is not supported", param="suffix")
    if (getattr(body, "best_of", None) or 1) != 1:
        raise bad_request("only best_of=1 is supported", param="best_of")


def sampling(
    core: GenerationCore, body: Sampling, prompt_ids: list[int], max_tokens: int | None
) -> SamplingParams:
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", param="max_tokens")
    return core.sampling_params(
        max_new_tokens=core.output_budget(prompt_ids, max_tokens),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=logit_bias(core, body.logit_bias),
        seed=body.seed,
        stop=stop_list(body.stop),
        speculative=body.speculative,
    )


def logit_bias(core: GenerationCore, bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as strings) with each id checked against the
    vocabulary."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= core.vocab_size:
            raise bad_request(
                f"logit_bias: {shown(key, 20)!r} is not a token id of this model "
                f"(0 to {core.vocab_size - 1})",
                param="logit_bias",
            )
        out[int(key)] = value
    return out


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's message dicts."""
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}]: unknown role '{m.role[:40]}'")
        content = text_of(m.content, ("messages", i, "content"))
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            if m.reasoning_content:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [
                    template_tool_call(c.id, c.function.name, tool_arguments(c.function.arguments))
                    for c in m.tool_calls
                ]
        if role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
        out.append(msg)
    return out


def chat_tools(body: ChatRequest) -> list[dict[str, Any]]:
    if body.tool_choice == "none" or not body.tools:
        return []
    return [t.model_dump(exclude_none=True) for t in body.tools]


def chat_tool_choice(choice) -> str | None:
    """A chat `tool_choice` (validated by the schema): None when the model decides (or no
    tool may be called), else REQUIRED or a tool name."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return REQUIRED
    return choice.function.name


def prepare_chat(core: GenerationCore, body: ChatRequest) -> Prepared:
    model = core.check_model(body.model)
    refuse_unsupported(body)
    tools = chat_tools(body)
    template_kwargs = {
        **core.reasoning_options(effort=body.reasoning_effort),
        **core.template_kwargs(body.chat_template_kwargs),  # e.g. enable_thinking
    }
    prompt = core.render(chat_messages(body.messages), tools=tools, **template_kwargs)
    forced = ForcedOutput()
    if (tool := chat_tool_choice(body.tool_choice)) is not None:
        prompt, forced = core.force_tool_call(prompt, tools, tool)
    max_tokens = body.max_completion_tokens
    max_tokens = body.max_tokens if max_tokens is None else max_tokens
    params = sampling(core, body, prompt, max_tokens)
    request = GenerationRequest(prompt, params, tools=tools, forced=forced)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(request, model, bool(body.stream), include_usage)


def answer_chat(core: GenerationCore, prepared: Prepared):
    """Submit: the stream, or a coroutine of the whole answer."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    events = core.start(prepared.request)
    if prepared.stream:
        return _chat_stream(events, cid, created, prepared.model, prepared.include_usage)
    return _chat_whole(events, cid, created, prepared.model)


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
        elif isinstance(e, ev.Failure):
            raise failed(e)
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


def stream_error(e: ev.Failure) -> str:
    """A stream that cannot finish ends with an error chunk (which the OpenAI SDKs raise as
    an APIError), then [DONE]."""
    return sse(failed(e).openai_body())


# Seconds without an event (a long prefill) before a keep-alive: an SSE comment, which the
# OpenAI SDKs skip, so clients and proxies with idle timeouts do not give up.
KEEPALIVE_INTERVAL = 10.0
KEEPALIVE = ": keep-alive\n\n"


async def _chat_stream(events, cid, created, model, include_usage) -> AsyncIterator[str]:
    usage = None

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
        elif isinstance(e, ev.Failure):
            yield stream_error(e)
            break
    if include_usage and usage is not None:
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


def prepare_completion(core: GenerationCore, body: CompletionRequest) -> Prepared:
    model = core.check_model(body.model)
    refuse_unsupported(body)
    if not body.prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    prompt_ids = core.encode(body.prompt)
    params = sampling(core, body, prompt_ids, body.max_tokens)
    request = GenerationRequest(prompt_ids, params, parse_output=False)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    echo = body.prompt if body.echo else ""
    return Prepared(request, model, bool(body.stream), include_usage, echo)


def answer_completion(core: GenerationCore, prepared: Prepared):
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    model = prepared.model

    def payload(text: str, finish: str | None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        }

    events = core.start(prepared.request)

    async def chunks():
        if prepared.echo:
            yield sse(payload(prepared.echo, None))
        usage = None
        async for e in with_keepalive(events, KEEPALIVE_INTERVAL):
            if e is None:
                yield KEEPALIVE
            elif isinstance(e, ev.TextDelta):
                yield sse(payload(e.text, None))
            elif isinstance(e, ev.Usage):
                usage = e
            elif isinstance(e, ev.Finish):
                yield sse(payload("", FINISH[e.reason]))
            elif isinstance(e, ev.Failure):
                yield stream_error(e)
                break
        if prepared.include_usage and usage is not None:
            yield sse({**payload("", None), "choices": [], "usage": usage_json(usage)})
        yield sse("[DONE]")

    async def whole():
        text, usage, finish = [prepared.echo], None, None
        async for e in events:
            if isinstance(e, ev.TextDelta):
                text.append(e.text)
            elif isinstance(e, ev.Usage):
                usage = e
            elif isinstance(e, ev.Finish):
                finish = e
            elif isinstance(e, ev.Failure):
                raise failed(e)
        return {**payload("".join(text), FINISH[finish.reason]), "usage": usage_json(usage)}

    return chunks() if prepared.stream else whole()


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
