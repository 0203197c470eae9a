"""Collecting generation events into OpenAI response bodies and SSE chunks."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from starlette.requests import Request

from llm_server.decoding import FinishReason, TokenLogprob
from llm_server.scheduler import FinishEvent, TokenEvent
from llm_server.service import GenerationHandle


@dataclass
class Collected:
    """A whole generation, gathered from its events."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishEvent | None = None


async def collect(handle: GenerationHandle, request: Request | None = None) -> Collected:
    """Gather all events; a client disconnect cancels the request (S5)."""
    out = Collected()

    async def gather() -> None:
        async for ev in handle.events():
            if isinstance(ev, TokenEvent):
                out.text += ev.text
                out.token_ids.append(ev.token_id)
                if ev.logprob is not None:
                    out.logprobs.append(ev.logprob)
            else:
                out.text += ev.text
                out.finish = ev

    task = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(wait_disconnect(request)) if request is not None else None
    try:
        if watcher is None:
            await task
        else:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                handle.cancel()
                await task
    finally:
        if watcher is not None:
            watcher.cancel()
        if not task.done():
            task.cancel()
            handle.cancel()
    return out


async def wait_disconnect(request: Request) -> None:
    """Return when the client goes away (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def finish_reason(ev: FinishEvent) -> str:
    if ev.reason in (FinishReason.STOP, FinishReason.LENGTH):
        return ev.reason.value
    return "stop"


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def chat_logprobs(entries: list[TokenLogprob], token_str) -> dict:
    """The OpenAI chat `logprobs` object for `entries`."""

    def one(tid: int, lp: float) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
            for e in entries
        ],
        "refusal": None,
    }
