"""Prometheus metrics for one app: its own registry, request counts, tokens, rows, queue, steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_server.service import ModelService

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _SchedulerCollector(Collector):
    """Rows busy and queue length, read from the scheduler at scrape time."""

    def __init__(self, get_service: Callable[[], ModelService | None]) -> None:
        self._get_service = get_service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        svc = self._get_service()
        stats = svc.scheduler.stats() if svc is not None and svc.ready else None
        values = {
            "llm_server_rows": ("rows serving requests", stats.rows if stats else 0),
            "llm_server_rows_busy": (
                "rows decoding a request now",
                stats.rows_busy if stats else 0,
            ),
            "llm_server_queue_length": ("requests waiting for a row", stats.queued if stats else 0),
            "llm_server_ready": ("1 once the model is loaded", 1 if stats else 0),
        }
        cache = svc.prefix_cache_stats() if stats else None
        if cache is not None:
            values["llm_server_prefix_cache_entries"] = ("prefix cache entries", cache.entries)
            values["llm_server_prefix_cache_bytes"] = (
                "bytes held by the prefix cache",
                cache.bytes,
            )
            values["llm_server_prefix_cache_hits"] = ("prefix cache hits since start", cache.hits)
            values["llm_server_prefix_cache_hit_tokens"] = (
                "prompt tokens reused from the prefix cache since start",
                cache.hit_tokens,
            )
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """Everything /metrics reports for one app (a registry per app, so tests don't collide)."""

    def __init__(self, get_service: Callable[[], ModelService | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "llm_server_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.tokens_generated = Counter(
            "llm_server_tokens_generated", "completion tokens generated", registry=self.registry
        )
        self.step_seconds = Histogram(
            "llm_server_step_seconds",
            "seconds per batched decode step",
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.step_rows = Counter(
            "llm_server_step_rows", "rows advanced by decode steps", registry=self.registry
        )
        self.registry.register(_SchedulerCollector(get_service))

    def on_step(self, seconds: float, rows: int) -> None:
        """The scheduler's per-step callback (runs on the scheduler thread)."""
        self.step_seconds.observe(seconds)
        self.step_rows.inc(rows)

    def attach(self, service: ModelService) -> None:
        service.scheduler.add_step_listener(self.on_step)

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def metrics_endpoint(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


class RequestCounter:
    """ASGI middleware: count every HTTP response by route template and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started becomes a 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(route=label, status=str(status)).inc()
