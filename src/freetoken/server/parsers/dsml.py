"""DeepSeek's DSML output format (DeepSeek-V4, and V3.2 with its own wrapper), parsed as it
streams.

What the model writes after the generation prompt (which ends in `<think>` with thinking on,
`</think>` with it off)::

    reasoning ...</think>answer text ...

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls><｜end▁of▁sentence｜>

(DeepSeek-V3.2 wraps its calls in `<｜DSML｜function_calls>` instead; either wrapper is read.)

Reasoning and answer text follow the Qwen parser's rules (the same `<think>` tags and
whitespace handling: parsers/qwen.py). A block's opening tag in answer text starts the calls;
whitespace between its elements is skipped:

* `<｜DSML｜invoke name="NAME">` starts a call (ToolCallStart, once the tag is whole); each
  parameter adds `"P": value` to its arguments as it arrives, which are a JSON object
  (`{}` without parameters) closed at `</｜DSML｜invoke>` (ToolCallEnd). A string="true"
  value is the text as written, a JSON string streamed as it comes; another value is held
  to its end and is its JSON value where it reads as strict JSON, else the text as a string.
* The block's closing tag (either wrapper's) ends it; answer text may follow.
* A call left open ends at the next `<｜DSML｜invoke` or the block's end. Anything else where
  an element should be ends the call there (its arguments closed) and the block: it and what
  follows are answer text. A block whose first element is not a call (a stray wrapper tag,
  the model writing about the format) is given back as answer text, its tag included.
* The end of output closes what is open: a parameter's value as far as it came (a closing
  tag cut short there is not part of it), the call. An opened block without a call yet is
  given back as text.
* `<｜end▁of▁sentence｜>`, which ends every assistant turn, is dropped from answer text. It is
  a special token, and so may DSML's markup be: the parser reads special tokens
  (`keeps_special_tokens`), so what it is given is the text the model wrote, whatever the
  tokenizer marks.

The events never depend on how the text was chunked.
"""

from __future__ import annotations

import json
import re

from freetoken.server.parsers.json_stream import WHITESPACE, json_or_text, partial_tag_len
from freetoken.server.parsers.qwen import THINK_CLOSE, THINK_OPEN, QwenParser

DSML = "｜DSML｜"
BLOCK_OPENS = (f"<{DSML}tool_calls>", f"<{DSML}function_calls>")  # V4's, V3.2's
BLOCK_CLOSES = (f"</{DSML}tool_calls>", f"</{DSML}function_calls>")
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML}parameter", f"</{DSML}parameter>"
END_OF_SENTENCE = "<｜end▁of▁sentence｜>"
_INVOKE_TAG = re.compile(re.escape(INVOKE_OPEN) + r'\s+name="([^"]+)"\s*>')
_PARAM_TAG = re.compile(re.escape(PARAM_OPEN) + r'\s+name="([^"]+)"(?:\s+string="([^"]*)")?\s*>')

_NEED = "need"  # (an element's opening tag may still arrive whole)
_BETWEEN_CALLS, _IN_CALL, _IN_VALUE = range(3)  # where in a block the parser is


def _opening_tag(text: str, tag: str, pattern: re.Pattern) -> re.Match | str | None:
    """The element opening tag `pattern` (starting with `tag`) at the start of `text`: its
    match; _NEED while `text` may still become one; None when it cannot."""
    if not text.startswith(tag):
        return _NEED if tag.startswith(text) else None
    end = text.find(">")
    return _NEED if end == -1 else pattern.fullmatch(text, 0, end + 1)


