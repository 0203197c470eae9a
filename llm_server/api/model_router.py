"""ASGI middleware: resolve a request's `model` to its loaded service before the route runs.

The body is read once here (the routes read it again from a replay), the model is loaded if
needed, and the route finds the service through `api.state.scoped_service`. The model is held
(never unloaded) until the response has been sent, streams included.
"""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_server.api.shared.errors import APIError, anthropic_error, is_anthropic
from llm_server.api.shared.request_log import LOGGED_PATHS
from llm_server.api.shared.state import MODEL_ID_KEY, SERVICE_KEY, AppState
from llm_server.models.slots import ModelError

# the routes that serve a model named in the request (body `model`, or `?model=` on a GET):
# every route the request log records, and the tokenizer's description
MODEL_ROUTES = LOGGED_PATHS | {"/tokenizer_info"}
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNITS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ModelRouter:
    """Hold the request's model for the request's lifetime (loading it first if needed)."""

    def __init__(self, app: ASGIApp, state: AppState, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.manager = state.manager
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in MODEL_ROUTES:
            await self.app(scope, receive, send)
            return
        if self.state.draining:  # load nothing more; the route answers 503
            await self.app(scope, receive, send)
            return
        body, receive = await _buffer(receive, self.max_body_bytes)
        try:
            name, keep_alive = _requested(scope, body)
            slot = await self.manager.acquire(name)
        except ModelError as exc:
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            err = APIError(exc.status, str(exc), param="model", code=exc.code, headers=headers)
            await _error(scope, err)(scope, receive, send)
            return
        except APIError as err:
            await _error(scope, err)(scope, receive, send)
            return
        scope[SERVICE_KEY] = slot.service
        scope[MODEL_ID_KEY] = slot.entry.id
        try:
            await self.app(scope, receive, send)
        finally:
            self.manager.release(slot, keep_alive)


async def _buffer(receive: Receive, limit: int) -> tuple[bytes, Receive]:
    """Read the body (up to `limit` + 1 bytes) and a receive that replays it first."""
    chunks: list[Message] = []
    size = 0
    while True:
        message = await receive()
        chunks.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body") or size > limit:
            break
    body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")

    async def replay() -> Message:
        return chunks.pop(0) if chunks else await receive()

    return body, replay


def _requested(scope: Scope, body: bytes) -> tuple[str | None, float | None]:
    """The model name and keep_alive seconds a request asks for (None: not given). A body that
    is not a JSON object names no model: the route answers its own 400/413/415 for it."""
    if scope["method"] == "GET":
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        return (query.get("model") or [None])[0], None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model", code="invalid_value")
    return model, parse_keep_alive(data.get("keep_alive"))


def parse_keep_alive(value: object) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a duration such as "5m", "1h", "30s";
    0 unloads after the request, negative keeps the model loaded."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise APIError(
            400,
            f"'keep_alive' must be seconds or a duration such as '5m', '1h', '30s'; got {value!r}",
            param="keep_alive",
            code="invalid_value",
        )
    return float(match[1]) * _UNITS[match[2]]


def _error(scope: Scope, err: APIError):
    if is_anthropic(scope["path"]):
        return anthropic_error(err.status, err.message, err.headers)
    return err.response()
