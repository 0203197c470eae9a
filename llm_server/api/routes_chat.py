"""POST /v1/chat/completions: parse, template, admit, then JSON or SSE."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llm_server.api.common import (
    admit_all,
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
from llm_server.api.streaming import collect_many, finish_reason, merge_events, sse
from llm_server.constrained import ConstraintError, build_constraint
from llm_server.decoding import FinishReason, LogitsConstraint
from llm_server.scheduler import FinishEvent, TokenEvent
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
    chat = parse_chat(
        body, service.config.default_max_tokens, service.token_id_limit, service.sampling_defaults
    )
    check_model(service, chat.model, served_id(request))
    if not any(m["content"] for m in chat.messages):
        raise invalid("messages", "every message is empty; send some content")
    constraints = [await _constraint(service, chat) for _ in range(chat.n)]  # one per row
    try:
        prompt = service.tokenizer.apply_chat_template(list(chat.messages))
    except ChatTemplateError as exc:
        raise invalid("messages", str(exc)) from None
    check_prompt(service, len(prompt), "messages")
    # every choice admitted before any SSE byte (S3), all or none
    handles = admit_all(service, [prompt], chat.params, chat.n, constraints)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if chat.stream:
        return StreamingResponse(
            _chat_stream(request, service, handles, chat, rid, created),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    outs = await collect_many(handles, request)
    if (early := settle(request, [o.finish for o in outs])) is not None:
        return early
    choices = []
    for i, out in enumerate(outs):
        choice = {
            "index": i,
            "message": {"role": "assistant", "content": out.text},
            "finish_reason": finish_reason(out.finish),
            "logprobs": None,
        }
        if chat.params.logprobs:
            choice["logprobs"] = chat_logprobs(out.logprobs, service.tokenizer.token_strings)
        choices.append(choice)
    first = outs[0].finish  # the prompt counts once, whatever n is
    n_completion = sum(o.finish.completion_tokens for o in outs)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": served_id(request),
            "system_fingerprint": service.fingerprint,
            "choices": choices,
            "usage": usage(first.prompt_tokens, n_completion, first.cached_tokens),
        }
    )


async def _chat_stream(
    request: Request,
    service: ModelService,
    handles: list[GenerationHandle],
    chat: ChatRequest,
    rid: str,
    created: int,
) -> AsyncIterator[str]:
    """Chunks of every choice as their tokens come, each tagged with its `index` (n > 1
    interleaves them as OpenAI does); usage, when asked, after the last choice finished."""
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": served_id(request),
        "system_fingerprint": service.fingerprint,
    }

    def chunk(
        index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None
    ) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        body = {**base, "choices": [choice]}
        if chat.include_usage:
            body["usage"] = None
        return sse(body)

    for i in range(len(handles)):
        yield chunk(i, {"role": "assistant", "content": ""})
    finishes: list[FinishEvent | None] = [None] * len(handles)
    async for i, ev in merge_events(handles):
        if isinstance(ev, TokenEvent):
            lp = None
            if ev.logprob is not None:
                lp = chat_logprobs([ev.logprob], service.tokenizer.token_strings)
            if ev.text or lp is not None:
                yield chunk(i, {"content": ev.text}, logprobs=lp)
            continue
        if ev.reason == FinishReason.CANCELLED:
            return
        record_finish(request, ev)
        if ev.reason == FinishReason.ERROR:
            yield sse(error_body(500, "the model failed while generating this request"))
            break
        finishes[i] = ev
        yield chunk(i, {}, finish=finish_reason(ev))
    if chat.include_usage and all(f is not None for f in finishes):
        first = finishes[0]
        n_completion = sum(f.completion_tokens for f in finishes if f is not None)
        yield sse(
            {
                **base,
                "choices": [],
                "usage": usage(first.prompt_tokens, n_completion, first.cached_tokens),
            }
        )
    yield sse("[DONE]")
