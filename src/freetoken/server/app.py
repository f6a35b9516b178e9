"""The FastAPI application: routes, API key, errors in each API's own shape, stats."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from freetoken.engine.scheduler import QueueFullError
from freetoken.server import anthropic_api, openai_api, responses_api
from freetoken.server.core import GenerationCore
from freetoken.server.errors import ApiError
from freetoken.server.stats import metrics_text, stats_json
from freetoken.server.validate import reject_unknown

log = logging.getLogger(__name__)


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, err: ApiError) -> JSONResponse:
    body = err.anthropic_body() if _is_anthropic(path) else err.openai_body()
    return JSONResponse(body, status_code=err.status)


async def json_body(request: Request, endpoint: str) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise ApiError(400, "invalid_request_error", f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_request_error", "the body must be a JSON object")
    reject_unknown(body, endpoint)
    return body


def respond(result) -> Any:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


def create_app(core: GenerationCore, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="freetoken", docs_url=None, redoc_url=None)
    app.state.core = core

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if api_key and path != "/health":
            bearer = request.headers.get("authorization", "")
            given = bearer[7:] if bearer.lower().startswith("bearer ") else None
            if api_key not in (given, request.headers.get("x-api-key")):
                err = ApiError(
                    401,
                    "authentication_error",
                    "invalid or missing API key",
                    code="invalid_api_key",
                )
                return error_response(path, err)
        try:
            return await call_next(request)
        except ApiError as err:
            return error_response(path, err)
        except QueueFullError as e:
            return error_response(path, ApiError(429, "rate_limit_error", str(e)))
        except Exception:
            log.exception("unhandled error on %s", path)
            return error_response(path, ApiError(500, "api_error", "internal server error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        # Clients probe the base URL before their first request (Claude Code sends HEAD /).
        return {"name": "freetoken", "model": core.model_name, "endpoints": ["/v1", "/v1/messages"]}

    @app.get("/v1/models")
    async def list_models():
        return openai_api.models(core)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return respond(await openai_api.chat_completions(core, await json_body(request, "chat")))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return respond(await openai_api.completions(core, await json_body(request, "completions")))

    @app.post("/v1/responses")
    async def responses(request: Request):
        return respond(await responses_api.responses(core, await json_body(request, "responses")))

    @app.post("/v1/messages")
    async def messages(request: Request):
        return respond(await anthropic_api.messages(core, await json_body(request, "messages")))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return anthropic_api.count_tokens(core, await json_body(request, "count_tokens"))

    @app.get("/v1/stats")
    async def stats():
        return stats_json(core)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(core), media_type="text/plain; version=0.0.4")

    return app
