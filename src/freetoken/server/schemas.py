"""Request bodies of every endpoint, as pydantic models.

Types are checked strictly (no "5" for 5, no true for 1), as the hosted APIs check them. A
body's top level forbids unknown fields, as the hosted APIs do (a misspelt parameter is an
error, not silently dropped); nested objects ignore fields they do not know, since clients
echo back what the APIs sent them (ids, statuses, annotations). Fields the hosted API has and
freetoken does not act on are declared here, so accepting them is a decision; options that
would change the answer and are not supported are refused by the adapters with a 400 that
names them (`docs/api.md`). `app.py` turns a ValidationError into each API's error shape.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from freetoken.server.errors import ApiError, bad_request, shown


class Nested(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


JSONObject = dict[str, Any]


class Part(Nested):
    """A content part or block: its `type` says which of the other fields it has."""

    type: str
    text: str | None = None


# -- OpenAI chat completions ---------------------------------------------------------------


class FunctionCall(Nested):
    name: str
    arguments: str | JSONObject | None = None


class ToolCall(Nested):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(Nested):
    role: str
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(Nested):
    name: str
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class ChatTool(Nested):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Nested):
    name: str


class NamedToolChoice(Nested):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Nested):
    include_usage: bool = False


class ResponseFormat(Nested):
    type: str


class Sampling(Body):
    """The sampling fields the OpenAI endpoints share (and freetoken's extensions)."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    speculative: bool | None = None  # extension: false turns drafting off for this request
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # Accepted and ignored: they change nothing a local model answers.
    metadata: JSONObject | None = None
    user: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class ChatRequest(Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: JSONObject | None = None  # extension
    verbosity: str | None = None
    modalities: list[str] | None = None
    # Refused when given (adapters say why): audio output, predicted outputs, the legacy
    # function-calling fields, hosted web search.
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None


class CompletionRequest(Sampling):
    prompt: str
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# -- OpenAI Responses ------------------------------------------------------------------------


class Reasoning(Nested):
    effort: str | None = None
    summary: str | None = None


class TextOptions(Nested):
    format: ResponseFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(Body):
    model: str
    input: str | list[JSONObject]
    instructions: str | None = None
    tools: list[JSONObject] | None = None
    tool_choice: str | JSONObject | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    speculative: bool | None = None  # extension
    chat_template_kwargs: JSONObject | None = None  # extension
    stream: bool | None = None
    stream_options: JSONObject | None = None
    reasoning: Reasoning | None = None
    text: TextOptions | None = None
    top_logprobs: int | None = None
    # Accepted and ignored.
    metadata: JSONObject | None = None
    client_metadata: JSONObject | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    truncation: str | None = None
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    # Refused when given: server-side state and background runs.
    previous_response_id: str | None = None
    background: bool | None = None
    prompt: Any = None
    conversation: Any = None


# -- Anthropic messages ----------------------------------------------------------------------


class AnthropicMessage(Nested):
    role: str
    content: str | list[JSONObject]


class AnthropicTool(Nested):
    name: str
    type: str | None = None
    description: str | None = None
    input_schema: JSONObject | None = None


class AnthropicToolChoice(Nested):
    type: Literal["auto", "any", "none", "tool"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Nested):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputConfig(Nested):
    effort: str | None = None
    format: JSONObject | None = None


class MessagesBase(Body):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[JSONObject] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored.
    mcp_servers: list[JSONObject] | None = None
    context_management: JSONObject | None = None


class MessagesRequest(MessagesBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    speculative: bool | None = None  # extension
    chat_template_kwargs: JSONObject | None = None  # extension
    # Accepted and ignored.
    metadata: JSONObject | None = None
    service_tier: str | None = None
    container: Any = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: JSONObject | None = None


class CountTokensRequest(MessagesBase):
    pass


# -- free-form content: blocks, items and tools whose fields depend on their `type` -------
#
# The request schemas keep these as JSON objects, since clients send types freetoken skips
# (hosted tools' items) or answers with a note (images); adapters parse each one they use
# with `parse_as`, which reports a bad one at its place in the request.


class TextBlock(Nested):
    type: Literal["text"]
    text: str


class ToolResultBlock(Nested):
    type: Literal["tool_result"]
    tool_use_id: str = ""
    content: str | list[JSONObject] | None = None
    is_error: bool | None = None


class ToolUseBlock(Nested):
    type: Literal["tool_use"]
    id: str | None = None
    name: str
    input: JSONObject | None = None


class ThinkingBlock(Nested):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class MessageItem(Nested):
    type: Literal["message"] = "message"
    role: str
    content: str | list[Part] | None = None


class FunctionCallItem(Nested):
    type: Literal["function_call"]
    name: str
    call_id: str | None = None
    arguments: str | JSONObject | None = None
    namespace: str | None = None


class CustomToolCallItem(Nested):
    type: Literal["custom_tool_call"]
    name: str
    call_id: str | None = None
    input: str = ""
    namespace: str | None = None


class ToolOutputItem(Nested):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = ""
    output: Any = None


class ReasoningItem(Nested):
    type: Literal["reasoning"]
    content: list[Part] | None = None
    summary: list[Part] | None = None


class FunctionTool(Nested):
    type: Literal["function", "custom"] = "function"
    name: str
    description: str | None = None
    parameters: JSONObject | None = None


class NamespaceTool(Nested):
    type: Literal["namespace"]
    name: str
    tools: list[JSONObject] = []


Model = TypeVar("Model", bound=BaseModel)


def parse_as(model: type[Model], value: Any, where: tuple, anthropic: bool = False) -> Model:
    """`value` (free-form JSON of the request, at `where`) as `model`, or the 400 that says
    what is wrong with it there."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise schema_error(e, anthropic, where) from None


# Type names pydantic puts in an error's location for the member of a union it tried.
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> tuple:
    """An error's location without the union members pydantic names in it
    (`('tool_choice', "literal['auto',...]")` is about `tool_choice`)."""
    return tuple(
        p
        for p in loc
        if not (isinstance(p, str) and (p in _UNION_MEMBERS or "[" in p or not p.islower()))
    )


def location(loc: tuple, anthropic: bool) -> str:
    """A field's place as each API writes it: `messages.0.content`, `messages[0].content`."""
    if anthropic:
        return ".".join(str(p) for p in loc)
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def schema_error(err: ValidationError, anthropic: bool, where: tuple = ()) -> ApiError:
    """A schema's verdict in the words of the called API: Anthropic's are pydantic's own
    (`messages.0.content: Input should be a valid string`), OpenAI names unknown arguments
    together and quotes the field. A value no member of a union takes gets the deepest
    complaint (a bad block inside a list), or each member's where none went deeper. `where`:
    the location of the value parsed, for parts of a request parsed on their own."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return bad_request(
            f"the body is not valid JSON: {shown(first['msg'].removeprefix('Invalid JSON: '), 200)}"
        )
    if first["type"] == "model_type" and not first["loc"] and not where:
        return bad_request("the body must be a JSON object")
    extra = [e["loc"][0] for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    if extra and not anthropic and not where:
        names = ", ".join(shown(str(n), 60) for n in extra)
        return bad_request(f"Unrecognized request argument supplied: {names}")
    top = _field_path(first["loc"])[:1]
    related = [(e, _field_path(e["loc"])) for e in errors if _field_path(e["loc"])[:1] == top]
    loc = max((path for _, path in related), key=len)
    message = ", or ".join(dict.fromkeys(e["msg"] for e, path in related if path == loc))
    place = location(where + loc, anthropic)
    if anthropic:
        return bad_request(f"{place}: {message}")
    missing = all(e["type"] == "missing" for e, path in related if path == loc)
    text = f"missing required field '{place}'" if missing else f"'{place}': {message}"
    return bad_request(text, param=place)


class CacheResizeRequest(Body):
    """POST /v1/ctl/cache: the expert cache's new size, slots (300) or bytes ("8GiB"), and/or
    the KV pool's, tokens (65536) or bytes ("4GiB")."""

    experts: str | int | None = None
    kv: str | int | None = None


SCHEMAS: dict[str, type[Body]] = {
    "chat": ChatRequest,
    "completions": CompletionRequest,
    "responses": ResponsesRequest,
    "messages": MessagesRequest,
    "count_tokens": CountTokensRequest,
    "ctl": CacheResizeRequest,
}
