"""Process wiring: build the service, run uvicorn on a bound socket, print the ready line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
from pathlib import Path

import uvicorn

from llm_server.api.app import AppState, create_app
from llm_server.api.shared.request_log import RequestRecorder
from llm_server.api.shared.security import resolve_api_key
from llm_server.model_source import pick_backend
from llm_server.scheduler.batch import (
    DEFAULT_PREFILL_TOKENS,
    DEFAULT_SPEC_TOKENS,
    DEFAULT_SPECULATIVE,
    DEFAULT_STEP_TOKENS,
)
from llm_server.service import ModelService, ServiceConfig
from llm_server.shutdown import DrainingServer
from llm_server.warm_prompts import prepare_engine, warm_tokens

log = logging.getLogger("llm_server")

MAX_HEADER_BYTES = 16 * 1024  # request line + headers; more gets a plain 400 from h11


def make_service(
    model_path: Path,
    model_id: str,
    concurrent: int,
    max_queued: int = 16,
    dtype: str = "float32",
    context_length: int | None = None,
    default_max_tokens: int = 512,
    engine_factory=None,
    backend: str = "auto",
    constrained_mode: str = "batched",
    prefix_cache_bytes: int | None = None,
    kv_keep_alive: float | None = None,
    pooling: str | None = None,
    keep_quantized: bool = False,
    compiled_decode: bool | None = None,
    chat_template: str | None = None,
    tool_parser: str | None = None,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
    speculative: str = DEFAULT_SPECULATIVE,
    spec_tokens: int = DEFAULT_SPEC_TOKENS,
    group=None,
    group_backend: str = "",
    group_timeout: float = 20.0,
    parallel: str = "tensor",
    aliases: tuple[str, ...] = (),
    prefix_cache_dir: Path | None = None,
    prefix_cache_disk_bytes: int | None = None,
    warm_prompts: list | None = None,
) -> ModelService:
    """A started (loading) service for `model_path`; the engine loads on the scheduler thread.

    `prefix_cache_dir`/`prefix_cache_disk_bytes`: the prefix cache's disk tier; `warm_prompts`:
    items of a --warm-prompts file, prefilled into the prefix cache during the load."""
    rows = concurrent  # the engine may serve fewer; BatchScheduler.load decides (S1)
    chosen = pick_backend(model_path, backend)

    def factory():
        if chosen == "coreml":
            from llm_server.engines.coreml.engine import CoreMLEngine

            return CoreMLEngine(model_path)
        from llm_server.engines.mlx.engine import MLXEngine
        from llm_server.engines.settings import EngineSettings

        settings = EngineSettings(
            rows=rows,
            context_length=context_length,
            dtype=dtype,
            prefix_cache_bytes=prefix_cache_bytes,
            keep_quantized=keep_quantized,
            **({} if kv_keep_alive is None else {"kv_keep_alive": kv_keep_alive}),
            compiled_decode=compiled_decode,
            group=group,
            parallel=parallel,
        )
        engine = MLXEngine(model_path, settings)
        if group is None:
            prepare_engine(engine, prefix_cache_dir, prefix_cache_disk_bytes, warm)
            return engine
        from llm_server.distributed.launch import wrap

        # rank 0: every call broadcast first
        return wrap(engine, group, group_backend, group_timeout, mode=parallel)

    tokenizer_path = model_path.parent if model_path.suffix == ".mlpackage" else model_path
    config = ServiceConfig(
        model_path=tokenizer_path,
        model_id=model_id,
        aliases=aliases,
        concurrent_requests=rows,
        max_queued=max_queued,
        dtype=dtype,
        default_max_tokens=default_max_tokens,
        constrained_mode=constrained_mode,
        pooling=pooling,
        chat_template=chat_template,
        tool_parser=tool_parser,
        step_tokens=step_tokens,
        prefill_tokens=prefill_tokens,
        speculative=speculative,
        spec_tokens=spec_tokens,
    )
    service = ModelService(config, engine_factory or factory)
    warm = warm_tokens(service, warm_prompts or [])  # bad items fail here, before the load
    service.start()
    if group is not None:
        from llm_server.distributed.launch import attach

        attach(service)  # a hung step fails its requests from the watchdog
    return service


def service_from_args(
    args: argparse.Namespace,
    model_path: Path,
    model_id: str,
    max_queued: int | None = None,
    aliases: tuple[str, ...] = (),
) -> ModelService:
    """make_service() with the CLI's settings (the queue bound may be raised for replay)."""
    return make_service(
        model_path,
        model_id,
        args.concurrent_requests,
        args.max_queued if max_queued is None else max_queued,
        args.dtype,
        args.context_length,
        args.default_max_tokens,
        constrained_mode=args.constrained_mode,
        backend=args.backend,
        prefix_cache_bytes=args.prefix_cache_bytes,
        kv_keep_alive=getattr(args, "kv_keep_alive", None),
        pooling=args.pooling,
        keep_quantized=args.keep_quantized,
        compiled_decode={"on": True, "off": False}.get(args.compiled_decode),
        chat_template=args.chat_template,
        tool_parser=args.tool_parser,
        step_tokens=args.step_tokens,
        prefill_tokens=args.prefill_tokens,
        speculative=args.speculative,
        spec_tokens=args.spec_tokens,
        group=getattr(args, "group", None),  # set by cli.main when it joined a group
        group_backend=args.distributed or "",
        group_timeout=args.distributed_timeout,
        parallel="pipeline" if args.pipeline else "tensor",
        aliases=aliases,
        prefix_cache_dir=getattr(args, "prefix_cache_dir", None),
        prefix_cache_disk_bytes=getattr(args, "prefix_cache_disk_bytes", None),
        warm_prompts=getattr(args, "warm_prompts", None),
    )


