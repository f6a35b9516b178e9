"""One line per request on `ft serve`'s log (`freetoken.server.access`): the method, the path,
the status, the prompt and output tokens and the time from the request's arrival to its last
byte, e.g.

    127.0.0.1 POST /v1/chat/completions 200 prompt=25 output=64 1.92s

A pure ASGI middleware (a stream's line comes when its last event is sent); the generation
notes its tokens (`note`) in the request's record, found through a context variable."""

from __future__ import annotations

import contextvars
import logging
import time

log = logging.getLogger(__name__)
_record: contextvars.ContextVar[dict | None] = contextvars.ContextVar("access", default=None)


def note(prompt_tokens: int, output_tokens: int) -> None:
    """The tokens of the request being answered (no-op outside one)."""
    record = _record.get()
    if record is not None:
        record["prompt"], record["output"] = prompt_tokens, output_tokens


def line(client: str, method: str, path: str, status: int | None, record: dict, s: float) -> str:
    tokens = "".join(f" {k}={record[k]}" for k in ("prompt", "output") if k in record)
    return f"{client} {method} {path} {status if status is not None else '-'}{tokens} {s:.2f}s"


class AccessLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        record: dict = {}
        token = _record.set(record)
        status: list[int] = []
        logged = False

        def write() -> None:
            nonlocal logged
            if not logged:
                logged = True
                client = scope.get("client")
                log.info(
                    line(
                        client[0] if client else "-",
                        scope["method"],
                        scope["path"],
                        status[0] if status else None,
                        record,
                        time.perf_counter() - started,
                    )
                )

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                write()

        try:
            await self.app(scope, receive, sending)
        finally:
            _record.reset(token)
            write()  # (a response cut short: its client left, or an error)
