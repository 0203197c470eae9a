"""POST /v1/messages (Anthropic Messages) and POST /v1/messages/count_tokens.

An adapter: the body becomes a chat request (input.py), which runs on the one chat path
(api/chat/run.py: plan, admission, generation, output parsing); the answer becomes content blocks
(output.py), returned whole or streamed as Anthropic's events. Errors, including 429s
and the engine's, use Anthropic's error body; a message names its field (the body has no
`param`), and context errors are in Anthropic's words so clients compact or lower `max_tokens`.
`max_tokens` is never capped here: a prompt and `max_tokens` that do not fit are a 400.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llm_server.api.anthropic.input import messages_param, parse_messages_request
from llm_server.api.anthropic.output import ContentBlocks
from llm_server.api.chat.plan import chat_prompt
from llm_server.api.chat.run import (
    TAIL,
    Finished,
    Started,
    answer_deltas,
    assemble,
    final_deltas,
    new_id,
    start_chat,
)
from llm_server.api.shared.errors import (
    APIError,
    anthropic_error,
    anthropic_error_body,
    invalid,
    note_refusal,
)
from llm_server.api.shared.handling import (
    check_model,
    failure_message,
    get_service,
    read_json,
    served_id,
    settle,
)
from llm_server.api.shared.images import with_images
from llm_server.api.shared.streaming import collect_many
from llm_server.decoding import FinishReason
from llm_server.scheduler import FinishEvent
from llm_server.service import ModelService

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CONTEXT_ERROR = "context_length_exceeded"


async def create_message(request: Request) -> Response:
    try:
        return await _create(request)
    except APIError as exc:
        return _refused(request, exc)


def _refused(request: Request, exc: APIError) -> Response:
    """Anthropic's error body for `exc`; the field goes to the 4xx log line too."""
    message = _named(exc)
    note_refusal(request, exc)
    return anthropic_error(exc.status, message, exc.headers)


def _named(exc: APIError) -> str:
    """The message, led by the field it is about unless it names it already (context errors
    keep Anthropic's exact words: clients parse them)."""
    if exc.param and exc.param not in exc.message and exc.code != CONTEXT_ERROR:
        return f"{exc.param}: {exc.message}"
    return exc.message


def check_context(service: ModelService, prompt_tokens: int, max_tokens: int) -> None:
    """400 in Anthropic's words for a prompt, or prompt plus `max_tokens`, over the context."""
    ctx = service.context_length
    if prompt_tokens == 0:
        raise invalid("messages", "'messages' make an empty prompt; send at least one token")
    if prompt_tokens > ctx:
        raise APIError(
            400,
            f"prompt is too long: {prompt_tokens} tokens > {ctx} maximum",
            param="messages",
            code=CONTEXT_ERROR,
        )
    if prompt_tokens + max_tokens > ctx:
        raise APIError(
            400,
            f"input length and `max_tokens` exceed context limit: {prompt_tokens} + "
            f"{max_tokens} > {ctx}, decrease input length or `max_tokens` and try again",
            param="max_tokens",
            code=CONTEXT_ERROR,
        )


async def count_tokens(request: Request) -> Response:
    """`{"input_tokens": N}`: the prompt a /v1/messages request with this body would send."""
    try:
        service = get_service(request)
        body = await read_json(request)
        chat = parse_messages_request(body, service, count_only=True)
        check_model(service, chat.model, served_id(request))
        chat = await with_images(request, service, chat, served_id(request))
        prompt = chat_prompt(service, chat)
    except APIError as exc:
        return _refused(request, exc)
    return JSONResponse({"input_tokens": len(prompt)})


async def _create(request: Request) -> Response:
    service = get_service(request)
    body = await read_json(request)
    chat = parse_messages_request(body, service)
    check_model(service, chat.model, served_id(request))
    chat = await with_images(request, service, chat, served_id(request))
    try:  # context errors, then a 429, before any byte (S3)
        started = await start_chat(
            service, chat, check_length=lambda n: check_context(service, n, chat.params.max_tokens)
        )
    except APIError as exc:  # planning names chat fields (response_format: output_config.format)
        exc.param = messages_param(exc.param)
        raise
    head = {
        "id": new_id("msg"),
        "type": "message",
        "role": "assistant",
        "model": served_id(request),
    }
    if chat.stream:
        return StreamingResponse(
            _stream(request, service, started, head, chat.params.stop),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    (out,) = await collect_many(started.handles, request)
    if (early := settle(request, [out.finish])) is not None:
        return early
    answer = assemble(started.plan, out)
    blocks = ContentBlocks()
    for delta in final_deltas(answer):
        blocks.feed(delta)
    blocks.finish(answer.called)
    reason, sequence = _stop_reason(
        service, chat.params.stop, out.finish, blocks, out.token_ids[-TAIL:]
    )
    return JSONResponse(
        {
            **head,
            "content": blocks.blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _final_usage(out.finish),
        }
    )


def _usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic counts prompt tokens read from the (prefix) cache apart from input_tokens;
    writing the cache costs nothing extra here, so no token is counted as cache creation."""
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def _final_usage(fin: FinishEvent) -> dict[str, int]:
    return _usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)


def _stop_reason(
    service: ModelService,
    stops: tuple[str, ...],
    fin: FinishEvent,
    blocks: ContentBlocks,
    tail: Sequence[int],
) -> tuple[str, str | None]:
    """end_turn, max_tokens, tool_use or stop_sequence (with the sequence that matched); a
    call cut by max_tokens is max_tokens (its block was dropped)."""
    if blocks.tool_uses and not blocks.dropped:
        return "tool_use", None
    if fin.reason == FinishReason.LENGTH:
        return "max_tokens", None
    if not stops or not tail or tail[-1] in service.tokenizer.eos_token_ids:
        return "end_turn", None
    text = service.tokenizer.decode(tail, skip_special_tokens=False)
    hits = [s for s in stops if s in text]
    if not hits:  # a grammar completed the answer
        return "end_turn", None
    return "stop_sequence", max(hits, key=text.rfind)


def _event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _stream(
    request: Request,
    service: ModelService,
    started: Started,
    head: dict,
    stops: tuple[str, ...],
) -> AsyncIterator[str]:
    """message_start and ping at once, the blocks' events, message_delta (stop_reason, usage),
    message_stop; an `error` event when the model fails. message_start comes before the prompt
    is read, so its usage counts the whole prompt as input; message_delta's usage (cumulative,
    as Anthropic's) splits off the tokens the prefix cache gave (cache_read_input_tokens)."""
    usage = _usage(len(started.plan.prompt), 0, 0)
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield _event({"type": "message_start", "message": message})
    yield _event({"type": "ping"})
    blocks = ContentBlocks()
    (handle,) = started.handles
    async for delta in answer_deltas(request, handle, started.plan):
        if not isinstance(delta, Finished):
            for event in blocks.feed(delta):
                yield _event(event)
            continue
        if delta.event.reason == FinishReason.ERROR:  # 503 overloaded: the budget refused
            yield _event(anthropic_error_body(*failure_message(delta.event, "message")))
            return
        for event in blocks.finish(delta.answer.called):
            yield _event(event)
        reason, sequence = _stop_reason(service, stops, delta.event, blocks, delta.tail)
        yield _event(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": _final_usage(delta.event),
            }
        )
        yield _event({"type": "message_stop"})
