"""The request-log format (version 1): one JSON object per line, written by `--log-requests`.

    {"v": 1, "time": "2025-01-01T12:00:00.000Z", "endpoint": "/v1/chat/completions",
     "stream": false, "request": {...}, "status": 200, "response": {...},
     "timings": {"queue_wait": 0.001, "first_token": 0.02, "total": 0.31},
     "fingerprint": "fp_..."}

`request` is the JSON body as sent (never headers, so never an API key); `response` is the final
JSON body, a stream aggregated into the equivalent non-stream body; timings are seconds (None
where the request never got that far). Stdlib only: the format is shared by the server's
recorder and the replay tools.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

LOG_VERSION = 1
REQUIRED = ("v", "endpoint", "request", "response", "status")


@dataclass(frozen=True)
class Timings:
    """Seconds; None where the request never got that far (scoring has no queue or first token)."""

    queue_wait: float | None = None  # admission to a free row (the scheduler's queue)
    first_token: float | None = None  # arrival to the first generated token
    total: float | None = None  # arrival to the last response byte


@dataclass(frozen=True)
class LogEntry:
    """One finished request as the server answered it."""

    endpoint: str  # the URL path, e.g. "/v1/chat/completions"
    request: dict  # the JSON body
    response: dict | None  # the final JSON body (streams aggregated); None when not JSON
    status: int  # HTTP status
    stream: bool = False  # the client asked for SSE
    timings: Timings = field(default_factory=Timings)
    fingerprint: str | None = None  # the server's system_fingerprint
    time: str = ""  # ISO 8601 UTC arrival time
    line: int | None = None  # line number in the file it was read from (not written)

    def to_json(self) -> str:
        """The log line (without the newline)."""
        body = {
            "v": LOG_VERSION,
            "time": self.time or utc_now(),
            "endpoint": self.endpoint,
            "stream": self.stream,
            "request": self.request,
            "status": self.status,
            "response": self.response,
            "timings": asdict(self.timings),
            "fingerprint": self.fingerprint,
        }
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class CorruptLine:
    """A log line that could not be read, and why."""

    line: int  # 1-based
    error: str


@dataclass(frozen=True)
class RequestLog:
    """What a log file held: the readable entries in file order, and the unreadable lines."""

    entries: list[LogEntry]
    corrupt: list[CorruptLine]


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_line(text: str, line: int | None = None) -> LogEntry:
    """One log line -> LogEntry; raises ValueError saying what is wrong with it."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    if obj["v"] != LOG_VERSION:
        raise ValueError(f"log version {obj['v']!r} is not supported (this reads {LOG_VERSION})")
    if not isinstance(obj["endpoint"], str) or not obj["endpoint"].startswith("/"):
        raise ValueError("'endpoint' must be a URL path")
    if not isinstance(obj["request"], dict):
        raise ValueError("'request' must be a JSON object")
    if not isinstance(obj["status"], int):
        raise ValueError("'status' must be an integer")
    t = obj.get("timings") or {}
    return LogEntry(
        endpoint=obj["endpoint"],
        request=obj["request"],
        response=obj["response"] if isinstance(obj["response"], dict) else None,
        status=obj["status"],
        stream=bool(obj.get("stream", obj["request"].get("stream", False))),
        timings=Timings(t.get("queue_wait"), t.get("first_token"), t.get("total")),
        fingerprint=obj.get("fingerprint"),
        time=obj.get("time", ""),
        line=line,
    )


def read_log(path: str | Path) -> RequestLog:
    """Read a log file; unreadable lines are collected with their line numbers, not fatal."""
    entries: list[LogEntry] = []
    corrupt: list[CorruptLine] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                entries.append(parse_line(text, n))
            except ValueError as exc:
                corrupt.append(CorruptLine(n, str(exc)))
    return RequestLog(entries, corrupt)
