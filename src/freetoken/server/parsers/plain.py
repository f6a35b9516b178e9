"""The trivial parser: every piece of model text is answer text."""

from __future__ import annotations

from freetoken.server.events import Event, TextDelta


class PlainParser:
    """No markup is recognised; text passes through as TextDelta unchanged."""

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []

    @property
    def saw_tool_call(self) -> bool:
        return False
