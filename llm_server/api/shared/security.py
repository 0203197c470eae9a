"""API-key check for /v1/* (Bearer token or `x-api-key`, constant-time compare)."""

from __future__ import annotations

import hmac
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from llm_server.api.shared.errors import APIError, anthropic_error, is_anthropic

API_KEY_ENV = "LLM_SERVER_API_KEY"
PROTECTED_PREFIX = "/v1/"


def resolve_api_key(option: str | None) -> str | None:
    """The key to require: the option when given, else the environment variable, else None."""
    key = option if option is not None else os.environ.get(API_KEY_ENV)
    return key or None


class APIKeyMiddleware:
    """Answer 401 on /v1/* unless `Authorization: Bearer <key>` or `x-api-key: <key>` (as
    Anthropic clients send it) matches."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
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
