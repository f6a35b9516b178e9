"""What the output parsers share: tool call ids, scanning for tags in streamed text, and a
JSON value checked character by character as it streams (so arguments are passed on as they
arrive and a truncated value can still be closed into valid JSON)."""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    """A fresh tool call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def json_or_text(text: str) -> Any:
    """A value written as text that should be JSON (GLM's non-string arguments, DSML's
    string="false" parameters): its JSON value where it reads as strict JSON (no NaN or
    infinities, which strict clients refuse), else the text itself."""
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)
    except ValueError:
        return text
    return value


def partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    start = max(0, len(text) - max(map(len, tags)) + 1)
    i = text.find("<", start)
    while i != -1:
        tail = text[i:]
        if any(tag.startswith(tail) for tag in tags):
            return len(text) - i
        i = text.find("<", i + 1)
    return 0


def find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """(position, tag) of the earliest of `tags` in `text`, or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag)
        if i != -1 and (best == -1 or i < best):
            best, found = i, tag
    return best, found


# ---------------------------------------------------------------------------------------------
# A JSON value, checked character by character.

JSON_OK, JSON_END, JSON_ERR = (
    0,
    1,
    2,
)  # push(): consumed / value already complete, char not taken / invalid

(_V, _OBJ, _KEY, _STR, _KSTR, _ESC, _UNI, _COLON, _AFTER, _NUM, _LIT, _DONE) = range(12)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


class JsonStream:
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

    def _close(self, c: str) -> None:
        """`c` closes the innermost container, the value it was."""
        self._stack.pop()
        self._out(c)
        self._value_done()

    def _string_char(self, c: str) -> None:
        if c < " ":
            self._out(_CONTROL.get(c) or f"\\u{ord(c):04x}", c)
        else:
            self._out(c)

    def push(self, c: str) -> int:
        """Take one character: JSON_OK (taken), JSON_ERR (invalid here) or JSON_END (the value
        was complete already: `c` not taken). Strings' characters, the most, are taken here;
        every other state has its method."""
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
            return JSON_OK
        if st == _V:
            return self._push_value(c)
        if st == _AFTER:
            return self._push_after(c)
        if st in (_OBJ, _KEY):
            return self._push_key_start(c, st)
        if st == _KSTR:
            return self._push_key(c)
        if st == _COLON:
            return self._push_colon(c)
        if st in (_ESC, _UNI):
            return self._push_escape(c, st)
        if st == _NUM:
            return self._push_number(c)
        if st == _LIT:
            return self._push_literal(c)
        return JSON_END  # _DONE

    def _push_value(self, c: str) -> int:
        """Where a value begins (`_v_kind` says after what)."""
        if c in WHITESPACE:
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
            self._close(c)
        else:
            return JSON_ERR
        return JSON_OK

    def _push_after(self, c: str) -> int:
        """After a value inside a container: a comma or the container's closer."""
        if c in WHITESPACE:
            self._out(c)
        elif c == ",":
            self._hold()
            self._out(c)
            if self._stack[-1] == "}":
                self._state = _KEY
            else:
                self._state, self._v_kind = _V, "comma"
        elif c == self._stack[-1]:
            self._close(c)
        else:
            return JSON_ERR
        return JSON_OK

    def _push_key_start(self, c: str, st: int) -> int:
        """Where a key begins: after "{" (_OBJ, which may close at once) or after a comma."""
        if c in WHITESPACE:
            self._out(c)
        elif c == '"':
            self._hold()
            self._out(c)
            self._state = _KSTR
        elif c == "}" and st == _OBJ:
            self._close(c)
        else:
            return JSON_ERR
        return JSON_OK

    def _push_key(self, c: str) -> int:
        """Inside a key's string."""
        if c == '"':
            self._out(c)
            self._state = _COLON
        elif c == "\\":
            self._out(c)
            self._state, self._esc_in_key = _ESC, True
        else:
            self._string_char(c)
        return JSON_OK

    def _push_colon(self, c: str) -> int:
        if c in WHITESPACE:
            self._out(c)
        elif c == ":":
            self._out(c)
            self._state, self._v_kind = _V, "colon"
            self._release()
        else:
            return JSON_ERR
        return JSON_OK

    def _push_escape(self, c: str, st: int) -> int:
        """After a backslash (_ESC), or inside its \\u's four hex digits (_UNI)."""
        if st == _ESC and c == "u":
            self._out(c)
            self._state, self._hex_left = _UNI, 4
            return JSON_OK
        if st == _ESC and c in '"\\/bfnrt':
            self._hex_left = 0
        elif st == _UNI and c in "0123456789abcdefABCDEF":
            self._hex_left -= 1
        else:
            return JSON_ERR
        self._out(c)
        if self._hex_left == 0:
            self._state = _KSTR if self._esc_in_key else _STR
            if not self._esc_in_key:
                self._release()
        return JSON_OK

    def _push_number(self, c: str) -> int:
        """Inside a number: a character that cannot continue it ends it and is pushed again."""
        if c in "0123456789+-.eE":
            self._num += c
            self._out(c)
            return JSON_OK
        if not _NUMBER.fullmatch(self._num):
            return JSON_ERR
        self._value_done()
        return self.push(c)

    def _push_literal(self, c: str) -> int:
        """Inside true, false or null."""
        if c != self._lit[0]:
            return JSON_ERR
        self._out(c)
        self._lit = self._lit[1:]
        if not self._lit:
            self._value_done()
        return JSON_OK
