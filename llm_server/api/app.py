"""Starlette application: routes, error handling and the request/response shapes."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llm_server.api.errors import APIError, error_body, invalid
from llm_server.api.schemas import ChatRequest, parse_chat
from llm_server.api.streaming import chat_logprobs, collect, finish_reason, sse
from llm_server.blas import active_blas
from llm_server.decoding import FinishReason
from llm_server.scheduler import FinishEvent, QueueFull, SchedulerClosed, TokenEvent
from llm_server.service import GenerationHandle, ModelService
from llm_server.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


class AppState:
    """What the handlers share: the service (None until the model is loaded)."""

    def __init__(self, service: ModelService | None, model_id: str) -> None:
        self.service = service
        self.model_id = model_id
        self.loading = service is None or not service.ready
        self.draining = False


def _service(request: Request) -> ModelService:
    st: AppState = request.app.state.llm
    if st.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    if st.service is None or not st.service.ready:
        raise APIError(503, "the model is still loading; retry shortly", code="model_loading",
                       headers={"Retry-After": "1"})
    return st.service


async def read_json(request: Request) -> dict:
    """The request body as a JSON object; 413 over the limit, 400 when malformed."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is over the {MAX_BODY_BYTES} byte limit")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"request body is over the {MAX_BODY_BYTES} byte limit")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _check_model(service: ModelService, model: str | None) -> None:
    if model is not None and model not in (service.config.model_id, "default"):
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {service.config.model_id!r}",
            param="model",
            code="model_not_found",
        )


def _check_prompt(service: ModelService, n_tokens: int, param: str) -> None:
    if n_tokens == 0:
        raise invalid(param, "the prompt is empty")
    ctx = service.context_length
    if n_tokens > ctx:
        raise APIError(
            400,
            f"the prompt has {n_tokens} tokens but the context holds {ctx}; shorten it",
            param=param,
            code="context_length_exceeded",
        )


def _admit(service: ModelService, prompt: list[int], chat: ChatRequest) -> GenerationHandle:
    try:
        return service.start_generation(prompt, chat.params)
    except QueueFull as exc:
        raise APIError(429, str(exc), code="queue_full",
                       headers={"Retry-After": str(max(1, round(exc.retry_after)))}) from None
    except SchedulerClosed as exc:
        raise APIError(503, str(exc), code="shutting_down") from None


async def chat_completions(request: Request) -> Response:
    service = _service(request)
    chat = parse_chat(await read_json(request), service.config.default_max_tokens)
    _check_model(service, chat.model)
    if not any(m["content"] for m in chat.messages):
        raise invalid("messages", "every message is empty; send some content")
    if chat.response_format is not None:
        raise invalid("response_format", "response_format json modes are not available yet")
    try:
        prompt = service.tokenizer.apply_chat_template(list(chat.messages))
    except ChatTemplateError as exc:
        raise invalid("messages", str(exc)) from None
    _check_prompt(service, len(prompt), "messages")
    handle = _admit(service, prompt, chat)  # admitted before any SSE byte (S3)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if chat.stream:
        return StreamingResponse(
            _chat_stream(service, handle, chat, rid, created),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    out = await collect(handle, request)
    fin = out.finish
    if fin is None or fin.reason == FinishReason.CANCELLED:
        return Response(status_code=499)
    if fin.reason == FinishReason.ERROR:
        raise APIError(500, "the model failed while generating this request", code="engine_error")
    message = {"role": "assistant", "content": out.text}
    choice = {"index": 0, "message": message, "finish_reason": finish_reason(fin),
              "logprobs": None}
    if chat.params.logprobs:
        choice["logprobs"] = chat_logprobs(out.logprobs, _token_str(service))
    return JSONResponse({
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": service.config.model_id,
        "system_fingerprint": service.fingerprint,
        "choices": [choice],
        "usage": _usage(fin),
    })


def _token_str(service: ModelService):
    return lambda tid: service.tokenizer.token_strings([tid])[0]


def _usage(fin: FinishEvent) -> dict:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }


async def _chat_stream(
    service: ModelService, handle: GenerationHandle, chat: ChatRequest, rid: str, created: int
) -> AsyncIterator[str]:
    base = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": service.config.model_id, "system_fingerprint": service.fingerprint}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        body = {**base, "choices": [choice]}
        if chat.include_usage:
            body["usage"] = None
        return sse(body)

    yield chunk({"role": "assistant", "content": ""})
    async for ev in handle.events():
        if isinstance(ev, TokenEvent):
            lp = None
            if ev.logprob is not None:
                lp = chat_logprobs([ev.logprob], _token_str(service))
            if ev.text or lp is not None:
                yield chunk({"content": ev.text}, logprobs=lp)
            continue
        if ev.reason == FinishReason.ERROR:
            yield sse(error_body(500, "the model failed while generating this request"))
            break
        if ev.reason == FinishReason.CANCELLED:
            return
        if ev.text:
            yield chunk({"content": ev.text})
        yield chunk({}, finish=finish_reason(ev))
        if chat.include_usage:
            yield sse({**base, "choices": [], "usage": _usage(ev)})
    yield sse("[DONE]")


async def list_models(request: Request) -> Response:
    st: AppState = request.app.state.llm
    created = int(st.service.started_at) if st.service else int(time.time())
    return JSONResponse({
        "object": "list",
        "data": [{"id": st.model_id, "object": "model", "created": created, "owned_by": "llm-server"}],
    })


async def health(request: Request) -> Response:
    st: AppState = request.app.state.llm
    svc = st.service
    body: dict = {"status": "loading", "ready": False, "model": st.model_id, "blas": active_blas()}
    if svc is not None and svc.ready:
        stats = svc.scheduler.stats()
        body.update({
            "status": "draining" if st.draining else "ok",
            "ready": not st.draining,
            "engine": svc.engine.name,
            "dtype": svc.engine.dtype,
            "batching": svc.batching,
            "concurrent_requests": stats.rows,
            "rows_busy": stats.rows_busy,
            "queue_length": stats.queued,
            "max_queued": svc.config.max_queued,
            "context_length": svc.context_length,
            "system_fingerprint": svc.fingerprint,
            "last_error": stats.last_error,
        })
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


async def _api_error(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    msg = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}
    return JSONResponse(error_body(exc.status_code, msg.get(exc.status_code, str(exc.detail))),
                        status_code=exc.status_code)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse(error_body(500, "internal server error"), status_code=500)


def create_app(state: AppState, **options: object) -> Starlette:
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
    )
    app.state.llm = state
    return app
