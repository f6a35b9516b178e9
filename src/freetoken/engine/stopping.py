"""Incremental detokenisation and stop strings for one generated sequence.

Tokens arrive one at a time but text cannot simply be decoded token by token: a byte-level
token may carry half a UTF-8 character, and SentencePiece-style decoders drop the leading
space of whatever comes first in a decode call. So each step decodes a short window of recent
tokens twice, with and without the newest ones, and emits the difference; the window slides
forward whenever the text ends on a whole character.

On top of that, text that might be the start of a stop string is held back until it either
completes the stop string (and is dropped) or stops matching (and is released).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"  # what decoders produce for bytes that are not (yet) a whole character


class TextStream:
    """Turns one sequence's generated tokens into text deltas, honouring stop strings.

    A stop string ends the text at the first place one is complete; when two complete in the
    same place the longer one (which starts earlier) wins. The result does not depend on how
    the text is split into tokens: it is the full text cut before that stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = (stop,) if isinstance(stop, str) else tuple(stop)
        for s in self._stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        # Only the window still needed is kept: _window[:_read] is context already emitted,
        # _window[_read:] are tokens whose text is not out yet.
        self._window: list[int] = []
        self._read = 0
        self._held = ""  # decoded text kept back because it could begin a stop string
        self.stopped = False
        self.stop_reason: str | None = None

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty)."""
        if self.stopped:
            return ""
        self._window.append(token_id)
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """Return everything still held back; call once the sequence has ended."""
        if self.stopped:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    def _decode_new(self, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        before = self._decode(self._window[: self._read])
        after = self._decode(self._window)
        # No growth means the newest tokens decode to nothing yet (or to skipped special
        # tokens); a trailing U+FFFD means a character is still missing bytes. Either way wait
        # for more tokens, unless there will be none.
        if not final and (len(after) <= len(before) or after.endswith(_REPLACEMENT)):
            return ""
        # The emitted tokens become the next step's context; older ones are never read again.
        del self._window[: self._read]
        self._read = len(self._window)
        return after[len(before) :]

    def _release(self, text: str, final: bool) -> str:
        text = self._held + text
        self._held = ""
        if not self._stop:
            return text
        hit = self._first_stop(text)
        if hit is not None:
            start, self.stop_reason = hit
            self.stopped = True
            return text[:start]
        if not final:
            keep = self._stop_prefix_len(text)
            if keep:
                self._held = text[-keep:]
                return text[:-keep]
        return text

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Start and string of the stop match that completes first in `text`.

        Held text never holds a whole stop string, so every match here ends in the new part;
        picking the earliest end is what a character-by-character stream would have done."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that some stop string starts with.

        Any stop string completed later must start inside that tail, so the text before it is
        safe to emit."""
        for n in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
