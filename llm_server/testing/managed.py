"""A real uvicorn server in front of a ModelManager (many models on demand), for tests."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import uvicorn

from llm_server.api.app import AppState, create_app
from llm_server.engines.kv.budget import Account
from llm_server.listen import tcp_socket
from llm_server.models.daemon import load_settings, manage, share_disk
from llm_server.models.manager import ManagerConfig, ModelManager
from llm_server.models.memory import ModelSize, estimate_size
from llm_server.models.registry import ModelEntry
from llm_server.service import ModelService
from llm_server.settings import ServerSettings

GiB = 1 << 30


def tiny_factory(concurrent: int = 1, max_queued: int = 16, models: int = 1, **fields):
    """(entry, path) -> a started service, as the daemon makes them (entry overrides kept;
    the disk tier's bound shared by `models`); `fields`: ServerSettings.replace's."""
    from llm_server.server import make_service

    settings = ServerSettings().replace(rows=concurrent, max_queued=max_queued, **fields)
    settings = share_disk(settings, models)

    def make(entry: ModelEntry, path: Path, size: ModelSize, account: Account) -> ModelService:
        return make_service(load_settings(settings, entry, size, account), path)

    return make


def tiny_estimate(concurrent: int = 1, budget: int | None = None):
    def estimate(entry: ModelEntry, path: Path) -> ModelSize:
        rows = entry.concurrent_requests or concurrent
        return estimate_size(path, rows, entry.context_length, budget=budget)

    return estimate


class ManagedServer:
    """Serve `entries` on 127.0.0.1:<free port>; use as a context manager."""

    def __init__(
        self,
        entries: list[ModelEntry],
        budget: int = 8 * GiB,
        idle_unload: float | None = None,
        concurrent: int = 1,
        max_queued: int = 16,
        settings: dict | None = None,
        load_wait: float = 60.0,
        **app_options,
    ) -> None:
        """`settings`: ServerSettings.replace's fields for every model (e.g. prefix_cache_dir);
        `load_wait`: seconds a load waits for a model to go idle."""
        config = ManagerConfig(
            budget=budget, idle_unload=idle_unload, max_waiting=max_queued, load_wait=load_wait
        )
        factory = tiny_factory(concurrent, max_queued, len(entries), **(settings or {}))
        estimate = tiny_estimate(concurrent, budget)
        self.manager = ModelManager(entries, config, factory, estimate, Path)
        self.state = AppState(None, self.manager.default_id, manager=self.manager)
        self.app = create_app(self.state, **app_options)
        manage(self.state, self.app)
        self._sock = tcp_socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.manager.start()
        try:
            await self.server.serve(sockets=[self._sock])
        finally:
            await self.manager.close()

    def __enter__(self) -> ManagedServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def call(self, coro):
        """Run `coro` on the server's event loop (where the manager lives); its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(60)
        self._sock.close()
