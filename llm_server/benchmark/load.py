"""Drive a fixed chat load against a server: streaming requests, at most N in flight at a time.

Time to first token is when the first non-empty content delta arrives (the end of the stream
when none does); the arrival of every content delta is kept for the inter-token gaps. Completion tokens come from the stream's final usage chunk
(`stream_options.include_usage`, which both servers send); if a server leaves it out, the content
is re-tokenized with the model's tokenizer and the record says so.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

REQUEST_TIMEOUT_S = 900.0
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello and count from one to ten."}]


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds from the start of the load."""

    index: int  # position in the load; the prompt is prompts[index % len(prompts)]
    prompt_id: str
    status: int | None = None
    error: str | None = None
    start_s: float = 0.0
    first_token_s: float | None = None
    end_s: float = 0.0
    completion_tokens: int = 0
    token_source: str = "usage"  # "usage" | "retokenized"
    finish_reason: str | None = None
    text: str = ""
    chunk_s: list[float] = field(default_factory=list)  # arrival of each content delta

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s


@dataclass
class LoadResult:
    concurrency: int
    max_tokens: int
    wall_s: float  # first request sent .. last response finished
    records: list[RequestRecord] = field(default_factory=list)


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]


DONE = "[DONE]"


def sse_chunk(line: str) -> dict | str | None:
    """One line of an SSE chat stream: its JSON chunk, DONE at `data: [DONE]`, None for a line
    that carries no data."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return DONE if data == DONE else json.loads(data)


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    """A greedy streaming chat request; no `model`, so each server uses the one it loaded."""
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    rec: RequestRecord,
    t0: float,
    count_tokens: Callable[[str], int],
) -> None:
    rec.start_s = time.perf_counter() - t0
    parts: list[str] = []
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return
            async for line in resp.aiter_lines():
                chunk = sse_chunk(line)
                if chunk is None:
                    continue
                if chunk is DONE:
                    break
                if "error" in chunk:
                    rec.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter() - t0
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                        rec.chunk_s.append(now)
                        parts.append(content)
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end_s = time.perf_counter() - t0
        rec.text = "".join(parts)
    if rec.first_token_s is None and rec.error is None:
        rec.first_token_s = rec.end_s  # no visible text until the end (e.g. held-back bytes)
    if usage and usage.get("completion_tokens") is not None:
        rec.completion_tokens = int(usage["completion_tokens"])
    else:
        rec.completion_tokens = count_tokens(rec.text)
        rec.token_source = "retokenized"


async def _run(
    url: str,
    prompts: list[Prompt],
    concurrency: int,
    requests: int,
    max_tokens: int,
    count_tokens: Callable[[str], int],
    on_done: Callable[[], None] | None,
) -> LoadResult:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(
        max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2
    )
    records = [RequestRecord(i, prompts[i % len(prompts)].id) for i in range(requests)]
    async with httpx.AsyncClient(
        trust_env=False, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:
        t0 = time.perf_counter()

        async def one(rec: RequestRecord) -> None:
            async with gate:
                body = chat_body(prompts[rec.index % len(prompts)].messages, max_tokens)
                await _stream_one(client, url, body, rec, t0, count_tokens)
            if on_done is not None:
                on_done()

        await asyncio.gather(*(one(r) for r in records))
        wall = max(r.end_s for r in records) - min(r.start_s for r in records)
    return LoadResult(concurrency, max_tokens, wall, records)


def run_load(
    url: str,
    prompts: list[Prompt],
    concurrency: int,
    requests: int,
    max_tokens: int,
    count_tokens: Callable[[str], int],
    on_done: Callable[[], None] | None = None,
) -> LoadResult:
    """Send `requests` chat requests (prompts in order, cycling), at most `concurrency` at once."""
    return asyncio.run(_run(url, prompts, concurrency, requests, max_tokens, count_tokens, on_done))


def warm_up(
    url: str, concurrency: int, max_tokens: int, count_tokens: Callable[[str], int]
) -> None:
    """`concurrency` simultaneous requests with a prompt outside the set (loads, compiles shapes)."""
    prompts = [Prompt("warm-up", WARMUP_MESSAGES)]
    result = run_load(url, prompts, concurrency, concurrency, max_tokens, count_tokens)
    failed = [r.error for r in result.records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")
