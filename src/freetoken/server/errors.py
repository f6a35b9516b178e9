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
    ):
        """`anthropic_message`: the wording of the Anthropic API where it differs (clients
        match some errors by their text, e.g. a prompt too long for the context)."""
        super().__init__(message)
        self.status, self.type, self.message, self.code = status, type, message, code
        self.anthropic_message = anthropic_message or message

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": None, "code": self.code}
        }

    def anthropic_body(self) -> dict[str, Any]:
        kinds = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "request_too_large",
            429: "rate_limit_error",
            500: "api_error",
        }
        return {
            "type": "error",
            "error": {
                "type": kinds.get(self.status, self.type),
                "message": self.anthropic_message,
            },
        }
