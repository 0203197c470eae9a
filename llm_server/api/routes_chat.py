"""POST /v1/chat/completions: parse, template, admit, then JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llm_server.api.chat_plan import plan_chat
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
from llm_server.decoding import FinishReason
from llm_server.scheduler import FinishEvent, TokenEvent
from llm_server.service import GenerationHandle, ModelService
from llm_server.tools.output import ChatOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def chat_completions(request: Request) -> Response:
    service = get_service(request)
    chat = parse_chat(await read_json(request), service.config.default_max_tokens)
    check_model(service, chat.model, served_id(request))
    if not any(m["content"] or m.get("tool_calls") for m in chat.messages):
        raise invalid("messages", "every message is empty; send some content")
    plan = await plan_chat(service, chat)
    check_prompt(service, len(plan.prompt), "messages")
    # before any SSE byte (S3)
    handle = admit(service, plan.prompt, chat.params, plan.constraint, plan.keep_tokens)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if chat.stream:
        return StreamingResponse(
            _chat_stream(request, service, handle, chat, plan.output(), rid, created),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    out = await collect(handle, request)
    if (early := settle(request, [out.finish])) is not None:
        return early
    fin = out.finish
    answer = plan.output()
    for piece in out.pieces:
        answer.feed(piece)
    answer.feed(fin.text, tokens=0)
    answer.finish()
    choice = {
        "index": 0,
        "message": answer.message(),
        "finish_reason": answer.finish_reason(finish_reason(fin)),
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
            "usage": _usage(fin, answer),
        }
    )


def _usage(fin: FinishEvent, answer: ChatOutput) -> dict:
    out = usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens)
    if answer.splitter is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": answer.reasoning_tokens}
    return out


async def _chat_stream(
    request: Request,
    service: ModelService,
    handle: GenerationHandle,
    chat: ChatRequest,
    answer: ChatOutput,
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
            deltas = answer.feed(ev.text)
            if answer.plain:  # no parsing: one content delta per token, as before
                deltas = [{"content": ev.text}] if ev.text or lp is not None else []
            for i, delta in enumerate(deltas):
                yield chunk(delta, logprobs=lp if i == 0 else None)
            if lp is not None and not deltas:
                yield chunk({}, logprobs=lp)
            continue
        if ev.reason == FinishReason.CANCELLED:
            return
        record_finish(request, ev)
        if ev.reason == FinishReason.ERROR:
            yield sse(error_body(500, "the model failed while generating this request"))
            break
        for delta in answer.feed(ev.text, tokens=0) + answer.finish():
            yield chunk(delta)
        yield chunk({}, finish=answer.finish_reason(finish_reason(ev)))
        if chat.include_usage:
            yield sse(
                {
                    **base,
                    "choices": [],
                    "usage": _usage(ev, answer),
                }
            )
    yield sse("[DONE]")
