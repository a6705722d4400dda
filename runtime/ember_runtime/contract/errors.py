"""OpenAI's error body: what the runtime and the gateway answer a client with when they refuse.

`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status, so the openai
client raises its usual typed exceptions (BadRequestError, RateLimitError, ...). The runtime's
errors (`server.errors`), its streamed error events, the request body limit (`asgi`) and the
gateway's own refusals all encode through `error_body`; a client of either reads one shape.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# The `type` OpenAI gives each status; any other 5xx is `server_error`, any other 4xx
# `invalid_request_error`.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_unavailable",
    504: "timeout",
}


class ErrorDetail(BaseModel):
    model_config = ConfigDict(frozen=True)

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The body as a type (a reader's side: `ErrorBody.model_validate_json(reply)`)."""

    model_config = ConfigDict(frozen=True)

    error: ErrorDetail


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The body for `status`, as JSON-ready data (every field present, `null` when unset)."""
    detail = ErrorDetail(message=message, type=error_type(status), param=param, code=code)
    return ErrorBody(error=detail).model_dump(mode="json")
