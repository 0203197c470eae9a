"""Send a request log to a server (an in-process ASGI app or a URL) and compare the answers.

Only the HTTP schema is used: each logged request body is POSTed to its endpoint, streams are
aggregated like the recorder does, and the body is compared with the logged one. Serial by
default; `concurrent=True` sends every request at once so the server's scheduler batches them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from replay.compare import Difference, compare, is_deterministic
from replay.log import CorruptLine, LogEntry, RequestLog
from replay.report import Report, RequestResult, build_report
from replay.sse import aggregate, sse_events

MAX_RETRIES = 30  # 429 answers retried per request (the logged request had been admitted)
MAX_RETRY_WAIT = 2.0  # seconds; caps the server's Retry-After
REQUEST_TIMEOUT = 600.0  # seconds per request
SAMPLE_INTERVAL = 0.005  # seconds between /health reads while watching rows busy


@dataclass(frozen=True)
class Answer:
    """What the server answered to one replayed request."""

    status: int
    body: dict | None
    latency: float  # seconds, first byte sent to last byte read, across retries
    retries: int = 0
    error: str | None = None  # the transport failed (no status)


def _http():
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx ships with the dev extra
        raise SystemExit("replay needs httpx: pip install httpx") from None
    return httpx


async def replay_app(
    app,
    log: RequestLog,
    concurrent: bool = False,
    api_key: str | None = None,
    max_rows_busy: Callable[[], int] | None = None,
    source: str = "in-process",
) -> Report:
    """Replay `log` through the ASGI `app` in this process (no socket)."""
    httpx = _http()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://replay", timeout=REQUEST_TIMEOUT
    ) as client:
        return await replay_client(client, log, concurrent, api_key, max_rows_busy, source)


async def replay_url(
    url: str, log: RequestLog, concurrent: bool = False, api_key: str | None = None
) -> Report:
    """Replay `log` against a live server at `url` over HTTP."""
    httpx = _http()
    limits = httpx.Limits(max_connections=max(len(log.entries), 1) if concurrent else 1)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits) as client:
        return await replay_client(client, log, concurrent, api_key, None, url)


async def replay_client(
    client,
    log: RequestLog,
    concurrent: bool,
    api_key: str | None,
    max_rows_busy: Callable[[], int] | None,
    source: str,
) -> Report:
    """Replay through an httpx.AsyncClient; rows busy come from `max_rows_busy` or /health."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sampler = None if max_rows_busy is not None else RowsBusySampler(client)
    if sampler is not None:
        sampler.start()
    chain = ResponseChain(log.entries)
    started = time.perf_counter()
    try:
        if concurrent:
            answers = await asyncio.gather(*(send(client, e, headers, chain) for e in log.entries))
        else:
            answers = [await send(client, e, headers, chain) for e in log.entries]
    finally:
        wall = time.perf_counter() - started
        busy = max_rows_busy() if max_rows_busy is not None else await sampler.stop()
    results = [result(e, a) for e, a in zip(log.entries, answers, strict=True)]
    return build_report(results, log.corrupt, wall, concurrent, busy, source)


def result(entry: LogEntry, answer: Answer) -> RequestResult:
    """Compare one answer with its log entry."""
    if answer.error is not None:
        diff: Difference | None = Difference(
            "transport", logged=entry.status, replayed=answer.error
        )
    else:
        diff = compare(entry.endpoint, entry.status, entry.response, answer.status, answer.body)
    usage = (answer.body or {}).get("usage") or {}
    fingerprint = (answer.body or {}).get("system_fingerprint")
    return RequestResult(
        line=entry.line,
        endpoint=entry.endpoint,
        stream=entry.stream,
        deterministic=is_deterministic(entry.endpoint, entry.request),
        logged_status=entry.status,
        status=answer.status,
        identical=diff is None,
        difference=diff,
        latency=answer.latency,
        logged_latency=entry.timings.total,
        completion_tokens=int(usage.get("completion_tokens") or usage.get("output_tokens") or 0),
        retries=answer.retries,
        fingerprint=fingerprint,
        logged_fingerprint=entry.fingerprint,
        error=answer.error,
    )


def request_body(entry: LogEntry) -> dict:
    """The body to send: the logged one, with usage asked for on streams (for tokens/s)."""
    body = dict(entry.request)
    if entry.stream and entry.endpoint.endswith("completions"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return body


async def send(
    client, entry: LogEntry, headers: dict[str, str], chain: ResponseChain | None = None
) -> Answer:
    """POST one logged request; retry 429s unless the log itself recorded a 429."""
    body = request_body(entry)
    if chain is None:
        return await _post(client, entry, body, headers)
    body = await chain.before(body)
    answer = None
    try:
        answer = await _post(client, entry, body, headers)
    finally:
        chain.after(entry, answer)  # dependents wait on this, even when the send failed
    return answer


async def _post(client, entry: LogEntry, body: dict, headers: dict[str, str]) -> Answer:
    started = time.perf_counter()
    retries = 0
    while True:
        try:
            resp = await client.post(entry.endpoint, json=body, headers=headers)
        except Exception as exc:  # noqa: BLE001 - a transport failure is this request's result
            return Answer(0, None, time.perf_counter() - started, retries, f"{exc!r}")
        if resp.status_code != 429 or entry.status == 429 or retries >= MAX_RETRIES:
            break
        retries += 1
        await asyncio.sleep(_retry_after(resp.headers.get("retry-after")))
    latency = time.perf_counter() - started
    return Answer(resp.status_code, _body(entry, resp), latency, retries)


class ResponseChain:
    """Stored-response ids across a replay: a logged `previous_response_id` names a response of
    the logged run; the replayed request names the replayed response instead (and, sent
    concurrently, waits for it)."""

    def __init__(self, entries: list[LogEntry]) -> None:
        loop = asyncio.get_running_loop()
        self._ids: dict[str, asyncio.Future[str | None]] = {}
        for e in entries:
            rid = (e.response or {}).get("id") if e.endpoint == "/v1/responses" else None
            if isinstance(rid, str):
                self._ids[rid] = loop.create_future()

    async def before(self, body: dict) -> dict:
        prev = body.get("previous_response_id")
        future = self._ids.get(prev) if isinstance(prev, str) else None
        if future is None:
            return body
        replayed = await future
        return {**body, "previous_response_id": replayed or prev}

    def after(self, entry: LogEntry, answer: Answer | None) -> None:
        rid = (entry.response or {}).get("id")
        future = self._ids.get(rid) if isinstance(rid, str) else None
        if future is not None and not future.done():
            new = ((answer.body if answer else None) or {}).get("id")
            future.set_result(new if isinstance(new, str) else None)


def _retry_after(header: str | None) -> float:
    try:
        return min(max(float(header or 1.0), 0.0), MAX_RETRY_WAIT)
    except ValueError:
        return 1.0


def _body(entry: LogEntry, resp) -> dict | None:
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return aggregate(entry.endpoint, sse_events(resp.content))
    try:
        body = resp.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


class RowsBusySampler:
    """Watch `rows_busy` on /health while a replay runs; the highest value seen."""

    def __init__(self, client) -> None:
        self._client = client
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self.highest: int | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                resp = await self._client.get("/health")
                busy = resp.json().get("rows_busy")
            except Exception:  # noqa: BLE001 - /health is optional for a replay
                return
            if isinstance(busy, int):
                self.highest = max(self.highest or 0, busy)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), SAMPLE_INTERVAL)

    async def stop(self) -> int | None:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.highest


__all__ = ["CorruptLine", "replay_app", "replay_url"]
