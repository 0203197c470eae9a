"""Error bodies, never a stack trace: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
Anthropic's `{"type": "error", "error": {"type", "message"}}` on /v1/messages; and the log line
an operator sees for every refusal (4xx)."""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client can act on; becomes an OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = ANTHROPIC_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)


def is_anthropic(path: str) -> bool:
    """True for the routes that answer errors in Anthropic's format."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def invalid(param: str, message: str) -> APIError:
    """400 naming the field at fault."""
    return APIError(400, message, param=param, code="invalid_value")


# the request's field a refusal blamed, for the log line (Anthropic's body carries no `param`)
_PARAM_KEY = "refused_param"
_MAX_LOGGED_BODY = 16384  # bytes of a 4xx body read for its message
CLIENT_CLOSED = 499  # the client went away: a cancellation, not a refusal


def note_refusal(request: Request, exc: APIError) -> None:
    """Remember `exc`'s field for RefusalLog (its response body may not carry it)."""
    request.scope.setdefault("state", {})[_PARAM_KEY] = exc.param


class RefusalLog:
    """ASGI middleware: one info line per 4xx answer, whatever built it (a route, a handler,
    the API-key check): `METHOD /path -> status param=FIELD: message`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, body = 0, bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and _refused(status):
                if len(body) < _MAX_LOGGED_BODY:
                    body.extend(message.get("body", b"")[: _MAX_LOGGED_BODY - len(body)])
                if not message.get("more_body", False):
                    _log_refusal(scope, status, bytes(body))
            await send(message)

        await self.app(scope, receive, watch)


def _refused(status: int) -> bool:
    return 400 <= status < 500 and status != CLIENT_CLOSED


def _log_refusal(scope: Scope, status: int, body: bytes) -> None:
    param, message = scope.get("state", {}).get(_PARAM_KEY), ""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        err = None
    if isinstance(err, dict):
        param = err.get("param") or param
        message = str(err.get("message") or "")
    elif body:
        message = body.decode("utf-8", "replace")
    log.info(
        "refused %s %s -> %d param=%s: %s",
        scope.get("method", ""),
        scope.get("path", ""),
        status,
        param or "-",
        " ".join(message.split()),
    )
