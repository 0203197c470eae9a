"""Exclusive lease (S6): pauses the batch at a step boundary and gives its holder the engine.

The holder's work still runs on the scheduler thread (the one thread that owns the engine):
`lease.submit(fn)` runs `fn(engine)` there while every row stays paused and returns its
future; `release()` (or leaving a `with` block) resumes the batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class Lease:
    """One holder's claim on the engine; granted in FIFO order, released exactly once."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.granted: Future[None] = Future()
        self.released = threading.Event()
        self.calls: list[tuple[Callable[[Any], Any], Future]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[Any], Any]) -> Future:
        """Queue `fn(engine)` to run on the scheduler thread; returns its future."""
        if self.released.is_set():
            raise RuntimeError("this lease was released")
        fut: Future = Future()
        with self._lock:
            self.calls.append((fn, fut))
        self._wake()
        return fut

    def take_calls(self) -> list[tuple[Callable[[Any], Any], Future]]:
        """The queued calls, in order, for the scheduler thread to run."""
        with self._lock:
            calls, self.calls = self.calls, []
        return calls

    def release(self) -> None:
        """Give the engine back (idempotent; also fine before the lease was granted)."""
        if not self.released.is_set():
            self.released.set()
            self._wake()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
