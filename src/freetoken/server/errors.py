"""Errors with an HTTP status, rendered in the shape of the API that was called."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        code: str | None = None,
        anthropic_message: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        """`anthropic_message`: the wording of the Anthropic API where it differs (clients
        match some errors by their text, e.g. a prompt too long for the context); `param`:
        the request field at fault (OpenAI's `param`); `headers`: of the response (a 429's
        Retry-After)."""
        super().__init__(message)
        self.status, self.type, self.message, self.code = status, type, message, code
        self.anthropic_message = anthropic_message or message
        self.param = param
        self.headers = headers or {}

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        kinds = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "request_too_large",
            429: "rate_limit_error",
            500: "api_error",
            503: "overloaded_error",
        }
        return {
            "type": "error",
            "error": {
                "type": kinds.get(self.status, self.type),
                "message": self.anthropic_message,
            },
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 for a request the client must change."""
    return ApiError(400, "invalid_request_error", message, param=param)


def shown(value: str, limit: int = 80) -> str:
    """A client's value as an error message may quote it: cut to `limit` characters."""
    return value if len(value) <= limit else value[:limit] + "..."