def _string_piece(text: str) -> str:
    """Raw text as the inside of a JSON string (escaping is per character, so pieces escaped
    apart join to the whole escaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class DsmlParser(QwenParser):
    """Streaming parser for DSML output (see the module docstring for the rules)."""

    # the markup may be special tokens (the end of sentence is; DSML's tags may be): the
    # detokeniser keeps them in the text, and the parser reads them
    keeps_special_tokens = True
    wrapper = "tool_calls"  # the block a forced call opens: the one the model was taught

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning=starts_in_reasoning)
        self._tags = (THINK_OPEN, *BLOCK_OPENS, END_OF_SENTENCE)
        self._block_tag = ""  # the tag that opened the current block (given back if broken)
        self._where = _BETWEEN_CALLS
        self._calls_in_block = 0
        self._params = 0  # parameters of the current call so far
        self._string = False  # the current value is a string (streamed), else held whole
        self._scan = 0  # where the held value's closing tag may start

    @classmethod
    def forced_call(cls, tool: str | None, in_reasoning: bool) -> str:
        """A call's opening as the chat template writes it; with a name, up to its first
        parameter (without, up to the name: the call stays the model's to name)."""
        head = THINK_CLOSE if in_reasoning else ""
        name = "" if tool is None else f'{tool}">\n'
        return f'{head}\n\n<{DSML}{cls.wrapper}>\n{INVOKE_OPEN} name="{name}'

    def _opened(self, tag: str) -> None:
        if tag == END_OF_SENTENCE:
            return  # dropped: answer text goes on
        super()._opened(tag)  # <think>: reasoning; a block's opening: `_in_header`
        if tag in BLOCK_OPENS:
            self._block_tag, self._where, self._calls_in_block = tag, _BETWEEN_CALLS, 0

    def _in_header(self, final: bool) -> bool:
        """Inside a block (the Qwen parser's state after a call's opening tag)."""
        step = (self._between_calls, self._in_call, self._in_value)[self._where]
        return step(final)

    def _between_calls(self, final: bool) -> bool:
        """Expecting a call's opening tag or, after a call, the block's end."""
        rest = self._buf.lstrip(WHITESPACE)
        if self._calls_in_block:
            for closer in BLOCK_CLOSES:
                if rest.startswith(closer):
                    return self._to_text(rest[len(closer) :])
        invoke = _opening_tag(rest, INVOKE_OPEN, _INVOKE_TAG)
        if isinstance(invoke, re.Match):
            self._start_call(invoke[1])
            self._calls_in_block += 1
            self._buf, self._where, self._params = rest[invoke.end() :], _IN_CALL, 0
            return True
        may_close = self._calls_in_block and any(c.startswith(rest) for c in BLOCK_CLOSES)
        if not final and (invoke == _NEED or may_close):
            return False
        if not self._calls_in_block:  # not a block of calls: all of it is text
            self._text(self._block_tag)
            return self._to_text(self._buf, after_call=False)
        return self._to_text(rest)

    def _in_call(self, final: bool) -> bool:
        """Expecting a parameter's opening tag or the call's end."""
        rest = self._buf.lstrip(WHITESPACE)
        if rest.startswith(INVOKE_CLOSE):
            self._close_call()
            self._buf = rest[len(INVOKE_CLOSE) :]
            return True
        if rest.startswith(INVOKE_OPEN) or rest.startswith(BLOCK_CLOSES):
            self._close_call()  # left open: the next call or the block's end closes it
            self._buf = rest
            return True
        param = _opening_tag(rest, PARAM_OPEN, _PARAM_TAG)
        if isinstance(param, re.Match):
            self._string = param[2] == "true"
            key = json.dumps(param[1], ensure_ascii=False) + (': "' if self._string else ": ")
            self._args(("{" if self._params == 0 else ", ") + key)
            self._params += 1
            self._buf, self._where, self._scan = rest[param.end() :], _IN_VALUE, 0
            return True
        tags = (INVOKE_CLOSE, INVOKE_OPEN, *BLOCK_CLOSES)
        if not final and (param == _NEED or any(t.startswith(rest) for t in tags)):
            return False
        self._close_call()  # not markup: the call and the block end here
        return self._to_text(rest)

    def _in_value(self, final: bool) -> bool:
        """A parameter's value, up to its closing tag."""
        buf = self._buf
        end = buf.find(PARAM_CLOSE, self._scan)
        if end != -1:
            value, self._buf = buf[:end], buf[end + len(PARAM_CLOSE) :]
        else:
            safe = len(buf) - partial_tag_len(buf, (PARAM_CLOSE,))
            if not final:
                if self._string:  # streamed as it comes
                    self._args(_string_piece(buf[:safe]))
                    self._buf = buf[safe:]
                else:
                    self._scan = safe
                return False
            value, self._buf = buf[:safe], ""  # (a closing tag cut short is not the value's)
        if self._string:
            self._args(_string_piece(value) + '"')
        else:
            self._args(json.dumps(json_or_text(value), ensure_ascii=False))
        self._where = _IN_CALL
        return True

    def _close_call(self) -> None:
        """The current call's arguments closed (`{}` without parameters), and the call ended."""
        self._args("}" if self._params else "{}")
        self._end_call()
        self._where = _BETWEEN_CALLS


class DsmlV32Parser(DsmlParser):
    """DeepSeek-V3.2's DSML: the same, its forced calls in `function_calls`."""

    wrapper = "function_calls"
