"""The last N API requests in memory (route, model, status, tokens, timings, a 4xx's reason) and
the latency percentiles of the last minute: what the page's Requests and Now views show.

With `--log-requests` on, the request log's entries feed the ring (one middleware records each
request); otherwise `RecentRequestsMiddleware` does, keeping only the summary, never a body.
"""

from __future__ import annotations

import contextvars
import itertools
import json
import time
from collections import deque
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_server.api.shared.state import MODEL_ID_KEY, AppState
from llm_server.scheduler import FinishEvent
from replay.log import LogEntry

RECENT_REQUESTS = 200  # requests the ring keeps
LATENCY_WINDOW = 60.0  # seconds of finished requests the percentiles cover
MAX_ERROR_BODY = 4096  # bytes of a 4xx/5xx body read for its reason
RECORDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")  # POSTs only: not the page's poll


@dataclass(frozen=True)
class RequestSummary:
    """One finished request as the page lists it (seconds; None where not known)."""

    time: float  # wall clock at arrival (unix seconds)
    route: str
    model: str | None
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft: float | None  # arrival -> first token
    duration: float  # arrival -> last byte sent
    reason: str | None  # the error message of a 4xx or 5xx

    @property
    def inter_token(self) -> float | None:
        """Mean seconds between the answer's tokens after the first."""
        if self.ttft is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return max(self.duration - self.ttft, 0.0) / (self.completion_tokens - 1)


class RecentRequests:
    """A bounded ring of `RequestSummary`, written and read on the event loop."""

    def __init__(self, size: int = RECENT_REQUESTS, source: str = "memory") -> None:
        self.entries: deque[RequestSummary] = deque(maxlen=size)
        self.source = source  # "memory" or "request log"

    def add(self, summary: RequestSummary) -> None:
        self.entries.append(summary)

    def latest(self, limit: int) -> list[dict]:
        """The newest `limit` first, as JSON objects."""
        newest = itertools.islice(reversed(self.entries), limit)
        return [dict(vars(s)) for s in newest]  # flat fields: no deep copy (asdict) needed

    def percentiles(self, now: float | None = None) -> dict[str, dict[str, float | None]]:
        """p50/p90/p99 of TTFT and inter-token latency over the last LATENCY_WINDOW seconds."""
        since = (now if now is not None else time.time()) - LATENCY_WINDOW
        window = [s for s in self.entries if s.time + s.duration >= since and s.status < 400]
        ttft = sorted(s.ttft for s in window if s.ttft is not None)
        itl = sorted(v for s in window if (v := s.inter_token) is not None)
        return {"ttft": _percentiles(ttft), "inter_token": _percentiles(itl)}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    def at(q: float) -> float | None:
        return values[min(int(q * len(values)), len(values) - 1)] if values else None

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "count": len(values)}


def recorded(scope: Scope) -> bool:
    return (
        scope["type"] == "http"
        and scope["method"] == "POST"
        and scope["path"].startswith(RECORDED_PREFIXES)
    )


@dataclass
class _Flight:
    """One request while it runs."""

    started: float = field(default_factory=time.monotonic)
    wall: float = field(default_factory=time.time)
    status: int = 500
    body: bytearray = field(default_factory=bytearray)
    finishes: list[tuple[float, FinishEvent]] = field(default_factory=list)


_flight: contextvars.ContextVar[_Flight | None] = contextvars.ContextVar(
    "llm_recent_request", default=None
)


def note_finish(fin: FinishEvent) -> None:
    """Called for every finished generation of the request in flight (its tokens and TTFT)."""
    flight = _flight.get()
    if flight is not None:
        flight.finishes.append((time.monotonic(), fin))


class RecentRequestsMiddleware:
    """Summarise every API POST into `recent` (used when the request log is off)."""

    def __init__(self, app: ASGIApp, recent: RecentRequests, state: AppState) -> None:
        self.app = app
        self.recent = recent
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not recorded(scope):
            await self.app(scope, receive, send)
            return
        flight = _Flight()

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                flight.status = message["status"]
            elif (
                message["type"] == "http.response.body"
                and flight.status >= 400
                and len(flight.body) < MAX_ERROR_BODY
            ):
                flight.body += message.get("body", b"")[:MAX_ERROR_BODY]
            await send(message)

        token = _flight.set(flight)
        try:
            await self.app(scope, receive, send_status)
        finally:
            _flight.reset(token)
            self.recent.add(self._summary(scope, flight))

    def _summary(self, scope: Scope, flight: _Flight) -> RequestSummary:
        duration = time.monotonic() - flight.started
        fins = [fin for _, fin in flight.finishes]
        return RequestSummary(
            time=flight.wall,
            route=scope["path"],
            model=served_model(scope, self.state),
            status=flight.status,
            prompt_tokens=sum(f.prompt_tokens for f in fins) if fins else None,
            completion_tokens=sum(f.completion_tokens for f in fins) if fins else None,
            ttft=_first_token(flight.finishes, flight.started),
            duration=duration,
            reason=error_reason(bytes(flight.body)) if flight.status >= 400 else None,
        )


def served_model(scope: Scope, state: AppState) -> str | None:
    """The model that served a request: the one its `model` resolved to, else the one model
    (None: many models and none resolved)."""
    return scope.get(MODEL_ID_KEY) or (state.model_id if state.manager is None else None)


def _first_token(finishes: list[tuple[float, FinishEvent]], started: float) -> float | None:
    """Arrival -> the first token of the request's earliest row (seconds)."""
    firsts = []
    for when, fin in finishes:
        t = fin.timings
        if t.first_token is not None:
            firsts.append((when - started) - t.total + t.first_token)
    return min(firsts) if firsts else None


def error_reason(body: bytes | dict | None) -> str | None:
    """The message of an OpenAI or Anthropic error body (None: not one)."""
    data = body
    if isinstance(body, bytes):
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            return body.decode("utf-8", "replace")[:200] or None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return None


def summary_from_log(entry: LogEntry, model: str | None) -> RequestSummary:
    """The ring's summary of a request-log line (--log-requests on)."""
    response = entry.response if isinstance(entry.response, dict) else {}
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    requested = entry.request.get("model")
    return RequestSummary(
        time=time.time() - entry.timings.total,
        route=entry.endpoint,
        model=model or (requested if isinstance(requested, str) else None),
        status=entry.status,
        prompt_tokens=prompt if isinstance(prompt, int) else None,
        completion_tokens=completion if isinstance(completion, int) else None,
        ttft=entry.timings.first_token,
        duration=entry.timings.total,
        reason=error_reason(response) if entry.status >= 400 else None,
    )
