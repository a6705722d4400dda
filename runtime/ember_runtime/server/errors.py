"""The one place that turns the runtime's exceptions into OpenAI's error body.

The body itself, and the `type` each status gets, are the contract's (`contract.errors`): the
gateway answers in the same shape without importing the runtime.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember_runtime.contract.errors import error_body
from ember_runtime.engines.base import (
    EngineError,
    EngineStoppingError,
    InvalidRequestError,
    QueueFullError,
)

log = logging.getLogger(__name__)

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_response(exc: APIError) -> JSONResponse:
    body = error_body(exc.status, exc.message, param=exc.param, code=exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def from_engine_error(exc: EngineError) -> APIError:
    if isinstance(exc, QueueFullError):
        return APIError(
            429,
            str(exc),
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_seconds)},
        )
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineStoppingError):
        return APIError(503, str(exc), code="shutting_down", headers={"Retry-After": "1"})
    return APIError(500, str(exc), code="engine_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    # Drop "body" and pydantic's union-branch tags ("str", "list[int]") from the location.
    loc = [
        str(part)
        for part in first.get("loc", ())
        if part != "body" and str(part) not in _TYPE_TAGS and "[" not in str(part)
    ]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":  # never ignored silently (see schemas.py)
        return APIError(
            400,
            f"{param} is not a parameter this server supports",
            param=param,
            code="unsupported_parameter",
        )
    where = f"{param}: " if param else ""
    code = "missing" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param, code=code)


def install(app: FastAPI) -> None:
    async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_engine_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineError)
        return error_response(from_engine_error(exc))

    async def on_validation(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(_validation_error(exc))

    async def on_http(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return error_response(APIError(exc.status_code, str(exc.detail), headers=headers))

    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(APIError(500, "internal server error", code="internal"))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(EngineError, on_engine_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
