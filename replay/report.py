"""The replay report: one result per request, totals, as JSON and as a readable summary."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from replay.compare import Difference
from replay.log import CorruptLine


@dataclass(frozen=True)
class RequestResult:
    """One replayed request next to its log entry."""

    line: int | None  # line number in the log
    endpoint: str
    stream: bool
    deterministic: bool  # temperature 0 or scoring: must match the log
    logged_status: int
    status: int  # 0 when the transport failed
    identical: bool
    difference: Difference | None
    latency: float  # seconds
    logged_latency: float | None  # seconds, as recorded
    completion_tokens: int
    retries: int = 0  # 429 answers retried
    fingerprint: str | None = None
    logged_fingerprint: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Totals:
    requests: int
    identical: int
    different: int
    deterministic_different: int  # what --replay-check fails on
    corrupt_lines: int
    wall_seconds: float
    requests_per_second: float
    tokens_per_second: float  # completion tokens
    completion_tokens: int
    latency_p50: float | None  # seconds
    latency_p99: float | None
    max_rows_busy: int | None  # scheduler rows decoding at once (high-water mark or sampled)


@dataclass(frozen=True)
class Report:
    source: str  # "in-process" or the server URL
    concurrent: bool
    totals: Totals
    results: list[RequestResult] = field(default_factory=list)
    corrupt: list[CorruptLine] = field(default_factory=list)

    @property
    def failed_check(self) -> bool:
        """True when a deterministic request did not reproduce the logged output."""
        return self.totals.deterministic_different > 0

    def to_dict(self) -> dict:
        return asdict(self)

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")

    def summary(self) -> str:
        """A readable table of every request, the corrupt lines, then the totals."""
        mode = "concurrent" if self.concurrent else "serial"
        lines = [f"replay ({mode}, {self.source}): {self.totals.requests} requests"]
        lines.append(
            f"{'line':>5}  {'endpoint':<22} {'status':>6}  {'det':<3}  {'latency':>8}  match"
        )
        for r in self.results:
            status = (
                str(r.status) if r.status == r.logged_status else f"{r.status}!={r.logged_status}"
            )
            det = "yes" if r.deterministic else "no"
            lines.append(
                f"{r.line or 0:>5}  {r.endpoint:<22} {status:>6}  {det:<3}  "
                f"{r.latency:>7.3f}s  {_match(r)}"
            )
        for c in self.corrupt:
            lines.append(f"corrupt line {c.line} skipped: {c.error}")
        t = self.totals
        lines.append(
            f"totals: {t.requests} requests in {t.wall_seconds:.2f}s: "
            f"{t.requests_per_second:.2f} req/s, {t.tokens_per_second:.1f} tokens/s, "
            f"latency p50 {_secs(t.latency_p50)} p99 {_secs(t.latency_p99)}"
        )
        lines.append(
            f"identical {t.identical}/{t.requests}, deterministic differing "
            f"{t.deterministic_different}, corrupt lines {t.corrupt_lines}, "
            f"max rows busy {t.max_rows_busy if t.max_rows_busy is not None else '-'}"
        )
        return "\n".join(lines)


def _match(r: RequestResult) -> str:
    if r.identical:
        return "identical"
    d = r.difference
    if d is None:
        return "differs"
    where = d.field if d.position is None else f"{d.field} at {d.unit} {d.position}"
    label = "DIFFERS" if r.deterministic else "differs (sampled, not checked)"
    return f"{label}: {where}" + (f" ({r.error})" if r.error else "")


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def build_report(
    results: list[RequestResult],
    corrupt: list[CorruptLine],
    wall: float,
    concurrent: bool,
    max_rows_busy: int | None,
    source: str,
) -> Report:
    latencies = [r.latency for r in results]
    tokens = sum(r.completion_tokens for r in results)
    identical = sum(r.identical for r in results)
    totals = Totals(
        requests=len(results),
        identical=identical,
        different=len(results) - identical,
        deterministic_different=sum(r.deterministic and not r.identical for r in results),
        corrupt_lines=len(corrupt),
        wall_seconds=wall,
        requests_per_second=len(results) / wall if wall > 0 else 0.0,
        tokens_per_second=tokens / wall if wall > 0 else 0.0,
        completion_tokens=tokens,
        latency_p50=percentile(latencies, 50),
        latency_p99=percentile(latencies, 99),
        max_rows_busy=max_rows_busy,
    )
    return Report(source, concurrent, totals, results, list(corrupt))
