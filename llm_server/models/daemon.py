"""Process wiring of the many-model daemon (`--models FILE`): the manager from the CLI's
settings, the app, uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import socket
from pathlib import Path

import uvicorn

from llm_server.api.app import create_app
from llm_server.api.state import AppState
from llm_server.model_source import resolve_model_source
from llm_server.models.manager import ManagerConfig, ModelManager
from llm_server.models.memory import ModelSize, default_budget, estimate_size, format_bytes
from llm_server.models.metrics import ModelsCollector
from llm_server.models.registry import ModelEntry
from llm_server.service import ModelService
from llm_server.shutdown import DrainingServer

log = logging.getLogger("llm_server")


def entry_args(args: argparse.Namespace, entry: ModelEntry) -> argparse.Namespace:
    """The CLI's settings with the entry's own overrides."""
    out = copy.copy(args)
    for name in (
        "concurrent_requests",
        "context_length",
        "keep_quantized",
        "pooling",
        "tool_parser",
    ):
        value = getattr(entry, name)
        if value is not None:
            setattr(out, name, value)
    out.group = None
    return out


def build_manager(args: argparse.Namespace, entries: list[ModelEntry]) -> ModelManager:
    from llm_server.server import service_from_args

    def factory(entry: ModelEntry, path: Path) -> ModelService:
        return service_from_args(entry_args(args, entry), path, entry.id, aliases=entry.aliases)

    def estimate(entry: ModelEntry, path: Path) -> ModelSize:
        a = entry_args(args, entry)
        return estimate_size(
            path,
            a.concurrent_requests,
            a.context_length,
            a.dtype,
            a.keep_quantized,
            a.prefix_cache_bytes,
        )

    budget = args.max_memory if args.max_memory is not None else default_budget()
    config = ManagerConfig(budget=budget, idle_unload=args.idle_unload, max_waiting=args.max_queued)
    return ModelManager(entries, config, factory, estimate, resolve_source)


def resolve_source(source: str) -> Path:
    """A registry source as a folder to load; "default" is the embedded default model."""
    return resolve_model_source(None if source == "default" else source).path


def manage(state: AppState, app) -> None:
    """Per-model metrics on the app: step listeners on each loaded service, labelled gauges."""
    manager = state.manager
    manager.on_loaded(lambda _id, service: app.state.metrics.attach(service))
    app.state.metrics.registry.register(ModelsCollector(manager))


async def run_models_server(
    args: argparse.Namespace, entries: list[ModelEntry], sock: socket.socket, url: str
) -> int:
    from llm_server.server import MAX_HEADER_BYTES, open_request_log

    manager = build_manager(args, entries)
    state = AppState(None, manager.default_id, manager=manager)
    request_log = open_request_log(args.log_requests)
    app = create_app(
        state,
        api_key=args.api_key,
        cors_origins=args.cors_origin,
        max_body_bytes=args.max_body_size,
        request_log=request_log,
    )
    manage(state, app)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=30,
        http="h11",
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = DrainingServer(config, state, drain_timeout=args.drain_timeout)

    async def start() -> None:
        manager.start()
        pinned = [s.task for s in manager.slots.values() if s.task is not None]
        await asyncio.gather(*pinned, return_exceptions=True)
        log.info(
            "serving %d models (%s pinned) within %s",
            len(manager.slots),
            sum(e.pinned for e in entries),
            format_bytes(manager.config.budget),
        )
        print(f"llm-server ready on {url}", flush=True)

    starter = asyncio.create_task(start())
    try:
        await server.serve(sockets=[sock])
    finally:
        state.draining = True
        starter.cancel()
        await manager.close()
        if request_log is not None:
            await asyncio.to_thread(request_log.close)
        with contextlib.suppress(OSError):
            sock.close()
    return 0
