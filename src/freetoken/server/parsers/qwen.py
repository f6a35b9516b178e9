"""The Qwen3 / Hermes output format, parsed as it streams.

What the model writes::

    <think>
    reasoning ...
    </think>

    answer text ...
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...
    </tool_call>

Rules (each decided from the text alone, so the events never depend on how it was chunked):

* `<think>...</think>` is reasoning (ReasoningDelta), everything else answer text (TextDelta).
  Newlines directly after `<think>` and directly before `</think>` are dropped, and so are
  the newlines directly after `</think>` (the blank line before the answer). With
  `starts_in_reasoning=True` (the generation prompt already opened `<think>`) the output
  begins inside reasoning. Inside reasoning no other markup is recognised. A `</think>`
  outside reasoning is ordinary text.
* `<tool_call>` opens a call. Once `{"name": "...", "arguments": ` and the first character of
  the arguments have arrived, ToolCallStart is emitted; the arguments' JSON text then streams
  as ToolCallArgsDelta pieces that concatenate to exactly the model's text (only raw control
  characters inside strings are escaped, so it stays valid JSON). When the model writes the
  arguments as a JSON string, the string's decoded content is streamed instead. The call
  ends (ToolCallEnd) at `</tool_call>`, at the next `<tool_call>`, or at the end of output.
  `"parameters"` is accepted for `"arguments"`.
* A call body that does not start like that (keys in another order, no arguments, not
  JSON) is held until `</tool_call>` (outside JSON strings) and then parsed as a whole: a
  JSON object with a name becomes a call (arguments re-serialised), anything else is
  emitted verbatim as TextDelta, tags included.
* If the arguments turn invalid after ToolCallStart was sent, the arguments text is closed
  with the shortest suffix that makes it valid JSON (e.g. `"}` or `null}`), the call ends,
  and the rest of the call body up to `</tool_call>` becomes TextDelta. A truncated output
  (end of generation inside the arguments) is closed the same way.
* Whitespace directly before `<think>` / `<tool_call>` and directly after `</tool_call>` is
  dropped, so whitespace between calls never becomes text.
* A chunk that ends with what may be the start of a tag (`<to`, `</th`) or with whitespace
  is held until the next chunk decides; `finish()` releases what is held.

Formats with the same reasoning rules and other call markup subclass QwenParser (glm.py,
kimi.py, minimax.py, gemma4.py): they name their own tags around reasoning (`think_open`,
`think_close`) and around a call (`call_open`, `call_close`), the
markup that only groups calls (`grouping_tags`: dropped where it stands), the tags that end
reasoning when the model leaves `</think>` out (`reasoning_ends`), and read a call's header
their own way (`_in_header`).
"""

from __future__ import annotations

import json

