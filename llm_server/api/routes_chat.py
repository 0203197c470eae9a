"""POST /v1/chat/completions: parse, template, admit, then JSON or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llm_server.api.common import (
    admit,
    check_model,
    check_prompt,
    get_service,
    read_json,
    record_finish,
    served_id,
    settle,
    usage,
)
from llm_server.api.errors import error_body, invalid
from llm_server.api.logprobs import chat_logprobs
from llm_server.api.schemas import ChatRequest, parse_chat
from llm_server.api.streaming import collect, finish_reason, sse
from llm_server.constrained import ConstraintError, build_constraint
from llm_server.decoding import FinishReason, LogitsConstraint
from llm_server.scheduler import TokenEvent
from llm_server.service import GenerationHandle, ModelService
from llm_server.tokenizer import ChatTemplateError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _constraint(service: ModelService, chat: ChatRequest) -> LogitsConstraint | None:
    """Compile the response_format grammar off the event loop (a big schema takes a while)."""
    if chat.response_format is None:
        return None
    vocab = service.engine.vocab_size
    try:
        return await asyncio.to_thread(
            build_constraint, chat.response_format, service.tokenizer, vocab
        )
    except ConstraintError as exc:
        raise invalid("response_format", str(exc)) from None


async def chat_completions(request: Request) -> Response:
    service = get_service(request)
    body = await read_json(request)
    chat = parse_chat(body, service.config.default_max_tokens, service.sampling_defaults)
    check_model(service, chat.model, served_id(request))
    if not any(m["content"] for m in chat.messages):
        raise invalid("messages", "every message is empty; send some content")
    constraint = await _constraint(service, chat)
    try:
        prompt = service.tokenizer.apply_chat_template(list(chat.messages))
    except ChatTemplateError as exc:
        raise invalid("messages", str(exc)) from None
    check_prompt(service, len(prompt), "messages")
    handle = admit(service, prompt, chat.params, constraint)  # before any SSE byte (S3)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if chat.stream:
        return StreamingResponse(
            _chat_stream(request, service, handle, chat, rid, created),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    out = await collect(handle, request)
    if (early := settle(request, [out.finish])) is not None:
        return early
    fin = out.finish
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": out.text},
        "finish_reason": finish_reason(fin),
        "logprobs": None,
    }
    if chat.params.logprobs:
        choice["logprobs"] = chat_logprobs(out.logprobs, service.tokenizer.token_strings)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": served_id(request),
            "system_fingerprint": service.fingerprint,
            "choices": [choice],
            "usage": usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens),
        }
    )


async def _chat_stream(
    request: Request,
    service: ModelService,
    handle: GenerationHandle,
    chat: ChatRequest,
    rid: str,
    created: int,
) -> AsyncIterator[str]:
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": served_id(request),
        "system_fingerprint": service.fingerprint,
    }

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
                lp = chat_logprobs([ev.logprob], service.tokenizer.token_strings)
            if ev.text or lp is not None:
                yield chunk({"content": ev.text}, logprobs=lp)
            continue
        if ev.reason == FinishReason.CANCELLED:
            return
        record_finish(request, ev)
        if ev.reason == FinishReason.ERROR:
            yield sse(error_body(500, "the model failed while generating this request"))
            break
        if ev.text:
            yield chunk({"content": ev.text})
        yield chunk({}, finish=finish_reason(ev))
        if chat.include_usage:
            yield sse(
                {
                    **base,
                    "choices": [],
                    "usage": usage(ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens),
                }
            )
    yield sse("[DONE]")
