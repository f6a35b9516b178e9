"""gpt-oss's Harmony output format, parsed as it streams.

What the model writes after the generation prompt `<|start|>assistant` (special tokens, kept in
the decoded text for this parser: `keeps_special_tokens`)::

    <|channel|>analysis<|message|>reasoning ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>answer text ...<|return|>

Each message is a header (the role, `<|channel|>NAME`, a recipient `to=NAME` before or after
the channel, an optional `<|constrain|>FORMAT`) up to `<|message|>`, then its content up to
`<|end|>`, `<|call|>` or `<|return|>`. The output begins inside the first header (the prompt
wrote `<|start|>assistant`); a later message begins at `<|start|>`.

* `analysis` content is reasoning (ReasoningDelta); `final`, and `commentary` without a
  recipient (a preamble the user may see), answer text (TextDelta).
* A message with a recipient is a tool call: ToolCallStart (the name without `functions.`)
  once its header is complete, its content streamed as ToolCallArgsDelta pieces that
  concatenate to valid JSON (a value cut short, or not JSON, is closed or replaced so it is:
  a truncated object gets its closing, anything else `{}`), ToolCallEnd at the message's end.
* A header that never reaches `<|message|>` (the model wrote plain text) is released as text
  after HEADER_LIMIT characters, or at the end.
* A chunk that ends in what may be the start of a special token (`<|cha`) is held until the
  next chunk decides; `finish()` releases what is held. The events never depend on how the
  text was chunked.
"""

from __future__ import annotations

import re

from freetoken.server.events import (
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken.server.parsers.json_stream import (
    JSON_ERR,
    WHITESPACE,
    JsonStream,
    find_first,
    new_call_id,
    partial_tag_len,
)

START, MESSAGE, END, CALL, RETURN = "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
ENDINGS = (END, CALL, RETURN)
SPECIAL = (START, MESSAGE, END, CALL, RETURN, CHANNEL, CONSTRAIN)
HEADER_LIMIT = 512  # characters of header without <|message|>: the model is writing text
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")

HEADER, BODY, BETWEEN = "header", "body", "between"


class HarmonyParser:
    keeps_special_tokens = True  # the markup is special tokens: the detokeniser must keep them

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        # (`starts_in_reasoning` is the `<think>` templates' option: Harmony's prompt opens a
        # header, never a channel's content.)
        del starts_in_reasoning
        self._state = HEADER
        self._buf = ""
        self._kind = "text"  # the current message's: "reasoning", "text" or "call"
        self._events: list[Event] = []
        self._calls = 0
        self._json: JsonStream | None = None
        self._args_failed = False

    @property
    def saw_tool_call(self) -> bool:
        return self._calls > 0

    @staticmethod
    def forced_call(tool: str | None, in_reasoning: bool) -> str:
        """The opening of a tool call, continuing the generation prompt's header."""
        del in_reasoning
        if tool is None:
            return f"{CHANNEL}commentary to=functions."
        return f"{CHANNEL}commentary to=functions.{tool} {CONSTRAIN}json{MESSAGE}"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._state == BODY:
            self._end_message()
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _run(self, final: bool) -> None:
        while True:
            if self._state == HEADER:
                progressed = self._in_header(final)
            elif self._state == BODY:
                progressed = self._in_body(final)
            else:
                progressed = self._between(final)
            if not progressed:
                return

    # -- states ---------------------------------------------------------------------------

    def _in_header(self, final: bool) -> bool:
        i = self._buf.find(MESSAGE)
        if i == -1:
            if len(self._buf) > HEADER_LIMIT or (final and self._buf):
                self._emit_text(self._buf)  # not a header: the model wrote text
                self._buf, self._state = "", BODY
                self._kind = "text"
                return True
            return False
        header, self._buf = self._buf[:i], self._buf[i + len(MESSAGE) :]
        self._begin_message(header)
        self._state = BODY
        return True

    def _in_body(self, final: bool) -> bool:
        hit, tag = find_first(self._buf, (*ENDINGS, START))
        if hit == -1:
            cut = len(self._buf) if final else len(self._buf) - partial_tag_len(self._buf, SPECIAL)
            if cut:
                self._content(self._buf[:cut])
                self._buf = self._buf[cut:]
            return False
        self._content(self._buf[:hit])
        self._buf = self._buf[hit + len(tag) :]
        self._end_message()
        # <|start|> without an ending before it: the next message's header follows at once
        self._state = HEADER if tag == START else BETWEEN
        return True

    def _between(self, final: bool) -> bool:
        """After a message's end: only a <|start|> (and whitespace) may follow."""
        stripped = self._buf.lstrip(WHITESPACE)
        if stripped.startswith(START):
            self._buf = stripped[len(START) :]
            self._state = HEADER
            return True
        if not stripped or (START.startswith(stripped) and not final):
            return False  # (kept whole: whitespace before text is the text's)
        # text outside any message: answer text, as a model that skipped the markup meant it
        self._state, self._kind = BODY, "text"
        return True

    # -- messages -------------------------------------------------------------------------

    def _begin_message(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1).removeprefix("functions.")
            self._events.append(ToolCallStart(self._calls, new_call_id(), name))
            self._kind, self._json, self._args_failed = "call", JsonStream(), False
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "text"

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            self._events.append(ReasoningDelta(text))
        elif self._kind == "call":
            self._args(text)
        else:
            self._emit_text(text)

    def _args(self, text: str) -> None:
        js = self._json
        for c in text:
            if self._args_failed or js.done:
                break  # the value is whole (or broken): the rest is not arguments
            if js.push(c) == JSON_ERR:
                self._args_failed = True
        piece = js.take()
        if piece:
            self._events.append(ToolCallArgsDelta(self._calls, piece))

    def _end_message(self) -> None:
        if self._kind == "call":
            js = self._json
            js.end()
            closing = js.repair()
            if closing:
                self._events.append(ToolCallArgsDelta(self._calls, closing))
            self._events.append(ToolCallEnd(self._calls))
            self._calls += 1
            self._json = None
        self._kind = "text"

    def _emit_text(self, text: str) -> None:
        if text:
            self._events.append(TextDelta(text))
