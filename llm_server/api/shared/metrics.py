"""Prometheus metrics for one app: its own registry, request counts, tokens, rows, queue, steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_server.batch.runner import BatchRunner
from llm_server.models.metrics import held_bytes_family
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
            "llm_server_draft_tokens": (
                "speculative draft tokens verified since start",
                stats.drafted_tokens if stats else 0,
            ),
            "llm_server_draft_accepted_tokens": (
                "speculative draft tokens accepted since start",
                stats.accepted_tokens if stats else 0,
            ),
        }
        cache = svc.prefix_cache_stats() if stats else None
        if cache is not None:
            values["llm_server_prefix_cache_entries"] = ("prefix cache entries", cache.entries)
            values["llm_server_prefix_cache_bytes"] = (
                "bytes held by the prefix cache",
                cache.bytes,
            )
            values["llm_server_prefix_cache_kept_tokens"] = (
                "positions of released rows' histories reused in place, not yet in the cache",
                cache.kept_tokens,
            )
            values["llm_server_prefix_cache_hits"] = ("prefix cache hits since start", cache.hits)
            values["llm_server_prefix_cache_hit_tokens"] = (
                "prompt tokens reused from the prefix cache since start",
                cache.hit_tokens,
            )
            values["llm_server_prefix_cache_disk_bytes"] = (
                "bytes the prefix cache's disk tier holds (--prefix-cache-dir)",
                cache.disk_bytes,
            )
            values["llm_server_prefix_cache_disk_entries"] = (
                "entries on the prefix cache's disk tier",
                cache.disk_entries,
            )
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(name, doc, value=value)
        if stats is not None:
            yield held_bytes_family({"": svc.engine.held_bytes().as_dict()})
        if cache is not None:
            yield from _prefix_counters(cache)
        vision = svc.vision if stats else None
        if vision is not None:
            yield CounterMetricFamily(
                "llm_server_vision_encode_seconds",
                "seconds the vision tower and projector ran since start",
                value=vision.encode_seconds,
            )
            yield CounterMetricFamily(
                "llm_server_vision_images",
                "images through the vision tower since start (a resent image is not counted)",
                value=vision.images_encoded,
            )


def _prefix_counters(cache) -> Iterator[CounterMetricFamily]:
    """The prefix cache's monotonic counts (exposed with the `_total` suffix)."""
    counts = {
        "llm_server_prefix_cache_misses": ("prefills that reused no prefix", cache.misses),
        "llm_server_prefix_cache_disk_reads": (
            "prefix cache entries read back from the disk tier",
            cache.disk_reads,
        ),
        "llm_server_prefix_cache_disk_read_bytes": (
            "bytes read from the prefix cache's disk tier",
            cache.disk_read_bytes,
        ),
        "llm_server_prefix_cache_disk_writes": (
            "prefix cache entries written to the disk tier",
            cache.disk_writes,
        ),
        "llm_server_prefix_cache_disk_write_bytes": (
            "bytes written to the prefix cache's disk tier",
            cache.disk_write_bytes,
        ),
        "llm_server_prefix_cache_disk_corrupt": (
            "prefix cache files skipped for a bad checksum, header or size",
            cache.disk_corrupt,
        ),
    }
    for name, (doc, value) in counts.items():
        yield CounterMetricFamily(name, doc, value=value)


class _BatchCollector(Collector):
    """The Batch API's progress: the running batch's lines, rate and time left."""

    def __init__(self, runner: BatchRunner) -> None:
        self._runner = runner

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        progress = self._runner.progress
        eta = progress.eta_seconds() if progress is not None else None
        values = {
            "llm_server_batch_running_lines_done": (
                "lines of the running batch that have their answer",
                progress.done if progress else 0,
            ),
            "llm_server_batch_running_lines": (
                "lines of the running batch",
                progress.total if progress else 0,
            ),
            "llm_server_batch_tokens_per_second": (
                "completion tokens per second of the running batch",
                progress.tokens_per_second() if progress else 0.0,
            ),
            "llm_server_batch_eta_seconds": (
                "estimated seconds until the running batch's last line (0: none running)",
                eta or 0.0,
            ),
        }
        for name, (doc, value) in values.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "llm_server_batch_lines_answered",
            "batch lines answered since start (all batches)",
            self._runner.finished_lines,
        )


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

    def attach_batches(self, runner: BatchRunner) -> None:
        self.registry.register(_BatchCollector(runner))

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
