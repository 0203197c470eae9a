"""Process wiring: build the service, run uvicorn on a bound socket, print the ready line."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn

from llm_server.api.app import AppState, create_app
from llm_server.api.shared.request_log import RequestRecorder
from llm_server.api.shared.security import resolve_api_key
from llm_server.engines.contract import Engine
from llm_server.model_source import pick_backend
from llm_server.service import ModelService
from llm_server.settings import HTTPSettings, ServerSettings
from llm_server.shutdown import DrainingServer
from llm_server.warm_prompts import warm_tokens

log = logging.getLogger("llm_server")

MAX_HEADER_BYTES = 16 * 1024  # request line + headers; more gets a plain 400 from h11


def make_service(
    settings: ServerSettings,
    model_path: Path,
    engine_factory: Callable[[], Engine] | None = None,
) -> ModelService:
    """A started (loading) service for `model_path` as `settings` say; the engine loads on the
    scheduler thread, its disk tier and warm prompts with it (EngineSettings). The model's id
    is `settings.service.model_id`, else the folder's name."""
    service_config = settings.service
    if not service_config.model_id:
        service_config = dataclasses.replace(service_config, model_id=model_path.name)
    chosen = pick_backend(model_path, settings.backend)
    if settings.max_memory is not None and settings.engine.budget is None:
        settings = with_budget(settings, model_path, service_config.model_id)
    engine_settings = settings.engine  # with the warm prompts' ids once they are tokenized

    def factory() -> Engine:
        if chosen == "coreml":
            from llm_server.engines.coreml.engine import CoreMLEngine

            return CoreMLEngine(model_path)
        from llm_server.engines.mlx.engine import MLXEngine

        engine = MLXEngine(model_path, engine_settings)
        if engine_settings.group is None:
            return engine
        from llm_server.distributed.launch import wrap

        return wrap(engine, settings)  # rank 0: every call broadcast first

    tokenizer_path = model_path.parent if model_path.suffix == ".mlpackage" else model_path
    service = ModelService(
        tokenizer_path, service_config, settings.engine.rows, engine_factory or factory
    )
    # bad items fail here, before the load
    warm = warm_tokens(service, list(settings.warm_prompts))
    engine_settings = dataclasses.replace(engine_settings, warm_tokens=tuple(map(tuple, warm)))
    service.start()
    if settings.engine.group is not None:
        from llm_server.distributed.launch import attach

        attach(service)  # a hung step fails its requests from the watchdog
    return service


def with_budget(settings: ServerSettings, model_path: Path, model_id: str) -> ServerSettings:
    """One model under --max-memory: its budget account, and (no --context-length) the
    context its rows hold within the budget beside its weights."""
    from llm_server.engines.kv.budget import MemoryBudget
    from llm_server.models.memory import estimate_size

    engine = settings.engine
    account = MemoryBudget(settings.max_memory).account(model_id)
    context = engine.context_length
    if context is None and model_path.suffix != ".mlpackage":
        size = estimate_size(
            model_path,
            engine.rows,
            None,
            engine.dtype,
            engine.keep_quantized,
            engine.prefix_cache_bytes,
            engine.score_rows,
            settings.max_memory,
            kv_format=(engine.kv_dtype, engine.kv_bits, engine.kv_group_size),
        )
        context = size.context or None
        log.info("%s: context %s positions within the memory budget", model_id, context)
    return settings.replace(budget=account, context_length=context)


