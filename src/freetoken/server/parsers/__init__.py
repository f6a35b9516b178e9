"""Streaming output parsers: the model's generated text, chunk by chunk, becomes events.

A parser sees the decoded text exactly as the model produced it, in arbitrary pieces (one
token's text at a time; a piece may end in the middle of any markup), and turns it into
protocol-neutral events (`freetoken.server.events`): answer text, reasoning text and tool
calls. Which parser a model needs follows from its chat template (`parser_for_template`).

Parsers are registered by name and imported only when made (`make_parser`).
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

from freetoken.server.events import Event

__all__ = [
    "PARSERS",
    "OutputParser",
    "forced_tool_call",
    "keeps_special_tokens",
    "make_parser",
    "parser_for_template",
    "prompt_opens_reasoning",
]

# name -> "module:Class"; the class is called with make_parser's keyword options.
PARSERS: dict[str, str] = {
    # Qwen2.5 / Qwen3 / Hermes `<tool_call>` JSON, and the same JSON untagged (Qwen2.5-Coder)
    "qwen3": "freetoken.server.parsers.untagged:UntaggedQwenParser",
    "hermes": "freetoken.server.parsers.untagged:UntaggedQwenParser",
    "harmony": "freetoken.server.parsers.harmony:HarmonyParser",  # gpt-oss
    "glm45": "freetoken.server.parsers.glm:GlmParser",  # GLM-4.5 / 4.6 / 4.7, GLM-5.x
    # DeepSeek's `<｜DSML｜...>` calls and `<think>`: V4 (`tool_calls`), V3.2 (`function_calls`)
    "dsml": "freetoken.server.parsers.dsml:DsmlParser",
    "dsml_v32": "freetoken.server.parsers.dsml:DsmlV32Parser",
    "kimi_k2": "freetoken.server.parsers.kimi:KimiParser",  # Kimi-K2 / K2.5 / K2.6
    "minimax_m2": "freetoken.server.parsers.minimax:MiniMaxParser",  # MiniMax-M2 / M2.1
    "gemma4": "freetoken.server.parsers.gemma4:Gemma4Parser",  # Gemma-4
    "plain": "freetoken.server.parsers.plain:PlainParser",  # all text is answer text
}


@runtime_checkable
class OutputParser(Protocol):
    """Turns one generation's text into events. One instance per generation."""

    def feed(self, text: str) -> list[Event]:
        """Newly decoded model text (any length, split anywhere) -> events (may be empty)."""
        ...

    def finish(self) -> list[Event]:
        """End of generation: release held-back text and close whatever is still open."""
        ...

    @property
    def saw_tool_call(self) -> bool:
        """Whether a ToolCallStart has been emitted (the finish reason is then "tool_calls")."""
        ...


def _parser_class(name: str) -> type:
    target = PARSERS.get(name)
    if target is None:
        known = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown output parser {name!r}; known parsers: {known}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_parser(name: str, tools: list | None = None, **options: object) -> OutputParser:
    """A new parser of the registered `name`, made with `options` (e.g. starts_in_reasoning),
    and the request's `tools` where the parser reads them (`takes_tools`)."""
    cls = _parser_class(name)
    if getattr(cls, "takes_tools", False):
        options["tools"] = tools
    return cls(**options)


def keeps_special_tokens(name: str) -> bool:
    """Whether parser `name` reads markup the tokenizer holds as special tokens (Harmony's;
    DeepSeek's end of turn), which the detokeniser must then keep in the text."""
    return bool(getattr(_parser_class(name), "keeps_special_tokens", False))


def forced_tool_call(name: str, tool: str | None, in_reasoning: bool) -> str | None:
    """The text that opens a tool call (of `tool`, or of any tool when None) in the output
    format of parser `name`, closing a thinking block first when the prompt opened one; None
    when the format has no tool calls."""
    opening = getattr(_parser_class(name), "forced_call", None)
    return None if opening is None else opening(tool, in_reasoning)


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser name that fits a chat template's text, or None when nothing is recognised.

    Templates that write tool calls as `<tool_call>` JSON (Qwen2.5/Qwen3, Hermes) or that
    mention `<think>` blocks get the Qwen parser (its tool call detection is harmless for a
    model that never writes `<tool_call>`); Harmony's channels (gpt-oss), GLM-4.5's
    `<arg_key>` / `<arg_value>` calls, DeepSeek's DSML calls (V4's `tool_calls` block,
    V3.2's `function_calls`), Kimi's, MiniMax's and Gemma-4's their own.
    """
    if not chat_template:
        return None
    if "<|channel|>" in chat_template:
        return "harmony"
    if "｜DSML｜" in chat_template:
        return "dsml_v32" if "function_calls>" in chat_template else "dsml"
    if "<arg_key>" in chat_template:
        return "glm45"
    if "<|tool_calls_section_begin|>" in chat_template:  # (before <think>: K2-Thinking has it)
        return "kimi_k2"
    if "<minimax:tool_call>" in chat_template:  # (before <think>: M2 has it)
        return "minimax_m2"
    if "<|tool_call>call:" in chat_template:
        return "gemma4"
    if "<tool_call>" in chat_template or "<think>" in chat_template:
        return "qwen3"
    return None


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an opened `<think>` block, i.e. the generation
    prompt already wrote `<think>` and the output starts in reasoning (pass the result as
    the Qwen parser's `starts_in_reasoning`)."""
    return prompt.rstrip().endswith("<think>")