def _http_server(args: argparse.Namespace, state: AppState, request_log):
    """The app over `state` and the draining uvicorn server that serves it (one model or many)."""
    app = create_app(
        state,
        api_key=args.api_key,
        cors_origins=args.cors_origin,
        max_body_bytes=args.max_body_size,
        request_log=request_log,
    )
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=30,
        http="h11",  # the same parser (and header limit) whether or not httptools is installed
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    return app, DrainingServer(config, state, drain_timeout=args.drain_timeout)


async def run_server(
    args: argparse.Namespace, model_path: Path, sock: socket.socket, url: str
) -> int:
    model_id = args.model_id or model_path.name
    state = AppState(None, model_id)
    request_log = open_request_log(args.log_requests)
    app, server = _http_server(args, state, request_log)

    async def load() -> None:
        service = await asyncio.to_thread(service_from_args, args, model_path, model_id)
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
    args: argparse.Namespace, entries: list, sock: socket.socket, url: str
) -> int:
    """Serve the registry `entries` (models.registry.ModelEntry) until stopped."""
    from llm_server.models.daemon import build_manager, manage
    from llm_server.models.memory import format_bytes

    manager = build_manager(args, entries, service_from_args)
    state = AppState(None, manager.default_id, manager=manager)
    request_log = open_request_log(args.log_requests)
    app, server = _http_server(args, state, request_log)
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


async def run_replay(args: argparse.Namespace, model_path: Path) -> int:
    """--replay FILE: run the log through the app in-process, print the report, exit code."""
    from replay.cli import finish, load
    from replay.runner import replay_app

    request_log = load(args.replay, "llm-server")
    model_id = args.model_id or model_path.name
    # The queue holds the whole log, so --replay-concurrent admits everything at once.
    queued = max(args.max_queued, len(request_log.entries))
    service = await asyncio.to_thread(service_from_args, args, model_path, model_id, queued)
    recorder = open_request_log(args.log_requests)
    try:
        await asyncio.to_thread(service.wait_ready)
        key = resolve_api_key(args.api_key)
        app = create_app(
            AppState(service, model_id),
            api_key=key,
            max_body_bytes=args.max_body_size,
            request_log=recorder,
        )
        report = await replay_app(
            app,
            request_log,
            concurrent=args.replay_concurrent,
            api_key=key,
            max_rows_busy=lambda: service.scheduler.stats().max_rows_busy,
        )
    finally:
        await asyncio.to_thread(service.close, 30)
        if recorder is not None:
            await asyncio.to_thread(recorder.close)
    return finish(report, args.replay_report, args.replay_check)
