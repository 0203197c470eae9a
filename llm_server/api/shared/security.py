"""API-key check for /v1/* and the page's data (Bearer token or `x-api-key`, constant-time
compare), and the same-origin check on the state-changing routes (load, unload)."""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from llm_server.api.shared.errors import APIError, anthropic_error, is_anthropic

API_KEY_ENV = "LLM_SERVER_API_KEY"
PROTECTED_PREFIXES = ("/v1/", "/ui/api/")  # the API, and the data the page polls
# POSTs that change the server's state: a browser on another origin must never drive them
STATE_CHANGING = re.compile(r"^/v1/models/.+/(load|unload)$")


def resolve_api_key(option: str | None) -> str | None:
    """The key to require: the option when given, else the environment variable, else None."""
    key = option if option is not None else os.environ.get(API_KEY_ENV)
    return key or None


class APIKeyMiddleware:
    """Answer 401 on /v1/* and /ui/api/* unless `Authorization: Bearer <key>` or
    `x-api-key: <key>` (as Anthropic clients send it) matches."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if is_anthropic(scope["path"]):
            message = "a valid API key is required: send 'x-api-key: <key>'"
            await anthropic_error(401, message)(scope, receive, send)
            return
        error = APIError(
            401,
            "a valid API key is required: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"x-api-key" and hmac.compare_digest(value.strip(), self._key):
                return True
            if name == b"authorization":
                header = value
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(token.strip(), self._key)


class SameOriginMiddleware:
    """Answer 403 to a state-changing POST sent by a browser from another origin than the
    server's own (or one of `allowed`, the --cors-origin list). Clients that are not browsers
    send no `Origin` and pass; the API key check still applies to them."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str] = ()) -> None:
        self.app = app
        self.allowed = {origin.rstrip("/") for origin in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or not STATE_CHANGING.match(scope["path"])
            or self._same_origin(scope)
        ):
            await self.app(scope, receive, send)
            return
        error = APIError(
            403,
            "loading and unloading models is refused from another origin than the server's own",
            code="cross_origin",
        )
        await error.response()(scope, receive, send)

    def _same_origin(self, scope: Scope) -> bool:
        headers = {name: value.decode("latin-1") for name, value in scope["headers"]}
        origin = headers.get(b"origin")
        if origin is None:
            # no Origin: not a browser's cross-origin request, unless fetch metadata says so
            return headers.get(b"sec-fetch-site", "same-origin") in ("same-origin", "none")
        if origin.rstrip("/") in self.allowed:
            return True
        host = headers.get(b"host")
        scheme = scope.get("scheme", "http")
        return host is not None and origin == f"{scheme}://{host}"
