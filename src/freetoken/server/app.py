"""The HTTP application (Starlette): routes, API key, errors in each API's own shape, stats.

Every POST runs the same pipeline: the body is read up to `max_request_bytes` (413 beyond);
parsed and validated by its schema (server/schemas.py) and prepared by its adapter (the chat
rendered, the prompt tokenized) in a worker thread, so the event loop keeps answering other
clients, /health included, meanwhile; then submitted on the event loop. A stream is returned
as it comes; a whole answer is awaited while the client is watched, and cancelled within a
fraction of a second of its leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from freetoken.config import ServerConfig
from freetoken.engine.scheduler import QueueFullError
from freetoken.server import anthropic_api, openai_api, responses_api
from freetoken.server.access_log import AccessLog
from freetoken.server.core import GenerationCore
from freetoken.server.errors import ApiError, shown
from freetoken.server.schemas import SCHEMAS, Body, schema_error
from freetoken.server.stats import Metrics, memory_split, stats_json

log = logging.getLogger(__name__)

# How often a whole (non-streamed) answer checks that its client is still there.
DISCONNECT_POLL_S = 0.2
RETRY_AFTER_S = 2  # a 429's Retry-After: about a few decode steps of a busy server


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, err: ApiError) -> Response:
    body = err.anthropic_body() if is_anthropic(path) else err.openai_body()
    # ASCII JSON: whatever of the request an error quotes, it can always be encoded.
    return Response(
        json.dumps(body), status_code=err.status, headers=err.headers, media_type="application/json"
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) what exceeds `limit` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        "invalid_request_error",
        f"the request body is larger than this server's limit of {limit} bytes "
        "(--max-request-bytes)",
    )


async def parse(request: Request, endpoint: str, limit: int) -> Body:
    raw = await read_body(request, limit)
    schema = SCHEMAS[endpoint]
    try:
        # A worker thread: a large body's parsing must not stall the event loop.
        return await asyncio.to_thread(schema.model_validate_json, raw)
    except ValidationError as e:
        raise schema_error(e, is_anthropic(request.url.path)) from None


async def whole_answer(request: Request, answer) -> Response:
    """Await a whole answer while watching its client: one that leaves cancels it (and with
    it the request's generation) within DISCONNECT_POLL_S."""
    task = asyncio.ensure_future(answer)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return JSONResponse(task.result())
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return Response(status_code=499)  # nobody reads it


class RequireKey:
    """ASGI middleware: every path but /health needs the key, as a bearer token or in
    x-api-key. Plain ASGI, not Starlette's BaseHTTPMiddleware, under which an endpoint
    cannot see its client leave (its `is_disconnected` never answers true)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    def authorized(self, headers: Headers) -> bool:
        bearer = headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else ""
        given = given or headers.get("x-api-key", "")
        # Constant time: the comparison must not tell how much of a guess was right.
        return hmac.compare_digest(given.encode(), self.key)

    async def __call__(self, scope, receive, send) -> None:
        guarded = scope["type"] == "http" and scope["path"] != "/health"
        if guarded and not self.authorized(Headers(scope=scope)):
            err = ApiError(
                401, "authentication_error", "invalid or missing API key", code="invalid_api_key"
            )
            await error_response(scope["path"], err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(core: GenerationCore, config: ServerConfig | None = None) -> Starlette:
    """The app. Starlette's own routing: each body is read and validated here (`parse`), so
    FastAPI's layer above it added nothing but its import (0.38 s of a start on the H200
    machine)."""
    config = config or ServerConfig()
    metrics = Metrics(core)
    core.metrics = metrics
    app = Starlette(
        routes=[
            *_server_routes(core, config.max_request_bytes, metrics),
            *_api_routes(core, config.max_request_bytes),
        ],
        exception_handlers={
            ApiError: _api_error,
            QueueFullError: _queue_full,
            StarletteHTTPException: _http_error,
            Exception: _internal,
        },
    )
    if config.api_key:
        app.add_middleware(RequireKey, key=config.api_key)
    app.add_middleware(AccessLog)  # (outermost: a request refused for its key is logged too)
    return app


async def _api_error(request: Request, err: ApiError) -> Response:
    return error_response(request.url.path, err)


async def _queue_full(request: Request, e: QueueFullError) -> Response:
    err = ApiError(429, "rate_limit_error", str(e), headers={"Retry-After": str(RETRY_AFTER_S)})
    return error_response(request.url.path, err)


async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    # No such route or method: in the API's shape too, not Starlette's plain text.
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {shown(request.url.path)}: {e.detail}"
    return error_response(request.url.path, ApiError(e.status_code, kind, message))


async def _internal(request: Request, e: Exception) -> Response:
    # Starlette logs the exception after this answer is sent.
    return error_response(request.url.path, ApiError(500, "api_error", "internal server error"))


def _api_routes(core: GenerationCore, limit: int) -> list[Route]:
    """The APIs' POST endpoints: OpenAI's, the Responses API's and Anthropic's."""

    async def generate(request: Request, endpoint: str, prepare, answer) -> Response:
        core.check_serving()
        body = await parse(request, endpoint, limit)
        prepared = await asyncio.to_thread(prepare, core, body)
        result = answer(core, prepared)  # submitted now: a full queue fails before a response
        if prepared.stream:
            return StreamingResponse(result, media_type="text/event-stream")
        return await whole_answer(request, result)

    async def chat(request: Request) -> Response:
        return await generate(request, "chat", openai_api.prepare_chat, openai_api.answer_chat)

    async def completions(request: Request) -> Response:
        return await generate(
            request, "completions", openai_api.prepare_completion, openai_api.answer_completion
        )

    async def responses(request: Request) -> Response:
        return await generate(
            request, "responses", responses_api.prepare_responses, responses_api.answer_responses
        )

    async def messages(request: Request) -> Response:
        return await generate(
            request, "messages", anthropic_api.prepare_messages, anthropic_api.answer_messages
        )

    async def count_tokens(request: Request) -> Response:
        body = await parse(request, "count_tokens", limit)
        return JSONResponse(await asyncio.to_thread(anthropic_api.count_tokens, core, body))

    return [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


def _server_routes(core: GenerationCore, limit: int, metrics: Metrics) -> list[Route]:
    """The server's own endpoints: health, the root, models, stats, control, metrics."""

    async def health(request: Request) -> Response:
        if (error := core.weights_error) is not None:  # corrupt weights: serving has stopped
            return JSONResponse({"status": "failed", "error": error}, status_code=503)
        return JSONResponse({"status": "draining" if core.draining else "ok"})

    async def root(request: Request) -> Response:
        # Clients probe the base URL before their first request (Claude Code sends HEAD /).
        return JSONResponse(
            {"name": "freetoken", "model": core.model_name, "endpoints": ["/v1", "/v1/messages"]}
        )

    async def list_models(request: Request) -> Response:
        return JSONResponse(openai_api.models(core))

    async def stats(request: Request) -> Response:
        return JSONResponse(stats_json(core))

    async def resize(request: Request) -> Response:
        """{"experts": SIZE, "kv": SIZE} (either or both): memory re-split between the expert
        cache and the KV pool at the next step boundary; answers the new split."""
        body = await parse(request, "ctl", limit)
        if body.experts is None and body.kv is None:
            raise ApiError(
                400,
                "invalid_request_error",
                'give a size: {"experts": "8GiB"} and/or {"kv": "4GiB"}',
            )
        experts = None if body.experts is None else str(body.experts)
        kv = None if body.kv is None else str(body.kv)
        engine = core.scheduler.engine
        try:
            await asyncio.wrap_future(core.scheduler.call(lambda: engine.resize(experts, kv)))
        except ValueError as e:
            raise ApiError(400, "invalid_request_error", str(e)) from None
        return JSONResponse(memory_split(engine))

    async def prometheus(request: Request) -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/health", health),
        Route("/", root),  # (GET and HEAD)
        Route("/v1/models", list_models),
        Route("/v1/stats", stats),
        Route("/v1/ctl/cache", resize, methods=["POST"]),
        Route("/metrics", prometheus),
    ]