def _http_server(http: HTTPSettings, state: AppState, request_log):
    """The app over `state` and the draining uvicorn server that serves it (one model or many)."""
    app = create_app(
        state,
        api_key=http.api_key,
        cors_origins=list(http.cors_origins),
        max_body_bytes=http.max_body_bytes,
        request_log=request_log,
        ui=http.ui,
        data_dir=http.data_dir,
        max_file_bytes=http.max_file_bytes,
        images=http.images,
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=30,
        http="h11",  # the same parser (and header limit) whether or not httptools is installed
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    return app, DrainingServer(config, state, drain_timeout=http.drain_timeout)


async def run_server(
    settings: ServerSettings, model_path: Path, sock: socket.socket, url: str
) -> int:
    model_id = settings.service.model_id or model_path.name
    state = AppState(None, model_id)
    request_log = open_request_log(settings.http.log_requests)
    app, server = _http_server(settings.http, state, request_log)

    async def load() -> None:
        service = await asyncio.to_thread(make_service, settings, model_path)
        state.service = service
        try:
            await asyncio.to_thread(service.wait_ready)
        except Exception as exc:  # noqa: BLE001 - reported, then the process exits non-zero
            log.error("failed to load %s: %s", model_path, exc)
            server.should_exit = True
            return
        log.info(
            "serving %s (%s, rows=%d)",
            model_id,
            service.engine.name,
            service.scheduler.max_concurrent,
        )
        print(f"llm-server ready on {url}", flush=True)

    loader = asyncio.create_task(load())
    try:
        await server.serve(sockets=[sock])
    finally:
        state.draining = True
        if not loader.done():
            loader.cancel()
        if state.service is not None:
            await asyncio.to_thread(state.service.close, 30)
        if request_log is not None:  # after the drain: every finished request has its line
            await asyncio.to_thread(request_log.close)
        with contextlib.suppress(OSError):
            sock.close()
    return 0 if state.service is not None and state.service.ready else 1


async def run_models_server(
    settings: ServerSettings,
    entries: list,
    sock: socket.socket,
    url: str,
    max_memory: int | None = None,
    idle_unload: float | None = None,
    load_wait: float | None = None,
) -> int:
    """Serve the registry `entries` (models.registry.ModelEntry) until stopped, within
    `max_memory` bytes (None: models.memory.default_budget), unloading a model idle for
    `idle_unload` seconds (None: never); a load waits up to `load_wait` seconds for room
    (None: the manager's default)."""
    from llm_server.models.daemon import build_manager, manage
    from llm_server.models.memory import format_bytes

    manager = build_manager(settings, entries, make_service, max_memory, idle_unload, load_wait)
    state = AppState(None, manager.default_id, manager=manager)
    request_log = open_request_log(settings.http.log_requests)
    app, server = _http_server(settings.http, state, request_log)
    manage(state, app)

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


def open_request_log(path: str | None) -> RequestRecorder | None:
    """The --log-requests recorder (appending), or None; exits with a message if unwritable."""
    if not path:
        return None
    try:
        return RequestRecorder(path)
    except OSError as exc:
        raise SystemExit(
            f"llm-server: cannot write the request log {path}: {exc.strerror}"
        ) from None


async def run_replay(
    settings: ServerSettings,
    model_path: Path,
    log_path: str,
    concurrent: bool = False,
    check: bool = False,
    report_path: str | None = None,
) -> int:
    """--replay FILE: run the log through the app in-process, print the report, exit code
    (`concurrent`, `check`, `report_path`: --replay-concurrent, --replay-check and
    --replay-report)."""
    from replay.cli import finish, load
    from replay.runner import replay_app

    request_log = load(log_path, "llm-server")
    model_id = settings.service.model_id or model_path.name
    # The queue holds the whole log, so --replay-concurrent admits everything at once.
    queued = max(settings.service.max_queued, len(request_log.entries))
    replaying = settings.replace(model_id=model_id, max_queued=queued)
    service = await asyncio.to_thread(make_service, replaying, model_path)
    recorder = open_request_log(settings.http.log_requests)
    try:
        await asyncio.to_thread(service.wait_ready)
        key = resolve_api_key(settings.http.api_key)
        app = create_app(
            AppState(service, model_id),
            api_key=key,
            max_body_bytes=settings.http.max_body_bytes,
            request_log=recorder,
            images=settings.http.images,
        )
        report = await replay_app(
            app,
            request_log,
            concurrent=concurrent,
            api_key=key,
            max_rows_busy=lambda: service.scheduler.stats().max_rows_busy,
        )
    finally:
        await asyncio.to_thread(service.close, 30)
        if recorder is not None:
            await asyncio.to_thread(recorder.close)
    return finish(report, report_path, check)
