"""Errors in OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.

Every failure the server answers goes through `APIError` or one of the handlers installed by
`install_error_handlers`, so a client sees one shape whatever went wrong:

    400 invalid_request_error   a body that fails validation (FastAPI's own 422 included, and
                                so declared in /openapi.json) or is not JSON (param null),
                                a value the engine refuses (prompt too long, bad stop string)
    401 authentication_error    a missing or wrong API key
    404 not_found_error         an unknown model name or route
    413 invalid_request_error   a body larger than the configured limit
    503 service_unavailable     the engine is loading or died; the queue is full (Retry-After)
    500 internal_error          a bug: logged with its traceback, answered without it
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as-is: status, message, and the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value")


# names pydantic puts in an error's location for the branch of a union ("stop.list[str]")
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_field(part) -> bool:
    return isinstance(part, int) or (
        part != "body" and part not in _UNION_TAGS and "[" not in part and "-" not in part
    )


def _relevance(error: dict) -> int:
    """A union field fails once per branch; the branch of the input's own type says most
    ("at most 16 items" for a list, not "should be a valid string")."""
    kind = error.get("type", "")
    return 1 if kind.endswith("_type") or kind.startswith("is_instance") else 0


def validation_message(error: dict) -> tuple[str, str | None]:
    """One pydantic error as 'field: what is wrong (got value)' and the dotted field name."""
    loc = [str(part) for part in error.get("loc", ()) if _is_field(part)]
    param = ".".join(loc) or None
    message = error.get("msg", "invalid value")
    if "input" in error and error.get("type") not in ("missing", "json_invalid"):
        shown = repr(error["input"])
        message += f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
    return (f"{param}: {message}" if param else message), param


def _json_error_message(error: dict) -> str:
    """A body that is not JSON at all: what the decoder said, and where (no field is at
    fault, so the error's param is null, as OpenAI's)."""
    position = next((p for p in error.get("loc", ())[1:] if isinstance(p, int)), None)
    where = f" at character {position}" if position is not None else ""
    reason = (error.get("ctx") or {}).get("error", error.get("msg", "JSON decode error"))
    return f"the request body is not valid JSON: {reason}{where}"


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = sorted(exc.errors(), key=_relevance)
    if errors and errors[0].get("type") == "json_invalid":
        body = error_body(400, _json_error_message(errors[0]), None, "invalid_json")
        return JSONResponse(body, status_code=400)
    message, param = validation_message(errors[0]) if errors else ("invalid request", None)
    others = {validation_message(e)[1] for e in errors[1:]} - {param}
    if others:
        message += f" (and {len(others)} more field(s): {', '.join(sorted(map(str, others)))})"
    return JSONResponse(error_body(400, message, param, "invalid_value"), status_code=400)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    try:
        default = HTTPStatus(exc.status_code).phrase
    except ValueError:
        default = "error"
    message = exc.detail if isinstance(exc.detail, str) else default
    return JSONResponse(
        error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers
    )


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path)
    message = f"internal error ({type(exc).__name__}); the server log has the details"
    return JSONResponse(error_body(500, message, code="internal_error"), status_code=500)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The envelope of every error (for /openapi.json)."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """The `responses` of a route's OpenAPI entry for these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERROR_TYPES[status]}
            for status in statuses}  # fmt: skip


def _without_422(app: FastAPI) -> Callable[[], dict]:
    """app.openapi, less the 422 FastAPI declares for every route with a body or parameters
    (the server answers validation errors with 400, declared per route) and its schemas."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    app.openapi = _without_422(app)
