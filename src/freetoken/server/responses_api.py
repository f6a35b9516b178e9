"""OpenAI Responses adapter: POST /v1/responses (stream and not), function tools, reasoning.

Tools: function tools as they are; `namespace` tools (groups of function tools, as Codex
sends its sub-agent tools) flattened into function tools, each call answered with its
namespace; `custom` tools (free-form text input) as a function of one string `input`,
answered as custom tool calls; hosted tools (web search, file search, code interpreter, ...)
skipped, since this server runs none of them.
"""

from __future__ import annotations

import json
import logging
import time
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
from freetoken.server.openai_api import KEEPALIVE_INTERVAL
from freetoken.server.schemas import (
    CustomToolCallItem,
    FunctionCallItem,
    FunctionTool,
    MessageItem,
    NamespaceTool,
    ReasoningItem,
    ResponsesRequest,
    ToolOutputItem,
    parse_as,
)
from freetoken.server.validate import template_tool, template_tool_call, text_of, tool_arguments


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ClientTool:
    """A tool as the client declared it, behind the function name the model sees."""

    name: str
    namespace: str | None = None
    custom: bool = False  # free-form input: the model fills one string argument, `input`


_CUSTOM_INPUT = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "the tool's whole input"}},
    "required": ["input"],
}
log = logging.getLogger(__name__)


def template_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]], dict[str, ClientTool]]:
    """The request's tools as the chat template takes them (function tools), and what each
    function name stands for."""
    if body.tool_choice == "none":
        return [], {}
    out: list[dict[str, Any]] = []
    names: dict[str, ClientTool] = {}

    def add(t: FunctionTool, namespace: str | None) -> None:
        # A clash between namespaces keeps both, the later one qualified by its namespace.
        exposed = t.name if t.name not in names else f"{namespace}.{t.name}"
        names[exposed] = ClientTool(t.name, namespace, custom=t.type == "custom")
        parameters = _CUSTOM_INPUT if t.type == "custom" else t.parameters or {"type": "object"}
        out.append(template_tool(exposed, t.description or "", parameters))

    for i, t in enumerate(body.tools or []):
        kind = t.get("type")
        if kind in ("function", "custom"):
            add(parse_as(FunctionTool, t, ("tools", i)), None)
        elif kind == "namespace":
            group = parse_as(NamespaceTool, t, ("tools", i))
            for j, inner in enumerate(group.tools):
                tool = parse_as(FunctionTool, inner, ("tools", i, "tools", j))
                add(tool, group.name)
        elif isinstance(kind, str):
            log.debug("skipping hosted tool %r: this server runs no hosted tools", kind)
        else:
            raise bad_request(f"tools[{i}] needs a 'type'", param=f"tools[{i}].type")
    return out, names


# Input items by type; others (hosted tools' calls this server never ran) are skipped.
ITEMS = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "custom_tool_call": CustomToolCallItem,
    "function_call_output": ToolOutputItem,
    "custom_tool_call_output": ToolOutputItem,
    "reasoning": ReasoningItem,
}


def template_messages(body: ResponsesRequest, tools: dict[str, ClientTool]) -> list[dict[str, Any]]:
    """`instructions` + `input` (a string or a list of items) -> the template's messages."""
    out: list[dict[str, Any]] = []
    exposed = {(t.namespace, t.name): name for name, t in tools.items()}
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    items = body.input
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input must not be empty", param="input")
    reasoning = None  # text of a reasoning item, for the assistant turn that follows it

    def assistant() -> dict[str, Any]:
        """The assistant turn the next output item belongs to (a new one after any other)."""
        nonlocal reasoning
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if reasoning is not None:
            out[-1]["reasoning_content"] = reasoning
            reasoning = None
        return out[-1]

    for i, raw in enumerate(items):
        kind = raw.get("type", "message")
        if not isinstance(kind, str):  # (a list or an object: unhashable, and no item type)
            raise bad_request(
                f"input[{i}].type must be a string, not {type(kind).__name__}",
                param=f"input[{i}].type",
            )
        if kind not in ITEMS:
            # Items of hosted tools this server never ran (web search calls, ...): nothing the
            # model wrote, so nothing to render.
            log.debug("skipping input item of type %r", kind)
            continue
        item = parse_as(ITEMS[kind], raw, ("input", i))
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"input[{i}]: unknown role '{shown(item.role, 40)}'")
            text = text_of(item.content, ("input", i, "content"))
            if role == "assistant":
                assistant()["content"] += text
            else:
                out.append({"role": role, "content": text})
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            name = exposed.get((item.namespace, item.name), item.name)
            if isinstance(item, CustomToolCallItem):
                arguments: Any = {"input": item.input}
            else:
                arguments = tool_arguments(item.arguments)
            call = template_tool_call(item.call_id, name, arguments)
            assistant().setdefault("tool_calls", []).append(call)
        elif isinstance(item, ToolOutputItem):
            out.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _output_text(item.output)}
            )
        else:
            # Given back as reasoning of the turn it led to, so the prompt renders as the model
            # wrote it (and the prefix cache finds it).
            parts = item.content or item.summary or []
            reasoning = "".join(p.text or "" for p in parts) or None
    return out


