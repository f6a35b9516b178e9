"""Kimi-K2's output format (K2-Instruct, K2-Thinking, K2.5 / K2.6), parsed as it streams.

What the model writes (one line here; the markup is special tokens in Kimi's tokenizer, kept in
the decoded text for this parser: `keeps_special_tokens`)::

    <think>reasoning ...</think>answer text ...<|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}
    <|tool_call_end|><|tool_call_begin|>functions.list_files:1<|tool_call_argument_begin|>{}
    <|tool_call_end|><|tool_calls_section_end|>

* Reasoning and answer text follow the Qwen parser's rules (parsers/qwen.py). A call (or its
  section) ends reasoning that `</think>` has not: Kimi models leave `</think>` out before
  their calls at times (Moonshot's own API streamed the section markers as reasoning:
  MoonshotAI/Kimi-K2 issue 89), and the markers, being special tokens, are never reasoning.
* The section markers only group the calls: they are dropped. (The singular
  `<|tool_call_section_begin|>` / `_end|>`, which some outputs have, too; vLLM reads both.)
* `<|tool_call_begin|>ID<|tool_call_argument_begin|>` opens a call. ID is `functions.NAME:IDX`
  as the template writes it (`NAME:IDX` and a bare NAME are read too). Once the arguments'
  first character is there, ToolCallStart is emitted and the JSON arguments stream as the Qwen
  parser streams them (pieces that concatenate to valid JSON, closed where they break or are
  cut short); `<|tool_call_end|>` ends the call. A call with no arguments (the end at once, or
  no argument marker) has `{}`.
* The call's id is the model's ID: the templates write that id before the call's result
  (`## Return of functions.NAME:IDX`; Moonshot's first template takes it from the request's
  `tool_call_id`), so a client that sends the id back gives the model its own. OpenAI's chat
  and Responses ids take any string; the Anthropic adapter maps it into that API's
  `[a-zA-Z0-9_-]` (anthropic_api.py). An id the reply already used gets a fresh one.
* A header that is not an id (text, other markup) is given back as answer text, tags included,
  up to its `<|tool_call_end|>`.
"""

from __future__ import annotations

import re

from freetoken.server.parsers.json_stream import WHITESPACE, find_first, partial_tag_len
from freetoken.server.parsers.qwen import ARGS_START, THINK_CLOSE, QwenParser

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
SINGULAR_SECTION = ("<|tool_call_section_begin|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARGS_BEGIN, CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_ID_TEXT = re.compile(r"[\w.:/-]*")  # what an id may hold (the header so far, to fail early)
# the name in an id: one colon at most, before the index ("functions.f:0functions.f:0", two
# headers run together, is not an id)
_ID = re.compile(r"(?:functions\.)?([\w./-]+)(?::\d+)?")


class KimiParser(QwenParser):
    """Streaming parser for Kimi-K2 output (see the module docstring for the rules)."""

    keeps_special_tokens = True  # the markup is special tokens: the detokeniser must keep them
    call_open, call_close = CALL_BEGIN, CALL_END
    grouping_tags = (SECTION_BEGIN, SECTION_END, *SINGULAR_SECTION)
    reasoning_ends = (SECTION_BEGIN, SINGULAR_SECTION[0], CALL_BEGIN)

    @staticmethod
    def forced_call(tool: str | None, in_reasoning: bool) -> str:
        """A call's opening as Kimi writes it; with a name, up to its index, which is the
        model's to write (the templates count the calls of the whole conversation)."""
        head = THINK_CLOSE if in_reasoning else ""
        opening = f"{head}{SECTION_BEGIN}{CALL_BEGIN}functions."
        return opening if tool is None else f"{opening}{tool}:"

    def _in_header(self, final: bool) -> bool:
        """The call's id, up to the argument marker; then its arguments begin."""
        self._body += self._buf
        self._buf = ""
        body = self._body
        ends = (ARGS_BEGIN, CALL_END)
        hit, tag = find_first(body, ends)
        head = body[:hit] if hit != -1 else body[: len(body) - partial_tag_len(body, ends)]
        call_id = head.strip(WHITESPACE)
        if not _ID_TEXT.fullmatch(call_id):
            return self._not_a_call()
        if hit == -1:
            return self._not_a_call() if final else False
        name = _ID.fullmatch(call_id)
        if name is None:
            return self._not_a_call()
        rest = body[hit + len(tag) :]
        if tag == CALL_END:  # no argument marker: a call without arguments
            return self._call_without_arguments(name[1], call_id, rest)
        args = rest.lstrip(WHITESPACE)
        if args.startswith(CALL_END):
            return self._call_without_arguments(name[1], call_id, args[len(CALL_END) :])
        if not args or CALL_END.startswith(args):  # (what comes next decides)
            return self._call_without_arguments(name[1], call_id, "") if final else False
        if args[0] not in ARGS_START:
            return self._not_a_call()
        return self._begin_args(name[1], args, call_id)

    def _call_without_arguments(self, name: str, call_id: str, rest: str) -> bool:
        self._start_call(name, call_id)
        self._args("{}")
        self._end_call()
        return self._to_text(rest)
