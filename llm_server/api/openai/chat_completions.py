"""POST /v1/chat/completions: parse, plan (template, grammar, parsers), admit, then JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llm_server.api.chat.plan import ChatPlan
from llm_server.api.chat.run import assemble, start_chat
from llm_server.api.openai.logprobs import chat_logprobs
from llm_server.api.shared.errors import invalid
from llm_server.api.shared.handling import (
    check_model,
    get_service,
    read_json,
    record_finish,
    served_id,
    settle,
    stream_failure,
    usage,
)
from llm_server.api.shared.images import with_images
from llm_server.api.shared.schemas import ChatRequest, parse_chat
from llm_server.api.shared.streaming import collect_many, finish_reason, merge_events, sse
from llm_server.decoding import FinishReason
from llm_server.scheduler import FinishEvent, TokenEvent
from llm_server.service import GenerationHandle, ModelService
from llm_server.tools.output import ChatOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def chat_completions(request: Request) -> Response:
    service = get_service(request)
    body = await read_json(request)
    chat = parse_chat(
        body, service.config.default_max_tokens, service.token_id_limit, service.sampling_defaults
    )
    check_model(service, chat.model, served_id(request))
    chat = await with_images(request, service, chat, served_id(request))
    if not any(m["content"] or m.get("tool_calls") for m in chat.messages):
        raise invalid("messages", "every message is empty; send some content")
    # every choice admitted before any SSE byte (S3), all or none
    started = await start_chat(service, chat)
    plan, handles = started.plan, started.handles
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if chat.stream:
        return StreamingResponse(
            _chat_stream(request, service, handles, chat, plan, rid, created),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    outs = await collect_many(handles, request)
    if (early := settle(request, [o.finish for o in outs])) is not None:
        return early
    choices, answers = [], []
    for i, out in enumerate(outs):
        answer = assemble(plan, out)
        answers.append(answer)
        choice = {
            "index": i,
            "message": answer.message(),
            "finish_reason": answer.finish_reason(finish_reason(out.finish)),
            "logprobs": None,
        }
        if chat.params.logprobs:
            choice["logprobs"] = chat_logprobs(out.logprobs, service.tokenizer.token_strings)
        choices.append(choice)
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": served_id(request),
            "system_fingerprint": service.fingerprint,
            "choices": choices,
            "usage": _usage([o.finish for o in outs], answers),
        }
    )


def _usage(finishes: list[FinishEvent], answers: list[ChatOutput]) -> dict:
    """The prompt counts once whatever n is; completion (and reasoning) tokens add up."""
    first = finishes[0]
    completion = sum(f.completion_tokens for f in finishes)
    out = usage(first.prompt_tokens, completion, first.cached_tokens)
    if answers[0].splitter is not None:
        reasoning = sum(a.reasoning_tokens for a in answers)
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    if all(f.prediction is not None for f in finishes):  # the request sent `prediction`
        out.setdefault("completion_tokens_details", {}).update(
            accepted_prediction_tokens=sum(f.prediction.accepted for f in finishes),
            rejected_prediction_tokens=sum(f.prediction.rejected for f in finishes),
        )
    return out


async def _chat_stream(
    request: Request,
    service: ModelService,
    handles: list[GenerationHandle],
    chat: ChatRequest,
    plan: ChatPlan,
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

    answers = [plan.output() for _ in handles]
    for i in range(len(handles)):
        yield chunk(i, {"role": "assistant", "content": ""})
    finishes: list[FinishEvent | None] = [None] * len(handles)
    async for i, ev in merge_events(handles):
        answer = answers[i]
        if isinstance(ev, TokenEvent):
            lp = None
            if ev.logprob is not None:
                lp = chat_logprobs([ev.logprob], service.tokenizer.token_strings)
            deltas = answer.feed(ev.text)
            if answer.plain:  # no parsing: one content delta per token
                deltas = [{"content": ev.text}] if ev.text or lp is not None else []
            for j, delta in enumerate(deltas):
                yield chunk(i, delta, logprobs=lp if j == 0 else None)
            if lp is not None and not deltas:
                yield chunk(i, {}, logprobs=lp)
            continue
        if ev.reason == FinishReason.CANCELLED:
            return
        record_finish(request, ev)
        if ev.reason == FinishReason.ERROR:
            yield sse(stream_failure(ev))
            break
        finishes[i] = ev
        for delta in answer.finish(cut=ev.reason == FinishReason.LENGTH):
            yield chunk(i, delta)
        yield chunk(i, {}, finish=answer.finish_reason(finish_reason(ev)))
    if chat.include_usage and all(f is not None for f in finishes):
        yield sse({**base, "choices": [], "usage": _usage(finishes, answers)})
    yield sse("[DONE]")