from freetoken.server.events import (
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from freetoken.server.parsers.json_stream import (
    JSON_END,
    JSON_ERR,
    JSON_OK,
    WHITESPACE,
    JsonStream,
    find_first,
    new_call_id,
    partial_tag_len,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
ARGS_START = '{["-0123456789tfn'  # the characters a JSON value can begin with


# ---------------------------------------------------------------------------------------------
# The start of a call body: {"name": "...", "arguments": <first char of the value>

_NEED, _FAIL = "need", "fail"


def _expect(s: str, pos: int, options: tuple[str, ...]) -> int | str:
    pos = _skip_ws(s, pos)
    for opt in options:
        if s.startswith(opt, pos):
            return pos + len(opt)
    rest = s[pos:]
    return _NEED if any(opt.startswith(rest) for opt in options) else _FAIL


def _skip_ws(s: str, pos: int) -> int:
    while pos < len(s) and s[pos] in WHITESPACE:
        pos += 1
    return pos


def _match_header(s: str) -> tuple[str, int] | str:
    """(name, index of the arguments' first character), or _NEED (could still match) or
    _FAIL (cannot)."""
    pos: int | str = 0
    for options in (("{",), ('"name"',), (":",)):
        pos = _expect(s, pos, options)
        if isinstance(pos, str):
            return pos
    pos = _skip_ws(s, pos)
    if pos == len(s):
        return _NEED
    if s[pos] != '"':
        return _FAIL
    end = pos + 1
    while end < len(s) and s[end] != '"':
        end += 2 if s[end] == "\\" else 1
    if end >= len(s):
        return _NEED
    try:
        name = json.loads(s[pos : end + 1])
    except ValueError:
        return _FAIL
    if not name.strip():
        return _FAIL
    pos = end + 1
    for options in ((",",), ('"arguments"', '"parameters"'), (":",)):
        pos = _expect(s, pos, options)
        if isinstance(pos, str):
            return pos
    pos = _skip_ws(s, pos)
    if pos == len(s):
        return _NEED
    if s[pos] not in ARGS_START:
        return _FAIL
    return name, pos


def _parse_whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a complete call body in any key order, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        if not args.strip():
            return name, "{}"
        try:
            json.loads(args)
        except ValueError:
            return None
        return name, args
    return name, json.dumps(args, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------

_TEXT, _THINK, _HEADER, _SLOW, _ARGS, _TAIL, _JUNK = range(7)
_SIMPLE_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}


class QwenParser:
    """Streaming parser for Qwen3 / Hermes output (see the module docstring for the rules)."""

    # What a subclass's format changes (see the module docstring)
    think_open, think_close = THINK_OPEN, THINK_CLOSE
    call_open, call_close = CALL_OPEN, CALL_CLOSE
    grouping_tags: tuple[str, ...] = ()
    reasoning_ends: tuple[str, ...] = ()

    def __init__(self, *, starts_in_reasoning: bool = False, tool_calls: bool = True) -> None:
        self._tags = (
            (self.think_open, self.call_open, *self.grouping_tags)
            if tool_calls
            else (self.think_open,)
        )
        self._state = _THINK if starts_in_reasoning else _TEXT
        self._lstrip = "\n" if starts_in_reasoning else ""  # chars to drop at the next text
        self._buf = ""  # text not yet handled
        self._events: list[Event] = []
        self._n_calls = 0
        self._ids: set[str] = set()
        # the current call
        self._body = ""  # _HEADER / _SLOW / _TAIL / _JUNK: text of the call collected so far
        self._slow_pos = 0
        self._slow_in_str = False
        self._slow_esc = False
        self._json = JsonStream()
        self._in_string = False  # the arguments are a JSON string being decoded
        self._esc: str | None = None  # inside a string escape: the characters after "\"
        self._high: int | None = None  # a decoded high surrogate waiting for its low half

    @property
    def saw_tool_call(self) -> bool:
        return self._n_calls > 0

    @staticmethod
    def forced_call(tool: str | None, in_reasoning: bool) -> str:
        """A call's opening as Qwen / Hermes models write it; with a name, up to where its
        arguments begin (see `forced_tool_call`)."""
        head = f"{THINK_CLOSE}\n\n" if in_reasoning else ""
        if tool is None:
            return f"{head}{CALL_OPEN}\n"
        return f'{head}{CALL_OPEN}\n{{"name": {json.dumps(tool)}, "arguments": '

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        return self._take()

    # -- plumbing -----------------------------------------------------------------------------

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _emit(self, event: Event) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, (TextDelta, ReasoningDelta)) and type(last) is type(event):
            self._events[-1] = type(event)(last.text + event.text)
        elif (
            isinstance(event, ToolCallArgsDelta)
            and isinstance(last, ToolCallArgsDelta)
            and last.index == event.index
        ):
            self._events[-1] = ToolCallArgsDelta(event.index, last.text + event.text)
        else:
            self._events.append(event)

    def _text(self, text: str) -> None:
        if text:
            self._emit(TextDelta(text))

    def _args(self, text: str) -> None:
        if text:
            self._emit(ToolCallArgsDelta(self._n_calls - 1, text))

    def _run(self, final: bool) -> None:
        handlers = {
            _TEXT: self._in_text,
            _THINK: self._in_think,
            _HEADER: self._in_header,
            _SLOW: self._in_slow,
            _ARGS: self._in_args,
            _TAIL: self._in_tail,
            _JUNK: self._in_junk,
        }
        while handlers[self._state](final):
            pass

    def _strip_leading(self) -> None:
        if self._lstrip:
            self._buf = self._buf.lstrip(self._lstrip)
            if self._buf:
                self._lstrip = ""

    def _to_text(self, rest: str, after_call: bool = True) -> bool:
        """Back to answer text; whitespace directly after a call is dropped (not after a
        call body that was given back as text)."""
        self._state, self._buf, self._body = _TEXT, rest, ""
        self._lstrip = WHITESPACE if after_call else ""
        return True

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        """ToolCallStart, with the id the model wrote for the call (Kimi's) where it is not one
        this reply used already, else a fresh one."""
        while call_id is None or call_id in self._ids:
            call_id = new_call_id()
        self._ids.add(call_id)
        self._emit(ToolCallStart(self._n_calls, call_id, name))
        self._n_calls += 1

    def _end_call(self) -> None:
        self._emit(ToolCallEnd(self._n_calls - 1))

    # -- states -------------------------------------------------------------------------------

    def _in_text(self, final: bool) -> bool:
        self._strip_leading()
        buf = self._buf
        hit, tag = find_first(buf, self._tags)
        if hit != -1:
            self._text(buf[:hit].rstrip(WHITESPACE))
            self._buf = buf[hit + len(tag) :]
            self._opened(tag)
            return True
        if final:
            self._text(buf)
            self._buf = ""
            return False
        cut = len(buf) - partial_tag_len(buf, self._tags)
        head = buf[:cut].rstrip(WHITESPACE)
        self._text(head)
        self._buf = buf[len(head) :]
        return False

    def _opened(self, tag: str) -> None:
        """One of `self._tags` was found in answer text (and taken from it): what it opens.
        Formats with other tags (parsers/dsml.py) decide theirs here."""
        if tag == self.think_open:
            self._state, self._lstrip = _THINK, "\n"
        elif tag in self.grouping_tags:
            self._lstrip = WHITESPACE  # (only markup: the text goes on after it)
        else:
            self._state, self._body = _HEADER, ""

    def _in_think(self, final: bool) -> bool:
        self._strip_leading()
        buf = self._buf
        close = self.think_close
        ends = (close, *self.reasoning_ends)
        hit, tag = find_first(buf, ends)
        if hit != -1 or final:
            text = buf[:hit] if hit != -1 else buf
            if text := text.rstrip("\n"):
                self._emit(ReasoningDelta(text))
            if hit == -1:
                self._buf = ""
                return False
            # (a tag other than </think> stays, for the answer text to read: a call's opening)
            self._buf = buf[hit + len(close) :] if tag == close else buf[hit:]
            self._state, self._lstrip = _TEXT, "\n"
            return True
        cut = len(buf) - partial_tag_len(buf, ends)
        head = buf[:cut].rstrip("\n")
        if head:
            self._emit(ReasoningDelta(head))
        self._buf = buf[len(head) :]
        return False

    def _in_header(self, final: bool) -> bool:
        self._body += self._buf
        self._buf = ""
        match = _match_header(self._body)
        if match == _NEED:
            if not final:
                return False
            self._text(self.call_open + self._body)
            return self._to_text("")
        if match == _FAIL:
            self._state, self._slow_pos, self._slow_in_str, self._slow_esc = _SLOW, 0, False, False
            return True
        name, pos = match
        return self._begin_args(name, self._body[pos:])

    def _begin_args(self, name: str, args: str, call_id: str | None = None) -> bool:
        """ToolCallStart, then the arguments stream from `args` (the call's text from their
        first character, one of ARGS_START)."""
        self._start_call(name, call_id)
        self._json = JsonStream()
        self._in_string = args[0] == '"'
        self._esc, self._high = None, None
        self._buf = args[1:] if self._in_string else args
        self._body = ""
        self._state = _ARGS
        return True

    def _in_slow(self, final: bool) -> bool:
        """A call body that did not start the usual way: find its end (outside JSON strings)
        and parse it whole."""
        self._body += self._buf
        self._buf = ""
        body, i = self._body, self._slow_pos
        end, rest, closer = -1, "", ""
        while i < len(body):
            c = body[i]
            if self._slow_esc:
                self._slow_esc = False
            elif self._slow_in_str:
                if c == "\\":
                    self._slow_esc = True
                elif c == '"':
                    self._slow_in_str = False
            elif c == '"':
                self._slow_in_str = True
            elif c == "<":
                if body.startswith(self.call_close, i):
                    end, rest, closer = i, body[i + len(self.call_close) :], self.call_close
                    break
                if body.startswith(self.call_open, i):
                    end, rest = i, body[i:]
                    break
                if partial_tag_len(body[i:], (self.call_open, self.call_close)) == len(body) - i:
                    break  # maybe a tag: wait for more
            i += 1
        self._slow_pos = i
        if end == -1 and not final:
            return False
        text = body[:end] if end != -1 else body
        call = _parse_whole_call(text)
        return self._whole_call(None if call is None else [call], text, closer, rest)

    def _whole_call(
        self, calls: list[tuple[str, str]] | None, body: str, closer: str, rest: str
    ) -> bool:
        """A call body parsed whole: `calls` (name, arguments JSON) as their events, or, where
        it is None, the body given back as text with its tags; then `rest` as text."""
        if calls is not None:
            for name, arguments in calls:
                self._start_call(name)
                self._args(arguments)
                self._end_call()
        else:
            self._text(self.call_open + body + closer)
        return self._to_text(rest, after_call=calls is not None)

    def _in_args(self, final: bool) -> bool:
        buf, js = self._buf, self._json
        for i, c in enumerate(buf):
            r = self._decode(c) if self._in_string else js.push(c)
            if r == JSON_OK:
                continue
            if r == JSON_END:
                self._args(js.take())
                self._state, self._body = _TAIL, ""
                self._buf = buf[i + 1 if self._in_string else i :]
            else:
                self._abandon_args(js.held_raw() + buf[i:])
            return True
        self._buf = ""
        self._args(js.take())
        if not final:
            return False
        if (not self._in_string or self._flush_high() == JSON_OK) and js.end():
            self._args(js.take())
            self._state, self._body = _TAIL, ""
        else:
            self._abandon_args(js.held_raw())
        return True

    def _not_a_call(self) -> bool:
        """The call's text so far (`_body`) is not a call: it goes back as answer text, its
        opening tag included, up to its closing tag."""
        self._state, self._body = _JUNK, self.call_open + self._body
        return True

    def _abandon_args(self, junk: str) -> None:
        """The arguments went wrong: close them as valid JSON, end the call, and keep the rest
        of the call body as text."""
        self._args(self._json.repair())
        self._end_call()
        self._state, self._body, self._buf = _JUNK, junk, ""

    def _decode(self, c: str) -> int:
        """One raw character of arguments written as a JSON string -> the decoded content."""
        esc = self._esc
        if esc is None:
            if c == '"':
                self._flush_high()
                return JSON_END if self._json.end() else JSON_ERR
            if c == "\\":
                self._esc = ""
                return JSON_OK
            return self._decoded(c)
        if esc == "":
            if c == "u":
                self._esc = "u"
                return JSON_OK
            self._esc = None
            return self._decoded(_SIMPLE_ESCAPES[c]) if c in _SIMPLE_ESCAPES else JSON_ERR
        if c not in "0123456789abcdefABCDEF":
            return JSON_ERR
        if len(esc) < 4:
            self._esc = esc + c
            return JSON_OK
        self._esc = None
        code = int(esc[1:] + c, 16)
        if 0xD800 <= code < 0xDC00:
            r = self._flush_high()
            self._high = code
            return r
        if 0xDC00 <= code < 0xE000:
            if self._high is None:
                return self._inner("\ufffd")
            pair = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
            return self._inner(chr(pair))
        return self._decoded(chr(code))

    def _decoded(self, ch: str) -> int:
        r = self._flush_high()
        return self._inner(ch) if r == JSON_OK else r

    def _flush_high(self) -> int:
        """A high surrogate not followed by a low one becomes U+FFFD."""
        if self._high is None:
            return JSON_OK
        self._high = None
        return self._inner("\ufffd")

    def _inner(self, ch: str) -> int:
        """A decoded character of string arguments; only whitespace may follow the value."""
        if self._json.done:
            return JSON_OK if ch in WHITESPACE else JSON_ERR
        r = self._json.push(ch)
        if r == JSON_END:  # a top-level number ended at this character
            return JSON_OK if ch in WHITESPACE else JSON_ERR
        return r

    def _in_tail(self, final: bool) -> bool:
        """After the arguments: expect `}` and `</tool_call>` (a next call's opening, or
        markup that groups calls, ends the call too and stays, for the text to read)."""
        self._body += self._buf
        self._buf = ""
        hit, tag = find_first(self._body, (self.call_close, self.call_open, *self.grouping_tags))
        if hit == -1 and not final:
            return False
        tail = self._body[:hit] if hit != -1 else self._body
        skip = len(tag) if tag == self.call_close else 0
        rest = "" if hit == -1 else self._body[hit + skip :]
        self._end_call()
        if tail.strip(WHITESPACE) not in ("", "}"):
            self._text(tail)
        return self._to_text(rest)

    def _in_junk(self, final: bool) -> bool:
        self._body += self._buf
        self._buf = ""
        hit = self._body.find(self.call_close)
        if hit == -1 and not final:
            return False
        end = hit + len(self.call_close) if hit != -1 else len(self._body)
        self._text(self._body[:end])
        return self._to_text(self._body[end:], after_call=False)
