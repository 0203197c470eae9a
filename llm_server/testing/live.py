"""A real uvicorn server on a loopback port in a background thread (tests, benchmark, replay)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from llm_server.api.app import AppState, create_app
from llm_server.engines.contract import Engine
from llm_server.listen import tcp_socket
from llm_server.service import ModelService
from llm_server.settings import ServerSettings


class LiveServer:
    """Serve `service` over HTTP on 127.0.0.1:<free port>; use as a context manager."""

    def __init__(self, service: ModelService, model_id: str | None = None, **app_options) -> None:
        self.service = service
        self.state = AppState(service, model_id or service.config.model_id)
        self.app = create_app(self.state, **app_options)
        self._sock = tcp_socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self._sock]))

    def start(self, timeout: float = 60.0) -> LiveServer:
        self.service.wait_ready(timeout)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tiny_service(
    model_path: Path,
    concurrent: int = 1,
    max_queued: int = 16,
    engine_factory: Callable[[], Engine] | None = None,
    **fields: Any,
) -> ModelService:
    """A started service on `model_path` (helper for tests); `fields`: ServerSettings.replace's
    (any part's field by its name, e.g. prefix_cache_dir, constrained_mode)."""
    from llm_server.server import make_service

    settings = ServerSettings().replace(rows=concurrent, max_queued=max_queued, **fields)
    svc = make_service(settings, model_path, engine_factory)
    svc.wait_ready(120)
    return svc


@contextlib.contextmanager
def serving(
    model_path: Path, concurrent: int = 1, max_queued: int = 16, app_options=None, **kw
) -> Iterator[LiveServer]:
    """A started service behind a live HTTP server; both are stopped on the way out."""
    svc = tiny_service(model_path, concurrent, max_queued, **kw)
    try:
        srv = LiveServer(svc, **(app_options or {})).start()
        try:
            yield srv
        finally:
            srv.stop()
    finally:
        svc.scheduler.abort()
        svc.close(30)