def _output_text(output: Any) -> str:
    """A tool output: a string, or content parts (their text), or any JSON value."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) for p in output):
        return "".join(p.get("text", "") for p in output if isinstance(p.get("text"), str))
    return json.dumps(output)


class _Builder:
    """Folds core events into Responses output items, and says which stream events each makes."""

    def __init__(self, tools: dict[str, ClientTool]):
        self.tools = tools
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
        elif item["type"] == "custom_tool_call":
            item["input"] = _custom_input(item.pop("_arguments"))
            out.append(
                (
                    "response.custom_tool_call_input.done",
                    {"item_id": item["id"], "output_index": index, "input": item["input"]},
                )
            )
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
            out += self._start(self._call_item(e))
        elif isinstance(e, ev.ToolCallArgsDelta) and self.open["type"] == "custom_tool_call":
            self.open["_arguments"] += e.text  # its input is known when the JSON is whole
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

    def _call_item(self, e: ev.ToolCallStart) -> dict[str, Any]:
        tool = self.tools.get(e.name, ClientTool(e.name))
        if tool.custom:
            return {
                "type": "custom_tool_call",
                "id": _id("ctc"),
                "call_id": e.id,
                "name": tool.name,
                "input": "",
                "_arguments": "",
                "status": "in_progress",
            }
        item = {
            "type": "function_call",
            "id": _id("fc"),
            "call_id": e.id,
            "name": tool.name,
            "arguments": "",
            "status": "in_progress",
        }
        if tool.namespace is not None:
            item["namespace"] = tool.namespace
        return item


def _custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote ({"input": ...})."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments if not isinstance(value, str) else value


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
    return json.loads(json.dumps({k: v for k, v in item.items() if not k.startswith("_")}))


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


def reasoning(core: GenerationCore, body: ResponsesRequest) -> dict[str, Any]:
    """`reasoning.effort` as chat template arguments (GenerationCore.reasoning_options)."""
    return core.reasoning_options(effort=body.reasoning.effort if body.reasoning else None)


def tool_choice(choice: Any) -> str | None:
    """The Responses `tool_choice` (the chat one, with a named tool at its top level)."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return REQUIRED
    named = isinstance(choice, dict) and choice.get("type") == "function"
    if named and isinstance(choice.get("name"), str):
        return choice["name"]
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def refuse_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None or body.conversation is not None:
        raise bad_request(
            "previous_response_id is not supported: this server keeps no responses; send the "
            "whole conversation as input",
            param="previous_response_id",
        )
    if body.background:
        raise bad_request("background responses are not supported", param="background")
    if body.prompt is not None:
        raise bad_request("stored prompts are not supported", param="prompt")
    if body.top_logprobs:
        raise bad_request("logprobs are not supported", param="top_logprobs")
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        raise bad_request(
            f"text.format {fmt.type!r} is not supported (no constrained decoding): only 'text'",
            param="text.format",
        )


@dataclass
class Prepared:
    request: GenerationRequest
    model: str
    stream: bool
    body: dict[str, Any]  # the request as sent, for the fields a response echoes
    names: dict[str, ClientTool]


def prepare_responses(core: GenerationCore, body: ResponsesRequest) -> Prepared:
    model = core.check_model(body.model)
    refuse_unsupported(body)
    tools, names = template_tools(body)
    kwargs = {**reasoning(core, body), **core.template_kwargs(body.chat_template_kwargs)}
    prompt = core.render(template_messages(body, names), tools=tools, **kwargs)
    forced = ForcedOutput()
    if (tool := tool_choice(body.tool_choice)) is not None:
        prompt, forced = core.force_tool_call(prompt, tools, tool)
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request("max_output_tokens must be at least 1", param="max_output_tokens")
    params = core.sampling_params(
        max_new_tokens=core.output_budget(prompt, body.max_output_tokens),
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        speculative=body.speculative,
    )
    request = GenerationRequest(prompt, params, tools=tools, forced=forced)
    return Prepared(request, model, bool(body.stream), body.model_dump(exclude_unset=True), names)


def answer_responses(core: GenerationCore, prepared: Prepared):
    """Submit: the stream, or a coroutine of the whole response."""
    rid, created = _id("resp"), int(time.time())
    events = core.start(prepared.request)
    if prepared.stream:
        return _stream(events, rid, created, prepared.model, prepared.body, prepared.names)
    return _whole(events, rid, created, prepared.model, prepared.body, prepared.names)


async def _whole(events, rid, created, model, body, names) -> dict[str, Any]:
    builder, usage, finish = _Builder(names), None, None
    async for e in events:
        if isinstance(e, ev.Failure):
            raise failed(e)
        builder.feed(e)
        usage = e if isinstance(e, ev.Usage) else usage
        finish = e if isinstance(e, ev.Finish) else finish
    builder.finish()
    status = "incomplete" if finish.reason == "length" else "completed"
    return _response(rid, created, model, body, builder.output, status, usage, finish)


async def _stream(events, rid, created, model, body, names) -> AsyncIterator[str]:
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
    builder, usage, finish = _Builder(names), None, None
    async for e in with_keepalive(events, KEEPALIVE_INTERVAL):
        if e is None:
            # The hosted API's own keep-alive event during long work: clients skip it, and it
            # resets their idle timers (an SSE comment would not reach Codex's).
            yield sse("keepalive", {})
            continue
        if isinstance(e, ev.Failure):
            for kind, data in builder.finish():
                yield sse(kind, data)
            response = _response(rid, created, model, body, builder.output, "failed", None, None)
            response["error"] = {"code": e.kind, "message": e.message}
            yield sse("response.failed", {"response": response})
            return
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
