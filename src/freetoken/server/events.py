"""The protocol-neutral events a generation produces, in order.

Adapters turn these into OpenAI chunks, Anthropic SSE events or Responses items; parsers turn
model text into them (reasoning, tool calls). Nothing here knows any wire format.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... in the order the model emits calls
    id: str  # unique call id, e.g. "call_3f2a..."
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    text: str  # a piece of the arguments' JSON text; the pieces concatenate to valid JSON


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" | "length" | "tool_calls" | "stop_sequence" | "cancelled"
    stop_sequence: str | None = None


@dataclass(frozen=True)
class Failure:
    """The generation ended without finishing: the engine failed, or the server is shutting
    down. The last event: a stream ends with its API's error event, a whole answer is the
    error."""

    status: int  # the HTTP status it stands for: 400, 500, 503
    kind: str  # an OpenAI error type, e.g. "server_error"
    message: str


Event = (
    TextDelta
    | ReasoningDelta
    | ToolCallStart
    | ToolCallArgsDelta
    | ToolCallEnd
    | Usage
    | Finish
    | Failure
)
