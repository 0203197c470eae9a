"""`--log-requests FILE`: one JSON line per finished API request (format: replay/log.py).

An ASGI middleware sees the request body and the response as sent (streams are aggregated into
the equivalent non-stream body); the scheduler timings come from the generation handles the
request started. Lines are written by a background thread, so the event loop never blocks on
the file; `close()` writes every queued line before it returns. Headers are never logged.
"""

from __future__ import annotations

import contextvars
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_server.api.shared.recent import RecentRequests, served_model, summary_from_log
from llm_server.api.shared.state import AppState
from llm_server.scheduler import FinishEvent
from replay.log import LogEntry, Timings, utc_now
from replay.sse import aggregate, sse_events

log = logging.getLogger(__name__)

LOGGED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
    }
)
MAX_LOGGED_BODY = 16 << 20  # bytes of request or response kept; larger requests are not logged
_STOP = object()


class RequestRecorder:
    """Appends log lines to `path` from a background thread."""

    def __init__(self, path: str | Path, secret: str | None = None) -> None:
        self.path = Path(path)
        self._secret = secret  # redacted if it ever appears in a line
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - owned by the thread
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def set_secret(self, secret: str | None) -> None:
        """Redact `secret` (the server's API key) wherever it appears in a line."""
        self._secret = secret or self._secret

    def write(self, entry: LogEntry) -> None:
        """Queue one line (never blocks); after close() the line is appended synchronously."""
        with self._lock:
            if not self._closed:
                self._queue.put_nowait(entry)
                return
        with open(self.path, "a", encoding="utf-8") as f:  # a straggler finishing after close
            f.write(self._line(entry))

    def close(self, timeout: float | None = 30.0) -> None:
        """Write every queued line, flush and close the file (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put_nowait(_STOP)
        self._thread.join(timeout)

    def _line(self, entry: LogEntry) -> str:
        text = entry.to_json()
        if self._secret:
            text = text.replace(self._secret, "[redacted]")
        return text + "\n"

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _STOP:
                    return
                try:
                    self._file.write(self._line(item))
                except (OSError, TypeError, ValueError) as exc:
                    log.error("request log %s: cannot write a line: %s", self.path, exc)
                if self._queue.empty():  # flush when caught up: one flush per burst
                    self._file.flush()
        finally:
            self._file.flush()
            self._file.close()


@dataclass
class _Exchange:
    """One logged request while it is in flight."""

    started: float = field(default_factory=time.monotonic)
    time: str = field(default_factory=utc_now)
    body: bytearray = field(default_factory=bytearray)
    status: int | None = None
    content_type: str = ""
    response: bytearray = field(default_factory=bytearray)
    finishes: list[tuple[float, FinishEvent]] = field(default_factory=list)  # (when, event)


_current: contextvars.ContextVar[_Exchange | None] = contextvars.ContextVar(
    "llm_request_log", default=None
)


def note_finish(fin: FinishEvent) -> None:
    """Called by the routes for every finished generation: the log takes its scheduler timings."""
    exchange = _current.get()
    if exchange is not None:
        exchange.finishes.append((time.monotonic(), fin))


class RequestLogMiddleware:
    """Record every POST to the API routes in LOGGED_PATHS into `recorder` (and its summary
    into `recent`, the page's list of requests, when given)."""

    def __init__(
        self,
        app: ASGIApp,
        recorder: RequestRecorder,
        state: AppState,
        recent: RecentRequests | None = None,
    ) -> None:
        self.app = app
        self.recorder = recorder
        self.state = state
        self.recent = recent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in LOGGED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        ex = _Exchange()

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(ex.body) <= MAX_LOGGED_BODY:
                ex.body += message.get("body", b"")
            return message

        async def send_response(message: Message) -> None:
            if message["type"] == "http.response.start":
                ex.status = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == b"content-type":
                        ex.content_type = value.decode("latin-1")
            elif message["type"] == "http.response.body" and len(ex.response) <= MAX_LOGGED_BODY:
                ex.response += message.get("body", b"")
            await send(message)

        token = _current.set(ex)
        try:
            await self.app(scope, receive_body, send_response)
        except BaseException:
            ex.status = ex.status or 500
            raise
        finally:
            _current.reset(token)
            entry = self._entry(scope["path"], ex)
            if entry is not None:
                self.recorder.write(entry)
                if self.recent is not None:
                    self.recent.add(summary_from_log(entry, served_model(scope, self.state)))

    def _entry(self, path: str, ex: _Exchange) -> LogEntry | None:
        total = time.monotonic() - ex.started
        try:
            request = json.loads(bytes(ex.body))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None  # not replayable; the client got a 400 or 413 for it
        if not isinstance(request, dict):
            return None
        stream = ex.content_type.startswith("text/event-stream")
        response = _response(path, bytes(ex.response), stream)
        if response is not None and stream and response.get("usage") is None:
            response["usage"] = _usage([fin for _, fin in ex.finishes])
        fingerprint = (response or {}).get("system_fingerprint")
        if fingerprint is None and self.state.service is not None:
            fingerprint = self.state.service.fingerprint or None
        return LogEntry(
            endpoint=path,
            request=request,
            response=response,
            status=ex.status or 500,
            stream=stream or bool(request.get("stream")),
            timings=_timings(ex, total),
            fingerprint=fingerprint,
            time=ex.time,
        )


def _response(path: str, raw: bytes, stream: bool) -> dict | None:
    if stream:
        return aggregate(path, sse_events(raw))
    try:
        body = json.loads(raw) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _usage(finishes: list[FinishEvent]) -> dict | None:
    """Token counts from the scheduler when a stream did not ask for a usage chunk."""
    if not finishes:
        return None
    prompt = sum(f.prompt_tokens for f in finishes)
    completion = sum(f.completion_tokens for f in finishes)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _timings(ex: _Exchange, total: float) -> Timings:
    """Scheduler queue wait and time to first token (from arrival) of the request's first row."""
    waits, firsts = [], []
    for when, fin in ex.finishes:
        t = fin.timings
        if t.queue_wait is not None:
            waits.append(t.queue_wait)
        if t.first_token is not None:
            submitted = (when - ex.started) - t.total  # arrival -> submission to the scheduler
            firsts.append(submitted + t.first_token)
    return Timings(
        queue_wait=min(waits) if waits else None,
        first_token=min(firsts) if firsts else None,
        total=total,
    )
