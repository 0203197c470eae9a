"""POST /v1/responses (OpenAI Responses), GET and DELETE /v1/responses/{id}.

An adapter: the body becomes a chat request (input.py), which runs on the one chat path
(api/chat/run.py: plan, admission, generation, output parsing); the answer becomes output items
(output.py), returned whole or streamed as typed events with `sequence_number`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llm_server.api.chat.plan import ChatPlan
from llm_server.api.chat.run import Finished, Started, answer_deltas, new_id, start_chat
from llm_server.api.openai.responses.input import (
    ResponsesRequest,
    parse_responses,
    unknown_response,
)
from llm_server.api.openai.responses.output import CALL_ITEMS, OutputItems
from llm_server.api.openai.responses.store import ResponseStore
from llm_server.api.shared.errors import APIError, invalid
from llm_server.api.shared.handling import (
    check_model,
    failure_message,
    get_service,
    read_json,
    served_id,
    settle,
)
from llm_server.api.shared.images import with_images
from llm_server.api.shared.streaming import Collected, collect_many
from llm_server.decoding import FinishReason
from llm_server.scheduler import FinishEvent
from llm_server.tools.output import ChatOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DROPPED_HEADER = "x-llm-server-dropped-tools"  # hosted tool types left out of the prompt


def response_store(request: Request) -> ResponseStore:
    """The app's store of responses (made on first use)."""
    state = request.app.state
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


def _previous(
    store: ResponseStore, prev_id: Any
) -> tuple[tuple[dict[str, Any], ...], frozenset[str]]:
    """The stored conversation `previous_response_id` continues, and the ids of the calls its
    response left incomplete (not in that conversation; an output for one is left out too)."""
    if prev_id is None:
        return (), frozenset()
    if not isinstance(prev_id, str):
        raise invalid("previous_response_id", "'previous_response_id' must be a string")
    stored = store.get(prev_id)
    if stored is None:
        raise unknown_response(prev_id, "previous_response_id")
    output = stored.response["output"]
    cut = {o["call_id"] for o in output if o["type"] in CALL_ITEMS and o["status"] == "incomplete"}
    return stored.messages, frozenset(cut)


async def create_response(request: Request) -> Response:
    service = get_service(request)
    body = await read_json(request)
    store = response_store(request)
    previous, cut = _previous(store, body.get("previous_response_id"))
    req = parse_responses(body, service, previous, cut)
    check_model(service, req.chat.model, served_id(request))
    chat = await with_images(request, service, req.chat, served_id(request))  # kept as sent
    try:
        started = await start_chat(service, chat, "input")  # 429 before any byte (S3)
    except APIError as exc:  # a grammar or template error names the chat field
        exc.param = req.param(exc.param)
        raise
    head = {
        "id": new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": served_id(request),
        **req.echo,
        "store": req.store,
    }
    headers = {DROPPED_HEADER: ",".join(req.tools.dropped)} if req.tools.dropped else {}
    if req.chat.stream:
        return StreamingResponse(
            _stream(request, store, req, started, head),
            media_type="text/event-stream",
            headers=SSE_HEADERS | headers,
        )
    (out,) = await collect_many(started.handles, request)
    if (early := settle(request, [out.finish])) is not None:
        return early
    items, answer = _whole(req, started.plan, out)
    response = _finished(head, _status(out.finish), items.items, out.finish, answer)
    _keep(store, req, response, items)
    return JSONResponse(response, headers=headers)


def _whole(req: ResponsesRequest, plan: ChatPlan, out: Collected) -> tuple[OutputItems, ChatOutput]:
    """The output items of a collected answer, built as the stream builds them."""
    answer = plan.output()
    items = OutputItems(req.summary, req.tools)
    for piece in out.pieces:
        for delta in answer.feed(piece):
            items.feed(delta)
    for delta in answer.finish(cut=out.finish.reason == FinishReason.LENGTH):
        items.feed(delta)
    items.finish(_status(out.finish), answer)
    return items, answer


async def get_response(request: Request) -> Response:
    rid = request.path_params["response_id"]
    stored = response_store(request).get(rid)
    if stored is None:
        raise unknown_response(rid)
    return JSONResponse(stored.response)


async def delete_response(request: Request) -> Response:
    rid = request.path_params["response_id"]
    if not response_store(request).delete(rid):
        raise unknown_response(rid)
    return JSONResponse({"id": rid, "object": "response", "deleted": True})


def _status(fin: FinishEvent) -> str:
    return "incomplete" if fin.reason == FinishReason.LENGTH else "completed"


def _finished(
    head: dict, status: str, output: list, fin: FinishEvent, answer: ChatOutput
) -> dict[str, Any]:
    return {
        **head,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": {
            "input_tokens": fin.prompt_tokens,
            "input_tokens_details": {"cached_tokens": fin.cached_tokens},
            "output_tokens": fin.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
            "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        },
    }


def _keep(store: ResponseStore, req: ResponsesRequest, response: dict, items: OutputItems) -> None:
    """Store the response and the conversation through its answer (when `store`)."""
    if req.store:  # an answer with nothing left in it (a cut call alone) adds no turn
        reply = items.reply()
        empty = not (reply["content"] or reply.get("tool_calls") or reply.get("reasoning_content"))
        store.put(response, req.history + (() if empty else (reply,)))


def _event(seq: int, event: dict) -> str:
    body = {"type": event["type"], "sequence_number": seq, **event}
    return f"event: {event['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _stream(
    request: Request, store: ResponseStore, req: ResponsesRequest, started: Started, head: dict
) -> AsyncIterator[str]:
    """response.created, response.in_progress, the items' events, then response.completed
    (response.incomplete at the token limit, response.failed when the model failed)."""
    seq = 0

    def emit(event: dict) -> str:
        nonlocal seq
        seq += 1
        return _event(seq - 1, event)

    pending = {**head, "status": "in_progress", "error": None, "incomplete_details": None}
    pending |= {"output": [], "usage": None}
    yield emit({"type": "response.created", "response": pending})
    yield emit({"type": "response.in_progress", "response": pending})
    items = OutputItems(req.summary, req.tools)
    (handle,) = started.handles
    async for delta in answer_deltas(request, handle, started.plan):
        if not isinstance(delta, Finished):
            for event in items.feed(delta):
                yield emit(event)
            continue
        if delta.event.reason == FinishReason.ERROR:
            failed = {**pending, "status": "failed", "output": items.items}
            status, message = failure_message(delta.event, "response")
            code = "insufficient_memory" if status == 503 else "server_error"
            failed["error"] = {"code": code, "message": message}
            yield emit({"type": "response.failed", "response": failed})
            return
        status = _status(delta.event)
        for event in items.finish(status, delta.answer):
            yield emit(event)
        response = _finished(head, status, items.items, delta.event, delta.answer)
        _keep(store, req, response, items)
        yield emit({"type": f"response.{status}", "response": response})
