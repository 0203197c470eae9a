"""The Starlette application: routes, middleware (metrics, CORS, API key) and error handling."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llm_server.api.agent_routes import AGENT_ROUTES
from llm_server.api.info import detokenize, health, list_models, tokenize, tokenizer_info
from llm_server.api.managed_models import model_action
from llm_server.api.openai.batch_state import attach_batch_api
from llm_server.api.openai.batches import cancel_batch, create_batch, get_batch, list_batches
from llm_server.api.openai.chat_completions import chat_completions
from llm_server.api.openai.completions import completions
from llm_server.api.openai.embeddings import embeddings
from llm_server.api.openai.files import (
    delete_file,
    file_content,
    get_file,
    list_files,
    upload_file,
)
from llm_server.api.openapi.document import openapi_schema
from llm_server.api.shared.errors import (
    APIError,
    RefusalLog,
    anthropic_error,
    error_body,
    is_anthropic,
    note_refusal,
)
from llm_server.api.shared.metrics import Metrics, RequestCounter, metrics_endpoint
from llm_server.api.shared.recent import RecentRequests, RecentRequestsMiddleware
from llm_server.api.shared.request_log import RequestLogMiddleware, RequestRecorder
from llm_server.api.shared.security import APIKeyMiddleware, SameOriginMiddleware, resolve_api_key
from llm_server.api.shared.state import AppState, scoped_service
from llm_server.settings import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILE_BYTES, ImageLimits

log = logging.getLogger(__name__)

__all__ = ["AppState", "create_app"]


async def _openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def _api_error(request: Request, exc: APIError) -> Response:
    note_refusal(request, exc)
    if is_anthropic(request.url.path):
        return anthropic_error(exc.status, exc.message, exc.headers)
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    messages = {
        404: f"no route {request.url.path}",
        405: f"method {request.method} is not allowed on {request.url.path}",
    }
    message = messages.get(exc.status_code, str(exc.detail))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    if is_anthropic(request.url.path):
        return anthropic_error(exc.status_code, message, exc.headers)
    return JSONResponse(
        error_body(exc.status_code, message, code=code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    if is_anthropic(request.url.path):
        return anthropic_error(500, "internal server error")
    return JSONResponse(error_body(500, "internal server error"), status_code=500)


def _needs_lm_head(handler):
    """Refuse generation and scoring (400) on a checkpoint without an LM head (an embedding
    model saved as the bare transformer); it serves /v1/embeddings only."""

    async def route(request: Request) -> Response:
        service = scoped_service(request.scope, request.app.state.llm)
        engine = service.engine if service is not None else None
        if engine is not None and not engine.has_lm_head:
            raise APIError(
                400,
                "this model is an embedding checkpoint without a language-model head; "
                "it serves POST /v1/embeddings only",
                code="embeddings_only",
            )
        return await handler(request)

    return route


ROUTES = [
    Route("/v1/chat/completions", _needs_lm_head(chat_completions), methods=["POST"]),
    Route("/v1/completions", _needs_lm_head(completions), methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/files", upload_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    # GET /v1/models/{id}, POST .../load and .../unload (ids may hold a slash: hub ids)
    Route("/v1/models/{rest:path}", model_action, methods=["GET", "POST"], include_in_schema=False),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics_endpoint, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    Route("/openapi.json", _openapi, methods=["GET"], include_in_schema=False),
    *(
        Route(r.path, _needs_lm_head(r.endpoint), methods=list(r.methods or ()))
        if r.path in ("/v1/responses", "/v1/messages")
        else r
        for r in AGENT_ROUTES
    ),
]


def create_app(
    state: AppState,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_log: RequestRecorder | None = None,
    ui: bool = True,
    data_dir: Path | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    images: ImageLimits | None = None,
) -> Starlette:
    """The ASGI app for `state`.

    `api_key` (else env LLM_SERVER_API_KEY) guards /v1/* and the page's data; `cors_origins`
    enables CORS for those origins only; request bodies over `max_body_bytes` get 413;
    `request_log` records every API request (the caller closes it after the service has
    drained); `ui` serves the page at `/` (api/ui/) and keeps the recent requests it lists;
    the Batch API keeps its files and batches in `data_dir` (None: the user's data folder, on
    first use) and takes files up to `max_file_bytes`; `images` bounds the images a request
    carries (api/shared/images.py; None: the defaults).
    """
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be at least 1")
    metrics = Metrics(lambda: state.service)
    # outermost: one log line per 4xx, whichever layer answered it
    middleware = [Middleware(RefusalLog), Middleware(RequestCounter, metrics=metrics)]
    recent = None
    if ui:  # the page's Requests view: from the request log when it is on, else its own ring
        recent = RecentRequests(source="request log" if request_log is not None else "memory")
        if request_log is None:  # before the key check, so refused requests are listed too
            middleware.append(Middleware(RecentRequestsMiddleware, recent=recent, state=state))
    middleware.append(Middleware(SameOriginMiddleware, allowed=list(cors_origins)))
    if cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
            )
        )
    key = resolve_api_key(api_key)
    if key is not None:
        middleware.append(Middleware(APIKeyMiddleware, api_key=key))
    if request_log is not None:  # innermost: logs only requests the key check let through
        request_log.set_secret(key)
        middleware.append(
            Middleware(RequestLogMiddleware, recorder=request_log, state=state, recent=recent)
        )
    if state.manager is not None:  # innermost: a request's model loads after the key check
        from llm_server.api.model_router import ModelRouter

        middleware.append(Middleware(ModelRouter, state=state, max_body_bytes=max_body_bytes))
    routes = list(ROUTES)
    if ui:
        from llm_server.api.ui.routes import UI_ROUTES

        routes += UI_ROUTES

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        app.state.batch.runner.ensure_started()  # batches left running resume
        try:
            yield
        finally:
            await app.state.batch.runner.stop()

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    app.state.llm = state
    app.state.metrics = metrics
    app.state.max_body_bytes = max_body_bytes
    app.state.image_limits = images or ImageLimits()
    app.state.recent = recent
    app.state.openapi = openapi_schema()
    app.state.batch = attach_batch_api(app, state, data_dir, max_file_bytes, key)
    state.drain_hooks.append(app.state.batch.runner.stop)
    metrics.attach_batches(app.state.batch.runner)
    state.on_service(metrics.attach)
    return app
