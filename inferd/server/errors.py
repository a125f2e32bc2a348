"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferd.server.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """An error the client gets as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(error: ValueError, fields: set[str]) -> APIError:
    """A 400 for a ``ValueError`` from the engine or ``SamplingParams``, whose
    messages start with the field they name."""
    message = str(error)
    first = message.split(" ", 1)[0].split("[", 1)[0]
    return bad_request(message, param=first if first in fields else None)


def internal_error(message: str) -> APIError:
    return APIError(500, message, type="internal_error", code="internal_error")


def unavailable(message: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, type="service_unavailable", code="service_unavailable", headers=headers)


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # Drop pydantic's union-branch labels such as "str" or "list[int]".
    parts = [p for p in parts if not (p.startswith(("list[", "function-", "tagged-union[")) or p in ("str", "int", "float", "bool"))]
    return ".".join(parts) or None


async def validation_error_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}").response()
    param = _param(tuple(first.get("loc", ())))
    message = first["msg"].removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    same_field = all(tuple(e.get("loc", ()))[:2] == tuple(first.get("loc", ()))[:2] for e in errors)
    if len(errors) > 1 and same_field:  # a union: no accepted type matched
        message = f"{param}: matches none of the accepted types (first mismatch: {first['msg']})"
    elif len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param=param).response()


async def http_error_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "error"
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = exc.detail if isinstance(exc.detail, str) else phrase
    return APIError(exc.status_code, message, type=error_type, headers=getattr(exc, "headers", None)).response()


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logging.getLogger("inferd.server").error(
        "unhandled error in %s %s", request.method, request.url.path, exc_info=exc
    )
    return internal_error(f"internal error: {type(exc).__name__}").response()
