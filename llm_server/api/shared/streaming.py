"""Collecting generation events into OpenAI response bodies and SSE chunks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from llm_server.decoding import FinishReason, TokenLogprob
from llm_server.scheduler import FinishEvent, TokenEvent
from llm_server.service import GenerationHandle


@dataclass
class Collected:
    """A whole generation, gathered from its events."""

    text: str = ""
    pieces: list[str] = field(default_factory=list)  # each token's text, in order
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishEvent | None = None


def _fold(out: Collected, ev: TokenEvent | FinishEvent) -> None:
    if isinstance(ev, TokenEvent):
        out.pieces.append(ev.text)
        out.text += ev.text
        out.token_ids.append(ev.token_id)
        if ev.logprob is not None:
            out.logprobs.append(ev.logprob)
    else:
        out.finish = ev


async def collect_many(
    handles: list[GenerationHandle], request: Request | None = None
) -> list[Collected]:
    """Gather several generations at once; a client disconnect cancels all of them (S5)."""
    outs = [Collected() for _ in handles]

    async def gather(handle: GenerationHandle, out: Collected) -> None:
        async for ev in handle.events():
            _fold(out, ev)

    work = asyncio.ensure_future(
        asyncio.gather(*(gather(h, o) for h, o in zip(handles, outs, strict=True)))
    )
    watcher = asyncio.ensure_future(wait_disconnect(request)) if request is not None else None
    try:
        waiting = {work} if watcher is None else {work, watcher}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            for h in handles:
                h.cancel()
        await work
    finally:
        if watcher is not None:
            watcher.cancel()
        if not work.done():
            work.cancel()
            for h in handles:
                h.cancel()
    return outs


async def merge_events(
    handles: list[GenerationHandle],
) -> AsyncIterator[tuple[int, TokenEvent | FinishEvent]]:
    """Events of several generations as they arrive, tagged with the handle's index."""
    queue: asyncio.Queue[tuple[int, TokenEvent | FinishEvent]] = asyncio.Queue()

    async def pump(i: int, handle: GenerationHandle) -> None:
        async for ev in handle.events():
            await queue.put((i, ev))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    remaining = len(handles)
    try:
        while remaining:
            i, ev = await queue.get()
            if isinstance(ev, FinishEvent):
                remaining -= 1
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            h.cancel()


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
