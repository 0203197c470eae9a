"""Graceful shutdown: the first SIGTERM/SIGINT stops admitting and drains, a second exits at once.

uvicorn's own handling closes the listening socket on SIGTERM (new clients see "connection
refused", not an answer) and re-raises the signal after serving, so the process would end by
the signal rather than with status 0. `DrainingServer` replaces that handling.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from types import FrameType

import uvicorn

from llm_server.api.shared.state import AppState

log = logging.getLogger("llm_server")

EXIT_FORCED = 1  # status of a second SIGTERM/SIGINT: running requests were dropped
DRAIN_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first signal drains: new requests get 503 (AppState.draining),
    running and queued requests finish for up to `drain_timeout` seconds, then uvicorn closes
    its connections (each finishes the response it is sending) and `serve()` returns."""

    def __init__(self, config: uvicorn.Config, state: AppState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread): only sets flags; the loop does the work in on_tick."""
        name = signal.Signals(sig).name
        if self.drain_requested:
            log.warning("second %s: exiting now, dropping running requests", name)
            os._exit(EXIT_FORCED)
        log.info(
            "%s: refusing new requests, draining running ones (up to %gs)", name, self.drain_timeout
        )
        self.drain_requested = True
        self.state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        for hook in self.state.drain_hooks:
            await hook()
        while not _idle(self.state):
            if time.monotonic() > deadline:
                log.warning("drain timeout (%gs): cancelling running requests", self.drain_timeout)
                for service in self.state.services():
                    service.scheduler.abort()
                break
            await asyncio.sleep(DRAIN_POLL_S)
        self.should_exit = True  # uvicorn now lets each connection finish its response


def _idle(state: AppState) -> bool:
    """No generation running or queued and no scoring pending."""
    return all(
        svc.scheduler.idle() and not svc.scorer.pending() for svc in state.services() if svc.ready
    )
