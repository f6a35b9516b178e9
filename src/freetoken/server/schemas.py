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

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class Nested(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


JSONObject = dict[str, Any]


class Part(Nested):
    """A content part or block: its `type` says which of the other fields it has."""

    type: str
    text: Any = None


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


SCHEMAS: dict[str, type[Body]] = {
    "chat": ChatRequest,
    "completions": CompletionRequest,
    "responses": ResponsesRequest,
    "messages": MessagesRequest,
    "count_tokens": CountTokensRequest,
}
