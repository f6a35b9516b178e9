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
"""

from __future__ import annotations

import json
import re
import secrets

from freetoken.server.events import (
    Event,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

_WS = " \t\r\n"


def new_call_id() -> str:
    """A fresh tool call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    start = max(0, len(text) - max(map(len, tags)) + 1)
    i = text.find("<", start)
    while i != -1:
        tail = text[i:]
        if any(tag.startswith(tail) for tag in tags):
            return len(text) - i
        i = text.find("<", i + 1)
    return 0


def _find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """(position, tag) of the earliest of `tags` in `text`, or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag)
        if i != -1 and (best == -1 or i < best):
            best, found = i, tag
    return best, found


# ---------------------------------------------------------------------------------------------
# A JSON value, checked character by character.

_OK, _END, _ERR = 0, 1, 2  # push(): consumed / value already complete, char not taken / invalid

(_V, _OBJ, _KEY, _STR, _KSTR, _ESC, _UNI, _COLON, _AFTER, _NUM, _LIT, _DONE) = range(12)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


class _JsonStream:
    """Validates one JSON value as it arrives and hands out (`take`) the longest prefix so far
    that `repair` could still close into valid JSON. Text is held back only inside short
    tokens: an escape sequence, a number, a literal, and from a comma to the next value
    (an object key is held together with its colon)."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # closers of the open containers
        self._state = _V
        self._v_kind = "top"  # what a _V follows: "top", "colon", "first" (after "[") or "comma"
        self._ready: list[str] = []
        self._held: list[str] = []
        self._held_raw: list[str] = []
        self._holding = False
        self._hold_completion = ""
        self._num = ""
        self._lit = ""
        self._esc_in_key = False
        self._hex_left = 0

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def take(self) -> str:
        text = "".join(self._ready)
        self._ready.clear()
        return text

    def held_raw(self) -> str:
        return "".join(self._held_raw)

    def repair(self) -> str:
        """The untaken safe text plus the suffix that closes it into valid JSON."""
        closing = self._hold_completion if self._holding else self._completion()
        return self.take() + closing

    def end(self) -> bool:
        """No more input: complete a pending top-level number; whether the value is whole."""
        if self._state == _NUM and _NUMBER.fullmatch(self._num):
            self._value_done()
        return self._state == _DONE

    def _completion(self) -> str:
        closers = "".join(reversed(self._stack))
        if self._state == _DONE:
            return ""
        if self._state == _V:
            return {"top": "{}", "colon": "null" + closers}.get(self._v_kind, closers)
        if self._state == _STR:
            return '"' + closers
        return closers  # _OBJ, _AFTER: the only other states at a safe point

    def _hold(self) -> None:
        if not self._holding:
            self._hold_completion = self._completion()
            self._holding = True

    def _release(self) -> None:
        if self._holding:
            self._ready.extend(self._held)
            self._held.clear()
            self._held_raw.clear()
            self._holding = False

    def _out(self, text: str, raw: str | None = None) -> None:
        if self._holding:
            self._held.append(text)
            self._held_raw.append(text if raw is None else raw)
        else:
            self._ready.append(text)

    def _value_done(self) -> None:
        self._state = _AFTER if self._stack else _DONE
        self._release()

    def _string_char(self, c: str) -> None:
        if c < " ":
            self._out(_CONTROL.get(c) or f"\\u{ord(c):04x}", c)
        else:
            self._out(c)

    def push(self, c: str) -> int:
        st = self._state
        if st == _STR:
            if c == '"':
                self._out(c)
                self._value_done()
            elif c == "\\":
                self._hold()
                self._out(c)
                self._state, self._esc_in_key = _ESC, False
            else:
                self._string_char(c)
            return _OK
        if st == _V:
            if c in _WS:
                if self._v_kind != "top":
                    self._out(c)
            elif c == "{" or c == "[" or c == '"':
                self._out(c)
                if c == '"':
                    self._state = _STR
                else:
                    self._stack.append("}" if c == "{" else "]")
                    self._state, self._v_kind = (_OBJ, "") if c == "{" else (_V, "first")
                self._release()
            elif c in "-0123456789":
                self._hold()
                self._out(c)
                self._state, self._num = _NUM, c
            elif c in _LITERALS:
                self._hold()
                self._out(c)
                self._state, self._lit = _LIT, _LITERALS[c]
            elif c == "]" and self._v_kind == "first":
                self._stack.pop()
                self._out(c)
                self._value_done()
            else:
                return _ERR
            return _OK
        if st == _AFTER:
            if c in _WS:
                self._out(c)
            elif c == ",":
                self._hold()
                self._out(c)
                if self._stack[-1] == "}":
                    self._state = _KEY
                else:
                    self._state, self._v_kind = _V, "comma"
            elif c == self._stack[-1]:
                self._stack.pop()
                self._out(c)
                self._value_done()
            else:
                return _ERR
            return _OK
        if st in (_OBJ, _KEY):
            if c in _WS:
                self._out(c)
            elif c == '"':
                self._hold()
                self._out(c)
                self._state = _KSTR
            elif c == "}" and st == _OBJ:
                self._stack.pop()
                self._out(c)
                self._value_done()
            else:
                return _ERR
            return _OK
        if st == _KSTR:
            if c == '"':
                self._out(c)
                self._state = _COLON
            elif c == "\\":
                self._out(c)
                self._state, self._esc_in_key = _ESC, True
            else:
                self._string_char(c)
            return _OK
        if st == _COLON:
            if c in _WS:
                self._out(c)
            elif c == ":":
                self._out(c)
                self._state, self._v_kind = _V, "colon"
                self._release()
            else:
                return _ERR
            return _OK
        if st in (_ESC, _UNI):
            if st == _ESC and c == "u":
                self._out(c)
                self._state, self._hex_left = _UNI, 4
                return _OK
            if st == _ESC and c in '"\\/bfnrt':
                self._hex_left = 0
            elif st == _UNI and c in "0123456789abcdefABCDEF":
                self._hex_left -= 1
            else:
                return _ERR
            self._out(c)
            if self._hex_left == 0:
                self._state = _KSTR if self._esc_in_key else _STR
                if not self._esc_in_key:
                    self._release()
            return _OK
        if st == _NUM:
            if c in "0123456789+-.eE":
                self._num += c
                self._out(c)
                return _OK
            if not _NUMBER.fullmatch(self._num):
                return _ERR
            self._value_done()
            return self.push(c)
        if st == _LIT:
            if c != self._lit[0]:
                return _ERR
            self._out(c)
            self._lit = self._lit[1:]
            if not self._lit:
                self._value_done()
            return _OK
        return _END  # _DONE


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
    while pos < len(s) and s[pos] in _WS:
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
    if s[pos] not in '{["-0123456789tfn':
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

    def __init__(self, *, starts_in_reasoning: bool = False, tool_calls: bool = True) -> None:
        self._tags = (THINK_OPEN, CALL_OPEN) if tool_calls else (THINK_OPEN,)
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
        self._json = _JsonStream()
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
        self._lstrip = _WS if after_call else ""
        return True

    def _start_call(self, name: str) -> None:
        call_id = new_call_id()
        while call_id in self._ids:
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
        hit, tag = _find_first(buf, self._tags)
        if hit != -1:
            self._text(buf[:hit].rstrip(_WS))
            self._buf = buf[hit + len(tag) :]
            if tag == THINK_OPEN:
                self._state, self._lstrip = _THINK, "\n"
            else:
                self._state, self._body = _HEADER, ""
            return True
        if final:
            self._text(buf)
            self._buf = ""
            return False
        cut = len(buf) - _partial_tag_len(buf, self._tags)
        head = buf[:cut].rstrip(_WS)
        self._text(head)
        self._buf = buf[len(head) :]
        return False

    def _in_think(self, final: bool) -> bool:
        self._strip_leading()
        buf = self._buf
        hit = buf.find(THINK_CLOSE)
        if hit != -1 or final:
            text = buf[:hit] if hit != -1 else buf
            if text := text.rstrip("\n"):
                self._emit(ReasoningDelta(text))
            if hit == -1:
                self._buf = ""
                return False
            self._buf = buf[hit + len(THINK_CLOSE) :]
            self._state, self._lstrip = _TEXT, "\n"
            return True
        cut = len(buf) - _partial_tag_len(buf, (THINK_CLOSE,))
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
            self._text(CALL_OPEN + self._body)
            return self._to_text("")
        if match == _FAIL:
            self._state, self._slow_pos, self._slow_in_str, self._slow_esc = _SLOW, 0, False, False
            return True
        name, pos = match
        self._start_call(name)
        self._json = _JsonStream()
        self._in_string = self._body[pos] == '"'
        self._esc, self._high = None, None
        self._buf = self._body[pos + 1 if self._in_string else pos :]
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
                if body.startswith(CALL_CLOSE, i):
                    end, rest, closer = i, body[i + len(CALL_CLOSE) :], CALL_CLOSE
                    break
                if body.startswith(CALL_OPEN, i):
                    end, rest = i, body[i:]
                    break
                if _partial_tag_len(body[i:], (CALL_OPEN, CALL_CLOSE)) == len(body) - i:
                    break  # maybe a tag: wait for more
            i += 1
        self._slow_pos = i
        if end == -1 and not final:
            return False
        text = body[:end] if end != -1 else body
        call = _parse_whole_call(text)
        if call is not None:
            self._start_call(call[0])
            self._args(call[1])
            self._end_call()
        else:
            self._text(CALL_OPEN + text + closer)
        return self._to_text(rest, after_call=call is not None)

    def _in_args(self, final: bool) -> bool:
        buf, js = self._buf, self._json
        for i, c in enumerate(buf):
            r = self._decode(c) if self._in_string else js.push(c)
            if r == _OK:
                continue
            if r == _END:
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
        if (not self._in_string or self._flush_high() == _OK) and js.end():
            self._args(js.take())
            self._state, self._body = _TAIL, ""
        else:
            self._abandon_args(js.held_raw())
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
                return _END if self._json.end() else _ERR
            if c == "\\":
                self._esc = ""
                return _OK
            return self._decoded(c)
        if esc == "":
            if c == "u":
                self._esc = "u"
                return _OK
            self._esc = None
            return self._decoded(_SIMPLE_ESCAPES[c]) if c in _SIMPLE_ESCAPES else _ERR
        if c not in "0123456789abcdefABCDEF":
            return _ERR
        if len(esc) < 4:
            self._esc = esc + c
            return _OK
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
        return self._inner(ch) if r == _OK else r

    def _flush_high(self) -> int:
        """A high surrogate not followed by a low one becomes U+FFFD."""
        if self._high is None:
            return _OK
        self._high = None
        return self._inner("\ufffd")

    def _inner(self, ch: str) -> int:
        """A decoded character of string arguments; only whitespace may follow the value."""
        if self._json.done:
            return _OK if ch in _WS else _ERR
        r = self._json.push(ch)
        if r == _END:  # a top-level number ended at this character
            return _OK if ch in _WS else _ERR
        return r

    def _in_tail(self, final: bool) -> bool:
        """After the arguments: expect `}` and `</tool_call>`."""
        self._body += self._buf
        self._buf = ""
        hit, tag = _find_first(self._body, (CALL_CLOSE, CALL_OPEN))
        if hit == -1 and not final:
            return False
        tail = self._body[:hit] if hit != -1 else self._body
        rest = (
            "" if hit == -1 else self._body[hit + len(CALL_CLOSE) if tag == CALL_CLOSE else hit :]
        )
        self._end_call()
        if tail.strip(_WS) not in ("", "}"):
            self._text(tail)
        return self._to_text(rest)

    def _in_junk(self, final: bool) -> bool:
        self._body += self._buf
        self._buf = ""
        hit = self._body.find(CALL_CLOSE)
        if hit == -1 and not final:
            return False
        end = hit + len(CALL_CLOSE) if hit != -1 else len(self._body)
        self._text(self._body[:end])
        return self._to_text(self._body[end:], after_call=False)
